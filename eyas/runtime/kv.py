"""The KV pool: one preallocated [layers, 2 (k, v), slots, kv_heads, slot_len, head_dim] tensor, a slot per
session, and how a batch's rows are written into it and read from it in place (docs/runtime.md, "The KV pool")."""

import heapq
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cached_property
from typing import List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def captured_attention() -> AbstractContextManager:
    """Every attention backend on, cuDNN's included, while a CUDA graph is captured (docs/runtime.md, "Attention on
    CUDA"); process-wide while it lasts."""
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

TREE_HEADROOM = 256  # slot positions past a request's own tokens, for the scratch rows of one round's tree


class KVCapacityError(RuntimeError):
    """A request does not fit the KV pool: `field` names what is short (slot_len or slots)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class KVPool:
    """Fixed slots of `slot_len` positions for up to `slots` sessions, preallocated on one device."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        slots: int,
        slot_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        name: str = "kv",
    ):
        if slots < 0 or slot_len < 1:
            raise KVCapacityError("slots", f"a KV pool has a nonnegative number of slots of at least one row, got {slots} x {slot_len}")
        self.name = name
        self.slots = slots
        self.slot_len = slot_len
        self.kv = torch.zeros(layers, 2, slots, kv_heads, slot_len, head_dim, dtype=dtype, device=device)
        self.row_bytes = 2 * layers * kv_heads * head_dim * self.kv.element_size()  # one position of one session
        self._free = list(range(slots))  # a heap: the lowest free slot goes first, so a batch's slots tend to be consecutive
        self._cond = threading.Condition(threading.RLock())  # re-entrant: a session's finalizer may release

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def reserved_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def check_fits(self, rows: int) -> None:
        """Refuse a session that could never fit one slot."""
        if rows > self.slot_len:
            raise KVCapacityError(
                "slot_len", f"{rows} positions do not fit the {self.name} pool's slots of {self.slot_len} positions"
            )

    def acquire(self, rows: int, wait: bool = False, timeout: float | None = None) -> int:
        """A free slot for a session of up to `rows` positions; waits for one when `wait`, else refuses."""
        self.check_fits(rows)
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: self._free, timeout)
            if not self._free:
                raise KVCapacityError(
                    "slots", f"all {self.slots} slots of the {self.name} pool are in use; retry when a request finishes"
                )
            return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        with self._cond:
            if slot in self._free or not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} is not held")
            heapq.heappush(self._free, slot)
            self._cond.notify()

    def move_rows(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy positions `src` to `dst` [R] of one slot in every layer (a commit)."""
        src, dst = src.to(self.device), dst.to(self.device)
        view = self.kv[:, :, slot]  # [L, 2, kv_heads, T, hd]
        view[:, :, :, dst] = view[:, :, :, src]


# No `from __future__ import annotations` in this file: TorchScript reads `Writes`' field types at run time.
class Writes(NamedTuple):
    """Where a batch's new rows go in each layer of the pool and what its attention reads (`write_rows`, `attend`).

    One slot: rows [start, start + length) of `slot`. Several: the real rows (src_b, src_n) of the [B, N] batch go to
    (dst_slot, dst_pos), and `runs` (first slot, count, keys) of consecutive slots are read as views of the pool. A
    fixed shape (a CUDA graph's) has no runs: each entry reads `read_slots` [B], gathered up to `key_len`.
    """

    slot: int
    start: int
    length: int
    key_len: int
    runs: List[Tuple[int, int, int]]
    src_b: Optional[torch.Tensor]  # [R] long
    src_n: Optional[torch.Tensor]  # [R] long
    dst_slot: Optional[torch.Tensor]  # [R] long
    dst_pos: Optional[torch.Tensor]  # [R] long
    read_slots: Optional[torch.Tensor]  # [B] long: the slot each entry reads, for a batch of fixed shape


def slot_runs(slots: List[int], ends: List[int]) -> List[Tuple[int, int, int]]:
    """Slots in batch order and their ends -> runs (first slot, count, longest end) of consecutive slots:
    [3, 4, 9], [7, 5, 2] -> [(3, 2, 7), (9, 1, 2)]."""
    runs: List[Tuple[int, int, int]] = []
    for slot, end in zip(slots, ends):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            first, count, keys = runs[-1]
            runs[-1] = (first, count + 1, max(keys, end))
        else:
            runs.append((slot, 1, end))
    return runs


def write_rows(kv: torch.Tensor, writes: Writes, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv [2, S, kv_heads, T, hd] (one layer) <- the new rows' k, v [B, kv_heads, N, hd], pads skipped."""
    src_b, src_n, dst_slot, dst_pos = writes.src_b, writes.src_n, writes.dst_slot, writes.dst_pos
    if src_b is None or src_n is None or dst_slot is None or dst_pos is None:
        n = writes.length
        rows = kv.select(1, writes.slot).narrow(2, writes.start, n)  # [2, kv_heads, n, hd], a view of the slot
        rows[0].copy_(k[0].narrow(1, 0, n))
        rows[1].copy_(v[0].narrow(1, 0, n))
        return
    new = torch.stack([k, v]).permute(1, 3, 0, 2, 4)  # [B, N, 2, kv_heads, hd]
    kv.transpose(0, 1)[dst_slot, :, :, dst_pos] = new[src_b, src_n].to(kv.dtype)  # [R, 2, kv_heads, hd]


def attend(q: torch.Tensor, kv: torch.Tensor, writes: Writes, bias: torch.Tensor, gqa: bool) -> torch.Tensor:
    """q [B, H, N, hd] over kv [2, S, kv_heads, T, hd] (one layer, rows written), bias [B, 1, N, key_len] ->
    [B, H, N, hd]: one attention per run of consecutive slots, over a view of the pool."""
    read_slots = writes.read_slots
    if read_slots is not None:  # a fixed shape: every entry's slot gathered, positions [0, key_len)
        keys = kv[0, :, :, : writes.key_len].index_select(0, read_slots)  # [B, kv_heads, key_len, hd]
        values = kv[1, :, :, : writes.key_len].index_select(0, read_slots)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=gqa)
    outs: List[torch.Tensor] = []
    b = 0
    for first, count, end in writes.runs:
        read = kv.narrow(1, first, count).narrow(3, 0, end)  # [2, n, kv_heads, K', hd], a view of the pool
        mask = bias.narrow(0, b, count).narrow(3, 0, end)
        outs.append(F.scaled_dot_product_attention(q.narrow(0, b, count), read[0], read[1], attn_mask=mask, enable_gqa=gqa))
        b += count
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def ragged_arange(sizes: np.ndarray | list[int]) -> np.ndarray:
    """0..size-1 for each of `sizes`, end to end: [3, 2] -> [0, 1, 2, 0, 1]."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)


@dataclass
class SlotBatch:
    """The KV of one batched forward: entry b writes rows [starts[b], starts[b] + lengths[b]) of slot slots[b] and
    reads its positions [0, key_len). `shape` (entries, rows, keys): padded to that fixed shape for a CUDA graph
    (a pad row repeats the first real row's write; a pad entry reads the first entry's slot)."""

    pool: KVPool
    slots: list[int]
    starts: list[int]
    lengths: list[int]
    shape: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        ends = [s + n for s, n in zip(self.starts, self.lengths)]
        self.key_len = max(ends)
        self.pool.check_fits(self.key_len)
        device = self.pool.device
        if len(self.slots) == 1 and self.shape is None:
            self.writes = Writes(self.slots[0], self.starts[0], self.lengths[0], self.key_len, slot_runs(self.slots, ends), None, None, None, None, None)
            return
        # per real row: (batch entry, row in the entry, slot, slot position), one tensor, one copy to the device
        entry, within = self.rows
        rows = np.stack([entry, within, np.asarray(self.slots)[entry], np.asarray(self.starts)[entry] + within])  # [4, R]
        if self.shape is None:
            src_b, src_n, dst_slot, dst_pos = torch.from_numpy(rows).to(device)  # 4 x [R]
            self.writes = Writes(0, 0, 0, self.key_len, slot_runs(self.slots, ends), src_b, src_n, dst_slot, dst_pos, None)
            return
        entries, per_entry, keys = self.shape
        if len(self.slots) > entries or max(self.lengths) > per_entry or not self.key_len <= keys <= self.pool.slot_len:
            raise ValueError(f"shape: {self.shape} does not hold {len(self.slots)} entries of up to {max(self.lengths)} rows reading {self.key_len} positions")
        self.key_len = keys
        # pad rows repeat the first; a fifth column carries entry i's slot in row i (pad entries read the first's)
        rows = np.concatenate([rows, np.repeat(rows[:, :1], entries * per_entry - rows.shape[1], axis=1)], axis=1)
        read = np.zeros((1, rows.shape[1]), dtype=rows.dtype)
        read[0, :entries] = self.slots + [self.slots[0]] * (entries - len(self.slots))
        src_b, src_n, dst_slot, dst_pos, read_slots = torch.from_numpy(np.concatenate([rows, read])).to(device)  # 5 x [entries x rows]
        self.writes = Writes(0, 0, 0, keys, [], src_b, src_n, dst_slot, dst_pos, read_slots[:entries])

    @cached_property
    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Each real row's batch entry and its row within the entry, entries end to end ([R] each)."""
        return np.repeat(np.arange(len(self.lengths)), self.lengths), ragged_arange(self.lengths)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype attention runs in over this KV."""
        return self.pool.kv.dtype

    def append(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows' k, v [B, kv_heads, N, hd] -> keys, values [B, kv_heads, key_len, hd] to attend to (a
        drafter's own modules; the runtime's blocks `attend` in place instead)."""
        kv = self.pool.kv[layer]
        write_rows(kv, self.writes, k, v)
        reads = [kv[:, first : first + count, :, : self.key_len] for first, count, _ in self.writes.runs]  # [2, n, kv_heads, K, hd]
        keys, values = reads[0] if len(reads) == 1 else torch.cat(reads, dim=1)
        return keys, values

    def scripted(self) -> tuple[torch.Tensor | None, Writes | None]:
        """The pool and writes a scripted block passes to `write_rows` and `attend`."""
        return self.pool.kv, self.writes


class PassThroughKV:
    """KV for a cache-free forward (training's teacher): attention reads exactly the rows being run."""

    dtype = None  # attention runs in the model's dtype

    def append(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def scripted(self) -> tuple[torch.Tensor | None, Writes | None]:
        """No pool: a scripted block attends to the new rows alone."""
        return None, None
