"""Operations that ask for forwards: how one request's code runs alone or in lockstep with others (docs/runtime.md).

A session operation (a prefill, a proposal, a verification, a whole round) is a generator: it
yields a `Forward` each time it needs a model to run rows, receives that call's result, and returns
its own result at the end. Written once, the same operation runs

- alone (`run_alone`): every forward it asks for runs at once, by itself;
- in lockstep with other operations (`eyas.runtime.batch.Lockstep`): the forwards that every
  unfinished operation asks for at the same step run as one batch per model, on one thread.

An operation that needs no local forward (a call to a remote worker, plain decoding's root-only tree)
is `without_forwards(fn, *args)`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Runner(Protocol):
    """A model that runs the calls of many sessions as one forward: `run(calls)[i]` is calls[i]'s result."""

    def run(self, calls: list) -> list: ...

    def rows(self, call) -> int: ...


@dataclass(frozen=True, eq=False)
class Forward:
    """What an operation yields: one call for `runner`, answered with that call's result."""

    runner: Runner
    call: Any


Steps = Generator[Forward, Any, T]


def run_alone(steps: Steps[T]) -> T:
    """Drive one operation by itself: each forward it asks for runs at once, alone."""
    try:
        forward = next(steps)
        while True:
            try:
                result = forward.runner.run([forward.call])[0]
            except BaseException as exc:
                forward = steps.throw(exc)
            else:
                forward = steps.send(result)
    except StopIteration as stop:
        return stop.value


def without_forwards(fn: Callable[..., T], *args: Any) -> Steps[T]:
    """An operation that runs no local forward: when driven, it calls `fn(*args)` and returns its value."""
    return fn(*args)
    yield  # unreached: it makes this a generator function, so `fn` runs when the operation is driven
