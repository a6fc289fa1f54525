"""CUDA graphs of a model's forward: captured once per padded batch shape, replayed after (docs/runtime.md,
"CUDA graphs").

On a GPU a round's forwards are small (a few to a few dozen rows), so launching their hundreds of kernels one by one
from Python costs more than running them. A graph records the kernels of one forward once and launches them all with
one call. A graph reads and writes fixed addresses with fixed shapes, so a batch is padded to a bucket shape
(entries, rows, keys) and its inputs are copied into that shape's own tensors before each replay: where each row's
KV goes and which slots it reads are index tensors (runtime/kv.py, `SlotBatch.shape`), so one graph serves any
sessions. Batches past the largest bucket (a long prefill) run eagerly.

On a CPU the same fixed-shape batches run eagerly: the padding and the copies are those a graph replays, which is
how the CPU tests check them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from .batch import Packed, RowsCall
from .kv import captured_attention

MAX_ENTRIES = 64  # calls one captured batch holds (entries pad to a power of two)
MAX_ROWS = 128  # rows of one call a captured batch holds (rows pad to a power of two)
MIN_KEYS = 256  # positions read pad to a power of two from this (at most the slot length): a few graphs per
# context length, each reading at most twice the keys it needs (cheap on a GPU next to launching kernels one by one)
WARMUPS = 3  # eager runs before a capture, on a side stream, as CUDA graph capture asks


def power_of_two(n: int) -> int:
    """The least power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def bucket_shape(calls: list[RowsCall], slot_len: int) -> tuple[int, int, int] | None:
    """The (entries, rows, keys) a batch of `calls` pads to, or None where it is past the largest bucket."""
    entries, rows = len(calls), max(int(c.tokens.shape[0]) for c in calls)
    if entries > MAX_ENTRIES or rows > MAX_ROWS:
        return None
    keys = max(c.start + int(c.tokens.shape[0]) for c in calls)
    return power_of_two(entries), power_of_two(rows), min(max(power_of_two(keys), MIN_KEYS), slot_len)


class Captured:
    """One bucket shape's graph: the tensors its forward reads (`inputs`) and the ones it returns (`outputs`)."""

    def __init__(self, packed: Packed, graph: torch.cuda.CUDAGraph | None, outputs: list[torch.Tensor]):
        self.packed = packed
        self.inputs = packed.inputs()
        self.graph = graph
        self.outputs = outputs


class Graphs:
    """A model's forward over fixed-shape batches on `device`: a CUDA graph per bucket shape there, eager on a CPU.

    `forward(packed)` returns the tensors a runner reads; `run` returns copies of them, since the next replay of any
    of the model's graphs may reuse their memory (all share one memory pool). One thread at a time replays.
    `seconds` is the time spent capturing (once per shape, in the first batch of that shape).
    """

    def __init__(self, forward: Callable[[Packed], list[torch.Tensor]], device: torch.device):
        self.forward = forward
        self.device = device
        self.capture = device.type == "cuda"
        self.captured: dict[tuple, Captured] = {}
        self.seconds = 0.0
        self._memory = torch.cuda.graph_pool_handle() if self.capture else None
        self._lock = threading.Lock()

    def shape(self, calls: list[RowsCall], slot_len: int) -> tuple[int, int, int] | None:
        """The bucket shape a batch of `calls` runs at, None: eagerly, unpadded."""
        return bucket_shape(calls, slot_len)

    @torch.no_grad()
    def run(self, packed: Packed) -> list[torch.Tensor]:
        """The forward of a batch packed at a bucket shape: its graph's replay (captured on first use)."""
        key = (packed.kv.shape, packed.states is None)
        with self._lock:
            captured = self.captured.get(key)
            if captured is None:
                start = time.perf_counter()
                captured = self.captured[key] = self._capture(packed)
                self.seconds += time.perf_counter() - start
            for mine, given in zip(captured.inputs, packed.inputs()):
                mine.copy_(given)
            if captured.graph is None:
                return [t.clone() for t in self.forward(captured.packed)]
            with torch.cuda.device(self.device):  # a graph launches on the current device's stream
                captured.graph.replay()
            return [t.clone() for t in captured.outputs]

    def _capture(self, packed: Packed) -> Captured:
        """Record the forward at `packed`'s shape on tensors of its own (filled with `packed`'s, so the warm-up runs
        write exactly the KV rows the replay then writes again)."""
        own = Packed(
            packed.tokens.clone(), packed.positions.clone(), packed.mask.clone(),
            None if packed.states is None else packed.states.clone(), packed.lengths, packed.entries,
            dataclasses.replace(packed.kv),  # index tensors of its own, built again from the same lists
        )
        if not self.capture:
            return Captured(own, None, [])
        with torch.cuda.device(self.device), captured_attention():  # the model's device, which need not be the current one (cuda:N)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUPS):
                    self.forward(own)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory, capture_error_mode="thread_local"):
                outputs = self.forward(own)
        return Captured(own, graph, outputs)
