"""The coordinator's rounds, driven together on its event loop: the calls waiting for a worker go to it as one Batch.

Each request is served on its own thread (placement, rebuilds, streaming), and each hands its rounds to one
`RoundDriver`. A round is the engine's own operation (`eyas.rounds.round_steps`); over remote sessions it yields
its Round call (`actors.proxy.RemoteCall`) where a local session yields forwards. The driver runs on the
coordinator's event loop: it sends the calls waiting for a draft worker as one Batch call (an asynchronous call, so
no thread waits on the wire) as soon as that worker has fewer than two in flight, and resumes each round where its
reply arrives. A Batch takes at most half of the requests the worker serves: the requests settle into two groups,
one drafting while the other verifies, so both pools work at once (docs/wire.md, "Batched calls").
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from eyas.steps import Steps

from .proxy import RemoteCall, WorkerClient

T = TypeVar("T")
GROUPS = 2  # request groups in flight on a draft worker: one drafting while the other's tree is verified


class _Rounds:
    """One request's rounds in the driver: their operation, the workers it calls, when it last asked for a call,
    and its end."""

    __slots__ = ("steps", "workers", "asked", "future")

    def __init__(self, steps: Steps, workers: tuple[WorkerClient, ...]):
        self.steps = steps
        self.workers = workers
        self.asked = 0.0
        self.future: Future = Future()


class RoundDriver:
    """Drives the requests' rounds handed to it on `loop`; their calls travel as Batch calls, `GROUPS` in flight per
    worker.

    `run` blocks the calling (request) thread until the operation it handed over has ended, and returns its result or
    raises its error. A refused call fails only its own request's round; a lost worker fails the rounds of every
    request in the batch, each of which its request's thread rebuilds.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, observe: Callable[[str, int], None] = lambda role, calls: None):
        """`observe(role, calls)` hears of every Batch call sent to a worker of that pool (the service's metrics)."""
        self.loop = loop
        self.observe = observe
        self._waiting: dict[tuple[WorkerClient, str], list[tuple[_Rounds, RemoteCall]]] = {}
        self._in_flight: Counter[tuple[WorkerClient, str]] = Counter()  # Batch calls in flight to each worker
        self._members: Counter[WorkerClient] = Counter()  # rounds in the driver that call each worker
        self._closed = False

    def run(self, steps: Steps[T], workers: tuple[WorkerClient, ...]) -> T:
        """Drive `steps` (a request's rounds, an operation that calls `workers`); returns its result (or raises its
        error) once it has ended."""
        rounds = _Rounds(steps, workers)
        self.loop.call_soon_threadsafe(self._arrive, rounds)
        return rounds.future.result()

    def close(self) -> None:
        """Stop sending: a round that asks for a call from now on fails; Batch calls in flight end on their own."""
        self._closed = True

    def _arrive(self, rounds: _Rounds) -> None:
        self._members.update(rounds.workers)
        self._resume(rounds, None, None)
        self._send()

    def _resume(self, rounds: _Rounds, value: Any, error: BaseException | None) -> None:
        """Run a request's rounds on to their next call (queued for that worker) or to their end."""
        try:
            forward = rounds.steps.throw(error) if error is not None else rounds.steps.send(value)
        except StopIteration as stop:
            self._members.subtract(rounds.workers)
            rounds.future.set_result(stop.value)
        except BaseException as exc:
            self._members.subtract(rounds.workers)
            rounds.future.set_exception(exc)
        else:
            rounds.asked = time.perf_counter()
            self._waiting.setdefault((forward.runner, forward.call.method), []).append((rounds, forward.call))

    def _send(self) -> None:
        """Each worker with calls waiting and fewer than `GROUPS` Batch calls in flight gets the earliest of them as
        one Batch call."""
        for key in [key for key, queue in self._waiting.items() if not queue]:
            del self._waiting[key]  # a worker gone from its pool leaves no queue behind
        for key, queue in self._waiting.items():
            if self._in_flight[key] >= GROUPS:
                continue
            share = max(1, -(-self._members[key[0]] // GROUPS))
            sent, queue[:] = queue[:share], queue[share:]
            now = time.perf_counter()
            for rounds, call in sent:
                call.timing.queue += now - rounds.asked  # waiting here for the worker, behind the other group
            self._in_flight[key] += 1
            self.observe(key[0].role, len(sent))
            self.loop.create_task(self._send_batch(key, sent))

    async def _send_batch(self, key: tuple[WorkerClient, str], sent: list[tuple[_Rounds, RemoteCall]]) -> None:
        """One Batch call; each round resumes with its call's outcome."""
        calls = [call for _, call in sent]
        try:
            if self._closed:
                raise RuntimeError("the service is stopping: no more calls are sent")
            outcomes = await key[0].run_each_async(calls)
        except Exception as exc:  # every call of the batch ends with it; each request fails or rebuilds as it would
            outcomes = [exc] * len(calls)
        self._in_flight[key] -= 1
        for (rounds, _), outcome in zip(sent, outcomes):
            if isinstance(outcome, BaseException):
                self._resume(rounds, None, outcome)
            else:
                self._resume(rounds, outcome, None)
        self._send()
