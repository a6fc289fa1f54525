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

# TorchScript's CUDA fuser generates kernels specialised to the shapes it has seen, and the shapes of the serving
# path change from one forward to the next (rows, positions read, batch-mates): a forward would keep meeting new
# specialisations. On CUDA eyas replays graphs instead (runtime/graphs.py). On a CPU the fuser never runs.
torch._C._jit_set_texpr_fuser_enabled(False)


def script(fn: F) -> F:
    """`torch.jit.script(fn)`, without torch's deprecation warning for it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch.jit.script` is deprecated", category=DeprecationWarning)
        return torch.jit.script(fn)
