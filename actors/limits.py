"""The bound of every field a caller controls, enforced where the message first arrives (docs/limits.md).

Sizes that follow from the models (prompt and Prefill length from the target's positions, tree
knobs from the service's tree policy, token ids from the vocabulary) are checked against those;
the fixed bounds live here. A value past its bound is refused with INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from eyas.errors import RequestError

MAX_ID_BYTES = 128  # request_id, JobItem.id, round_id: UTF-8 bytes
MAX_ROUND_ID_BYTES = 64
MAX_STOP_STRINGS = 16  # GenerateRequest.stop: entries
MAX_STOP_BYTES = 256  # GenerateRequest.stop: UTF-8 bytes of one entry
PROMPT_BYTES_PER_POSITION = 16  # GenerateRequest.text: at most this many UTF-8 bytes per target position
MAX_POOL_SIZE = 256  # ScaleRequest.draft / target
MAX_CHOICES = 16  # HTTP `n`: samples of one request, each a request of its own in the coordinator


def check_id(value: str, field: str, limit: int = MAX_ID_BYTES) -> None:
    """An identifier is at most `limit` UTF-8 bytes."""
    size = len(value.encode())
    if size > limit:
        raise RequestError(field, f"{size} bytes exceed the limit of {limit}")


def check_stop(stop: list[str]) -> None:
    """At most MAX_STOP_STRINGS stop strings of at most MAX_STOP_BYTES bytes each."""
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"{len(stop)} stop strings exceed the limit of {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if len(s.encode()) > MAX_STOP_BYTES:
            raise RequestError(f"stop[{i}]", f"{len(s.encode())} bytes exceed the limit of {MAX_STOP_BYTES}")


def check_prompt_text(text: str, max_positions: int) -> None:
    """A text prompt is refused before tokenizing when it is longer than the target could ever hold."""
    limit = PROMPT_BYTES_PER_POSITION * max_positions
    size = len(text.encode())
    if max_positions and size > limit:
        raise RequestError(
            "prompt",
            f"{size} bytes exceed the limit of {limit} ({PROMPT_BYTES_PER_POSITION} per target position, {max_positions} positions)",
        )
