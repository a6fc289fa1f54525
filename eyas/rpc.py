"""What every eyas server and client agree on: the shared-token key, the field trailer, the message-size floor.

A client attaches the shared token as `x-eyas-token` metadata; a refused call names the field it
concerns in an `eyas-field` trailer. Plain data, so a client needs neither the servers nor Ray.
"""

from __future__ import annotations

from collections.abc import Iterable

TOKEN_KEY = "x-eyas-token"
FIELD_KEY = "eyas-field"
MIN_REQUEST_BYTES = 1024  # the smallest service.max_request_bytes: a client checks larger messages against the service's own


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata a client attaches to every call (empty without a token)."""
    return ((TOKEN_KEY, token),) if token else ()


def field_of(trailing_metadata: Iterable[tuple[str, str]] | None) -> str:
    """The field a failed call names, from its trailing metadata (`error.trailing_metadata()`); "" when none."""
    for key, value in trailing_metadata or ():
        if key == FIELD_KEY:
            return value
    return ""
