"""Packing several sessions' rows into one forward, and gathering the calls of concurrent requests.

`pack` lays the rows of B calls out as [B, N] (N = the longest call; shorter calls are padded, and
their pads write no KV), with a [B, 1, N, K] mask in which each row sees only its own slot's
positions that its call marks visible: a request's rows never see another request's.
`Batcher` lets one thread per request call `run` as if alone, while the calls that are waiting at
the same moment run as one batch (see docs/runtime.md). While several requests step together their
batches all run on one compute thread of their `Rendezvous`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from .kv import KVPool, SlotBatch


@dataclass
class RowsCall:
    """One session's rows: written at slot positions [start, start + N), seeing `visible` [N, start + N]."""

    slot: int
    start: int
    tokens: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    visible: torch.Tensor  # [N, start + N] bool
    states: torch.Tensor | None = None  # [N, d] drafter input states
    top_k: int = 0  # a drafter call: also return each row's top-k next-token candidates, from the same pass


@dataclass
class Packed:
    tokens: torch.Tensor  # [B, N]
    positions: torch.Tensor  # [B, N]
    mask: torch.Tensor  # [B, 1, N, K]
    states: torch.Tensor | None  # [B, N, d]
    lengths: list[int]
    kv: SlotBatch

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, ...] -> [R, ...]: the real rows of every call, call after call."""
        if len(self.lengths) == 1:
            return x[0, : self.lengths[0]]
        return torch.cat([x[b, :n] for b, n in enumerate(self.lengths)])


def pack(calls: list[RowsCall], pool: KVPool) -> Packed:
    """Lay `calls` out as one padded batch over `pool`."""
    lengths = [int(c.tokens.shape[0]) for c in calls]
    kv = pool.batch([c.slot for c in calls], [c.start for c in calls], lengths)
    device = pool.device
    if len(calls) == 1:
        call = calls[0]
        states = None if call.states is None else call.states[None].to(device)
        return Packed(call.tokens[None].to(device), call.positions[None].to(device), call.visible[None, None].to(device), states, lengths, kv)
    b, n = len(calls), max(lengths)
    tokens = torch.zeros(b, n, dtype=torch.long)
    positions = torch.zeros(b, n, dtype=torch.long)
    mask = torch.zeros(b, 1, n, kv.key_len, dtype=torch.bool)
    mask[:, 0, :, 0] = True  # pad rows see one key, so their softmax stays finite
    states = None if calls[0].states is None else calls[0].states.new_zeros(b, n, calls[0].states.shape[-1])
    for i, call in enumerate(calls):
        m = lengths[i]
        tokens[i, :m] = call.tokens
        positions[i, :m] = call.positions
        mask[i, 0, :m, 0] = False
        mask[i, 0, :m, : call.start + m] = call.visible
        if states is not None:
            states[i, :m] = call.states
    states = None if states is None else states.to(device)
    return Packed(tokens.to(device), positions.to(device), mask.to(device), states, lengths, kv)


def split_rows(x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """[R, ...] packed rows -> one tensor per call."""
    return list(torch.split(x, lengths))


Call = TypeVar("Call")
Result = TypeVar("Result")


class _Entry:
    __slots__ = ("call", "result", "error", "done", "started")

    def __init__(self, call):
        self.call = call
        self.started = 0.0
        self.result = None
        self.error: BaseException | None = None
        self.done = False


class Rendezvous:
    """Who may still submit work: the requests that are stepping together.

    A batcher runs its waiting calls as soon as no registered request is busy elsewhere (every one
    is waiting on some batcher), so the requests of `Engine.generate_batch` fall into lockstep and
    each phase of every round runs as one batch. With nobody registered a call runs at once.

    With more than one request registered, every batch runs on the rendezvous' one compute thread rather
    than on the thread of whichever request arrived last: torch's OpenMP workers belong to the thread
    that starts a parallel region, so batches started from many threads leave several teams of workers
    spinning over the same cores (8 requests stepping together on 2 cores: 8% more tokens/s on one thread).
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.parties = 0
        self.waiting = 0
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="eyas-compute")

    def execute(self, run: Callable[[list], list], calls: list) -> list:
        """`run(calls)` on the compute thread while requests step together, else on the calling thread."""
        if self.parties <= 1:
            return run(calls)
        return self._compute.submit(run, calls).result()

    def join(self) -> None:
        with self.cond:
            self.parties += 1

    def leave(self) -> None:
        with self.cond:
            self.parties -= 1
            self.cond.notify_all()

    def idle(self) -> bool:
        return self.waiting >= self.parties

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Count the calling party as waiting while it blocks outside any batcher (e.g. on another thread's work),
        so that batchers do not wait for it."""
        with self.cond:
            self.waiting += 1
            self.cond.notify_all()
        try:
            yield
        finally:
            with self.cond:
                self.waiting -= 1


_waited = threading.local()


def batch_wait_seconds() -> float:
    """Seconds this thread has spent waiting for batch-mates since it last asked (the batching delay)."""
    seconds = getattr(_waited, "seconds", 0.0)
    _waited.seconds = 0.0
    return seconds


class Batcher(Generic[Call, Result]):
    """Runs `run(calls) -> results` over the calls of every thread waiting at the same time.

    `rows(call)` and `max_rows` bound a batch: calls beyond the budget wait for the next one, in
    arrival order, so every waiting request is served in turn.
    """

    def __init__(
        self,
        run: Callable[[list[Call]], list[Result]],
        rendezvous: Rendezvous,
        rows: Callable[[Call], int] = lambda call: 1,
        max_rows: int | None = None,
    ):
        self.run_batch = run
        self.rendezvous = rendezvous
        self.rows = rows
        self.max_rows = max_rows
        self.queue: list[_Entry] = []
        self.batches = 0  # batched runs so far, and the calls they served
        self.calls = 0

    def _take(self) -> list[_Entry]:
        """The longest prefix of the queue within the row budget (at least one call)."""
        taken, rows = 0, 0
        for entry in self.queue:
            rows += self.rows(entry.call)
            if taken and self.max_rows is not None and rows > self.max_rows:
                break
            taken += 1
        batch, self.queue = self.queue[:taken], self.queue[taken:]
        return batch

    def run(self, call: Call) -> Result:
        entry = _Entry(call)
        meet = self.rendezvous
        arrived = time.perf_counter()
        with meet.cond:
            self.queue.append(entry)
            meet.waiting += 1
            while not entry.done:
                if self.queue and entry in self.queue and meet.idle():
                    batch = self._take()
                    meet.waiting -= len(batch)  # busy from now on: nobody else batches until they are back
                    meet.cond.release()
                    try:
                        self._execute(batch)
                    finally:
                        meet.cond.acquire()
                    meet.cond.notify_all()
                else:
                    meet.cond.wait()
        _waited.seconds = getattr(_waited, "seconds", 0.0) + entry.started - arrived
        if entry.error is not None:
            raise entry.error
        return entry.result

    def _execute(self, batch: list[_Entry]) -> None:
        started = time.perf_counter()
        for e in batch:
            e.started = started
        self.batches += 1
        self.calls += len(batch)
        try:
            results = self.rendezvous.execute(self.run_batch, [e.call for e in batch])
        except BaseException as exc:  # every caller of the batch sees the failure
            for e in batch:
                e.error, e.done = exc, True
            return
        for e, result in zip(batch, results):
            e.result, e.done = result, True
