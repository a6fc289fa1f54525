"""Errors shared by the engine's state owners; the service maps them onto gRPC status codes.

A field is named by its full path as the message or call spells it (`tree.width`, `stop[3]`,
`sampling.temperature`); `renamed` moves an error raised for a part onto the path of the whole.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=ValueError)


class VersionError(RuntimeError):
    """A message builds on a version the cache is not at (stale or future): FAILED_PRECONDITION."""

    def __init__(self, owner: str, expected: int, got: int):
        kind = "stale" if got < expected else "future"
        super().__init__(f"version: {kind} version {got} for {owner}, which is at version {expected}")
        self.field = "version"
        self.expected = expected
        self.got = got


class RequestError(ValueError):
    """A generation request is malformed (empty prompt, bad limits, unknown option); `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class WireError(ValueError):
    """A message field cannot be decoded (dtype, shape, byte count, missing part); `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def renamed(exc: E, field: str) -> E:
    """The same error (class and message) naming `field`: a part's error as the message holding the part spells it."""
    return type(exc)(field, str(exc).removeprefix(f"{exc.field}: "))
