"""TorchScript for the serving path's small functions: a scripted function runs its operators without returning to
the Python interpreter between them, and calls other scripted functions the same way (docs/runtime.md, "Fewer
trips through Python").

torch 2.13 (pinned) warns that `torch.jit.script` is deprecated in favour of `torch.compile`; on this path
`torch.compile` measured no faster and compiles per shape for seconds, so eyas scripts, and silences only that
warning, only while it scripts.
"""

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

# TorchScript's graph executor profiles a function's first calls, then optimises a plan specialised to the shapes
# and dtypes it saw, and profiles and re-plans when later calls miss it. The serving path's shapes change from one
# forward to the next (rows, positions read, batch-mates), so it kept paying for planning: on a CPU the first
# request's rounds cost 22 ms against 13 ms later (docs/runtime.md, "Fewer trips through Python"). Unoptimised,
# a scripted function still runs all its operators in one call, without returning to Python, and its steady cost
# measured the same. This is a process-wide TorchScript setting: it applies to any other scripted code in an eyas
# process too.
torch._C._set_graph_executor_optimize(False)


def script(fn: F) -> F:
    """`torch.jit.script(fn)`, without torch's deprecation warning for it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch.jit.script` is deprecated", category=DeprecationWarning)
        return torch.jit.script(fn)
