"""Errors shared by the engine's state owners; the service maps them onto gRPC status codes."""

from __future__ import annotations


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
