"""Batches (docs/runtime.md, "Batches"): `pack` lays several sessions' calls out as one forward, `Lockstep` drives
many operations (`eyas.steps`) so that their forwards run as one batch per model, and `Scheduler` is a worker's
compute thread, a lockstep that operations join as they arrive."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ..steps import Forward, Steps
from .kv import KVPool, SlotBatch
from .linear import bucketed_rows

MAX_BATCH_ROWS = 4096  # rows one batched forward of a model takes; calls past it wait for the next step
PAD_ROWS = 64  # rows of padding one forward may carry; calls past it run in a forward of their own


@dataclass
class RowsCall:
    """One session's rows: written at slot positions [start, start + N), seeing `visible` [N, start + N]."""

    slot: int
    start: int
    tokens: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    visible: torch.Tensor  # [N, start + N] bool
    states: torch.Tensor | None = None  # [N, d] drafter input states, in the drafter's dtype
    top_k: int = 0  # a drafter call: also each row's top-k next-token candidates
    top_k_last: bool = False  # ... of its last row only
    features: torch.Tensor | None = None  # [N, F] verified target features in place of `states` (seeded in the batch)


@dataclass
class Packed:
    tokens: torch.Tensor  # [B, N], entries in slot order
    positions: torch.Tensor  # [B, N]
    mask: torch.Tensor  # [B, 1, N, K]
    states: torch.Tensor | None  # [B, N, d]
    lengths: list[int]  # rows of each call, in call order
    entries: list[int]  # the batch entry of each call
    kv: SlotBatch

    def inputs(self) -> list[torch.Tensor]:
        """Every tensor the forward reads (what a CUDA graph copies into its own)."""
        w = self.kv.writes
        held = [self.tokens, self.positions, self.mask, self.states, w.src_b, w.src_n, w.dst_slot, w.dst_pos, w.read_slots]
        return [t for t in held if t is not None]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, ...] -> [R, ...]: the real rows of every call, call after call."""
        if len(self.lengths) == 1:
            return x[0, : self.lengths[0]]
        return torch.cat([x[b, :n] for b, n in zip(self.entries, self.lengths)])


def pack(calls: list[RowsCall], pool: KVPool, bucketed: bool = False, shape: tuple[int, int, int] | None = None) -> Packed:
    """`calls` as one batch [B, N] over `pool` (N: the longest call), entries in slot order, with the mask [B, 1, N, K]
    of what each row sees. `bucketed`: N padded (at most 25%) to one of `Linear`'s row buckets; `shape` (entries,
    rows, keys): padded to exactly that, for a CUDA graph. Pad rows write no KV and see one key."""
    lengths = [int(c.tokens.shape[0]) for c in calls]
    order = sorted(range(len(calls)), key=lambda i: calls[i].slot)  # batch entry -> call
    entries = sorted(range(len(calls)), key=order.__getitem__)  # call -> batch entry
    kv = SlotBatch(pool, [calls[i].slot for i in order], [calls[i].start for i in order], [lengths[i] for i in order], shape)
    device = pool.device
    b, n = len(calls), max(lengths)
    if shape is not None:
        b, n = shape[0], shape[1]
    elif bucketed:
        n = bucketed_rows(b, n)
    if b == 1 and n == lengths[0] and shape is None:
        call = calls[0]
        states = None if call.states is None else call.states[None].to(device)
        return Packed(call.tokens[None].to(device), call.positions[None].to(device), call.visible[None, None].to(device), states, lengths, entries, kv)
    entry, within = (torch.from_numpy(x) for x in kv.rows)  # each real row's place [R]
    tokens = torch.zeros(b, n, dtype=torch.long)
    tokens[entry, within] = torch.cat([calls[i].tokens for i in order])
    positions = torch.zeros(b, n, dtype=torch.long)
    positions[entry, within] = torch.cat([calls[i].positions for i in order])
    mask = torch.zeros(b, 1, n, kv.key_len, dtype=torch.bool)
    mask[:, 0, :, 0] = True  # pad rows see one key: their softmax stays finite
    mask[entry, 0, within, 0] = False
    for e, i in enumerate(order):
        mask[e, 0, : lengths[i], : calls[i].start + lengths[i]] = calls[i].visible
    states = None
    if calls[0].states is not None:
        states = calls[0].states.new_zeros(b, n, calls[0].states.shape[-1])
        states[entry, within] = torch.cat([calls[i].states for i in order])
        states = states.to(device)
    return Packed(tokens.to(device), positions.to(device), mask.to(device), states, lengths, entries, kv)


def padding_groups(lengths: list[int]) -> list[list[int]]:
    """Calls of `lengths` rows (by index) in groups, longest first, each padding its calls to its longest by at most
    PAD_ROWS rows in all: each group is one forward, so a prefill runs apart from trees rather than padding every
    tree to its length."""
    groups: list[list[int]] = []
    rows = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            padded = (len(groups[-1]) + 1) * lengths[groups[-1][0]]
            if padded - rows - lengths[i] <= PAD_ROWS:
                groups[-1].append(i)
                rows += lengths[i]
                continue
        groups.append([i])
        rows = lengths[i]
    return groups


def split_rows(x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """[R, ...] packed rows -> one tensor per call."""
    if len(lengths) == 1 and x.shape[0] == lengths[0]:
        return [x]
    return list(torch.split(x, lengths))


FOREGROUND, BACKGROUND, CANCELLED = "foreground", "background", "cancelled"  # what an operation's `priority` says


class Cancelled(Exception):
    """Thrown into an operation at the forward it waits for, once its `priority` says it is cancelled."""


class Operation:
    """One operation driven by a `Lockstep`: its result or error, the seconds it waited for batch-mates, and (where
    kept) the batches it took part in as (rows, seconds)."""

    __slots__ = ("steps", "done", "priority", "forward", "asked", "waited", "forwards", "result", "error")

    def __init__(self, steps: Steps, done: Callable[["Operation"], None], priority: Callable[[], str] | None = None):
        """`priority`, asked before each step: FOREGROUND (None: always), BACKGROUND (runs only in steps no other
        operation waits for) or CANCELLED (gets `Cancelled` at the forward it waits for)."""
        self.steps = steps
        self.done = done
        self.priority = priority
        self.forward: Forward | None = None
        self.asked = 0.0
        self.waited = 0.0
        self.forwards: list[tuple[int, float]] = []
        self.result: Any = None
        self.error: BaseException | None = None


class Lockstep:
    """Drives many operations on the calling thread: each `step` runs one model's batch over the calls waiting for
    it (the cheapest model so far, or one passed over MAX_SKIPS times; in arrival order, up to `max_rows` rows), then
    resumes them. A failing batch raises in its own operations; background ones run only in steps nothing else waits
    for, cancelled ones end at the forward they wait for (docs/runtime.md, "Batches")."""

    MAX_SKIPS = 16

    def __init__(
        self,
        max_rows: int = MAX_BATCH_ROWS,
        observer: Callable[[Any, int, float, int], None] | None = None,
        keep_forwards: bool = False,
    ):
        """`observer(runner, rows, seconds, calls)` hears of every batch that ran; `keep_forwards`: each operation
        keeps its batches (a worker's calls report them)."""
        self.max_rows = max_rows
        self.observer = observer
        self.keep_forwards = keep_forwards
        self.waiting: list[Operation] = []
        self.batches = 0  # forwards run, the calls they served and their wall seconds
        self.calls = 0
        self.seconds = 0.0
        self._seconds: dict[int, float] = {}  # model -> mean seconds of its batches (a running average)
        self._skipped: dict[int, int] = {}  # model -> steps it has waited since its last batch

    def __len__(self) -> int:
        """Operations waiting at a forward (between steps: every unfinished one)."""
        return len(self.waiting)

    def add(
        self, steps: Steps, done: Callable[[Operation], None] = lambda op: None, priority: Callable[[], str] | None = None
    ) -> Operation:
        """Start an operation: it runs until its first forward (or to its end, calling `done`)."""
        op = Operation(steps, done, priority)
        self._resume(op, None, None)
        return op

    def _next(self, ready: list[Operation]) -> tuple[int, set[int]]:
        """The model the next step serves among the operations `ready` to run, and every model they ask for."""
        asked = {id(op.forward.runner) for op in ready}
        overdue = [key for key in asked if self._skipped.get(key, 0) >= self.MAX_SKIPS]
        return (overdue[0] if overdue else min(asked, key=lambda k: self._seconds.get(k, 0.0))), asked

    def step(self) -> None:
        """One batch of one model over the calls waiting for it; then the served operations resume."""
        priorities = {id(op): op.priority() for op in self.waiting if op.priority is not None}
        cancelled = [op for op in self.waiting if priorities.get(id(op)) == CANCELLED]
        if cancelled:
            self.waiting = [op for op in self.waiting if priorities.get(id(op)) != CANCELLED]
            for op in cancelled:
                self._resume(op, None, Cancelled())
            if not self.waiting:
                return
        foreground = [op for op in self.waiting if priorities.get(id(op), FOREGROUND) == FOREGROUND]
        ready = foreground or self.waiting  # the background runs when nothing else waits
        key, asked = self._next(ready)
        chosen = {id(op) for op in ready}
        batch, rows, kept = [], 0, []
        for op in self.waiting:
            if id(op) in chosen and id(op.forward.runner) == key:
                n = op.forward.runner.rows(op.forward.call)
                if not batch or rows + n <= self.max_rows:
                    batch.append(op)
                    rows += n
                    continue
            kept.append(op)
        self.waiting = kept
        for other in asked - {key}:
            self._skipped[other] = self._skipped.get(other, 0) + 1
        self._skipped[key] = 0
        started = time.perf_counter()
        for op in batch:
            op.waited += started - op.asked
        self.batches += 1
        self.calls += len(batch)
        try:
            results = batch[0].forward.runner.run([op.forward.call for op in batch])
        except BaseException as exc:  # every operation of the batch sees the failure
            answers = [(op, None, exc) for op in batch]
        else:
            answers = [(op, result, None) for op, result in zip(batch, results)]
        seconds = time.perf_counter() - started
        if self.keep_forwards:
            for op in batch:
                op.forwards.append((rows, seconds))
        if self.observer is not None and answers[0][2] is None:
            self.observer(batch[0].forward.runner, rows, seconds, len(batch))
        self.seconds += seconds
        self._seconds[key] = seconds if key not in self._seconds else 0.8 * self._seconds[key] + 0.2 * seconds
        for op, result, error in answers:
            self._resume(op, result, error)

    def _resume(self, op: Operation, result: Any, error: BaseException | None) -> None:
        try:
            op.forward = op.steps.throw(error) if error is not None else op.steps.send(result)
        except StopIteration as stop:
            op.forward, op.result = None, stop.value
        except BaseException as exc:
            op.forward, op.error = None, exc
        else:
            op.asked = time.perf_counter()
            self.waiting.append(op)
            return
        op.done(op)


def results(ops: list[Operation]) -> list[Any]:
    """The results of finished operations, in order; the first error among them is raised instead."""
    for op in ops:
        if op.error is not None:
            raise op.error
    return [op.result for op in ops]


class Scheduler:
    """A worker's compute thread: operations submitted from any thread join one lockstep as they arrive (continuous
    batching), at most `max_ops` at once; `submit` returns a future of the finished `Operation`."""

    def __init__(self, name: str, max_ops: int = 64, max_rows: int = MAX_BATCH_ROWS):
        self.max_ops = max_ops
        self.lockstep = Lockstep(max_rows, keep_forwards=True)
        self._incoming: deque[tuple[Steps, Future, Callable[[], str] | None]] = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, steps: Steps, priority: Callable[[], str] | None = None) -> "Future[Operation]":
        """Submit one operation; `priority` as in `Operation`."""
        return self.submit_many([steps], priority)[0]

    def submit_many(self, many: list[Steps], priority: Callable[[], str] | None = None) -> "list[Future[Operation]]":
        """Submit operations together: they join the lockstep at the same step, so their first forwards batch."""
        futures: list[Future] = [Future() for _ in many]
        with self._cond:
            self._incoming.extend((steps, future, priority) for steps, future in zip(many, futures))
            self._cond.notify()
        return futures

    def _admit(self, timeout: float | None = None) -> None:
        """Start the operations that have arrived (waiting up to `timeout` for one when none has, None: for ever)."""
        if timeout == 0.0 and not self._incoming:  # a step is due: nothing to wait for
            return
        with self._cond:
            if not self._incoming:
                self._cond.wait(timeout)
            arrived = []
            while self._incoming and len(self.lockstep) + len(arrived) < self.max_ops:
                arrived.append(self._incoming.popleft())
        for steps, future, priority in arrived:
            self.lockstep.add(steps, lambda op, future=future: future.set_result(op), priority)

    def _loop(self) -> None:
        lockstep = self.lockstep
        while True:
            self._admit(None if not lockstep.waiting else 0.0)
            if lockstep.waiting:
                lockstep.step()
