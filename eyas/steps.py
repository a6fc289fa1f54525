"""Operations that ask for forwards (docs/runtime.md, "Batches"): a generator that yields a `Forward` whenever it
needs rows run, receives that call's result and returns its own; run alone (`run_alone`) or with others in one
batch per model (`eyas.runtime.batch.Lockstep`)."""

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
    """An operation that runs no local forward (a remote call, a plain root-only tree): returns `fn(*args)`."""
    return fn(*args)
    yield  # unreached: makes this a generator, so `fn` runs when the operation is driven
