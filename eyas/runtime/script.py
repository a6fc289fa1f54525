"""TorchScript for the serving path's small functions (docs/runtime.md, "Fewer trips through Python")."""

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def script(fn: F) -> F:
    """`torch.jit.script(fn)`, without torch's deprecation warning for it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch.jit.script` is deprecated", category=DeprecationWarning)
        return torch.jit.script(fn)


def unoptimized(fn: F) -> F:
    """`fn` with TorchScript's graph executor unoptimized on its thread while it runs (a per-thread setting): no
    profiling and re-planning for shapes that change every forward."""
    return torch.jit.optimized_execution(False)(fn)
