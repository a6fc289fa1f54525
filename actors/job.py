"""A request in flight inside the coordinator (`Job`) and what it emits to the front door (`Chunk`).

Its own module so that the coordinator and the front door both build on it without importing
each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from eyas.request import RequestState
from eyas.stats import GenerationStats
from eyas.trace.record import RequestRecorder
from eyas.tree import TreePolicy

from .proxy import CallTiming, RemoteRequest
from .routing import Member

SERVICE_PHASES = ("compute", "rpc", "serialize", "queue", "batch", "coordinator", "rebuild")
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass
class Chunk:
    """Tokens one round committed (or the final record: finish reason and statistics)."""

    request_id: str
    version: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str = ""
    stats: dict | None = None
    trace: bytes = b""


@dataclass
class Job:
    """One request in flight: its committed state, where it is routed, and what it has cost."""

    state: RequestState
    policy: TreePolicy | None  # None: `tree: auto` chooses each round's
    emit: Callable[[Chunk | Exception], None]
    draft: Member | None = None
    target: Member | None = None
    session: RemoteRequest | None = None  # its sessions on both workers
    timing: CallTiming = field(default_factory=CallTiming)
    stats: GenerationStats = field(default_factory=GenerationStats)
    service: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SERVICE_PHASES, 0.0))
    rebuilds: int = 0
    started: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    text_sent: str = ""
    recorder: RequestRecorder | None = None
    trace_out: list[bytes] | None = None  # trace frames waiting for the client's next chunk, when it asked

    def take_trace(self) -> bytes:
        frames = b"".join(self.trace_out or ())
        if self.trace_out:
            self.trace_out.clear()
        return frames

    @property
    def request_id(self) -> str:
        return self.state.request_id

    def stats_dict(self) -> dict:
        stats = self.stats
        return {
            "rounds": stats.rounds,
            "target_forwards": stats.target_forwards,
            "tokens": stats.tokens,
            "accepted_length_histogram": list(stats.accepted_length_histogram),
            "mean_accept_length": stats.mean_accept_length,
            "ahead_rounds": stats.ahead_rounds,  # rounds that verified a tree drafted ahead
            "ahead_tokens": stats.ahead_tokens,
            "seconds": dict(stats.seconds),
            "service_seconds": dict(self.service),
            "rebuilds": self.rebuilds,
        }
