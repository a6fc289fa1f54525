"""CUDA graphs of a model's forward, one per padded batch shape (entries, rows, keys), captured on first use and
replayed after (docs/runtime.md, "CUDA graphs"); on a CPU the same fixed-shape batches run eagerly."""

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
MIN_KEYS = 256  # positions read pad to a power of two from this, up to the slot length
WARMUPS = 3  # eager runs on a side stream before a capture


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
    """A model's `forward(packed)` over fixed-shape batches: a CUDA graph per bucket shape on `device`, eager on a
    CPU. `run` returns copies (the model's graphs share one memory pool); `seconds`: time spent capturing."""

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
        """Record the forward at `packed`'s shape on tensors of its own, filled with `packed`'s (the warm-up runs
        write the KV rows the replay writes again)."""
        own = Packed(
            packed.tokens.clone(), packed.positions.clone(), packed.mask.clone(),
            None if packed.states is None else packed.states.clone(), packed.lengths, packed.entries,
            dataclasses.replace(packed.kv),  # index tensors of its own, built again from the same lists
        )
        if not self.capture:
            return Captured(own, None, [])
        with torch.cuda.device(self.device), captured_attention():  # the model's device, not necessarily the current one
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
