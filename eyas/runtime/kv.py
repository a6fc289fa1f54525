"""The KV pool a worker owns: one preallocated tensor, a fixed slot per session (see docs/runtime.md).

Layout [layers, 2 (k, v), slots, kv_heads, slot_len, head_dim]. A session borrows one slot; its
committed rows are slot positions [0, committed); a tree's rows are written right after them as
scratch, so dropping a tree is a length reset and a commit moves only the accepted rows into place.
"""

import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch


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
        self._free = list(range(slots - 1, -1, -1))
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
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._cond:
            if slot in self._free or not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} is not held")
            self._free.append(slot)
            self._cond.notify()

    def move_rows(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy positions `src` to `dst` of one slot in every layer: O(rows x layers), never O(context)."""
        src, dst = src.to(self.device), dst.to(self.device)
        view = self.kv[:, :, slot]  # [L, 2, kv_heads, T, hd]
        view[:, :, :, dst] = view[:, :, :, src]

    def batch(self, slots: list[int], starts: list[int], lengths: list[int]) -> "SlotBatch":
        return SlotBatch(self, slots, starts, lengths)


# No `from __future__ import annotations` in this file: TorchScript reads `Writes`' field types at run time.
class Writes(NamedTuple):
    """Where a batch's new rows go in one layer of the pool and what its attention reads, for `write_and_read`.

    One slot: rows [start, start + length) of `slot`, reading positions [0, key_len). Several slots: the real rows
    (`src_b`, `src_n`) of the padded [B, N] batch go to (`dst_slot`, `dst_pos`); reads are slots
    [first, first + count) when those are consecutive, else the slots in `read`.
    """

    slot: int
    start: int
    length: int
    key_len: int
    first: int
    count: int
    src_b: Optional[torch.Tensor]  # [R] long
    src_n: Optional[torch.Tensor]  # [R] long
    dst_slot: Optional[torch.Tensor]  # [R] long
    dst_pos: Optional[torch.Tensor]  # [R] long
    read: Optional[torch.Tensor]  # [B] long


def write_and_read(kv: torch.Tensor, writes: Writes, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """kv [2, S, kv_heads, T, hd] (one layer); the new rows' k, v [B, kv_heads, N, hd] (pads skipped) are written
    -> keys, values [B, kv_heads, key_len, hd]. Plain torch, which TorchScript compiles inside the decoder's scripted
    blocks (runtime/model.py)."""
    src_b, src_n, dst_slot, dst_pos = writes.src_b, writes.src_n, writes.dst_slot, writes.dst_pos
    if src_b is None or src_n is None or dst_slot is None or dst_pos is None:
        slot, start, n = writes.slot, writes.start, writes.length
        kv[0, slot, :, start : start + n] = k[0, :, :n]
        kv[1, slot, :, start : start + n] = v[0, :, :n]
        return kv[0, slot : slot + 1, :, : writes.key_len], kv[1, slot : slot + 1, :, : writes.key_len]
    new = torch.stack([k, v]).permute(1, 3, 0, 2, 4)  # [B, N, 2, kv_heads, hd]
    kv.transpose(0, 1)[dst_slot, :, :, dst_pos] = new[src_b, src_n].to(kv.dtype)  # [R, 2, kv_heads, hd]
    read, key_len = writes.read, writes.key_len
    if read is None:
        slots = kv[:, writes.first : writes.first + writes.count, :, :key_len]  # [2, B, kv_heads, key_len, hd]
        return slots[0], slots[1]
    return kv[0, read, :, :key_len], kv[1, read, :, :key_len]


@dataclass
class SlotBatch:
    """The KV of one batched forward: entry b writes rows [starts[b], starts[b] + lengths[b]) of slot slots[b]
    and reads that slot's positions [0, key_len)."""

    pool: KVPool
    slots: list[int]
    starts: list[int]
    lengths: list[int]

    def __post_init__(self) -> None:
        self.key_len = max(s + n for s, n in zip(self.starts, self.lengths))
        self.pool.check_fits(self.key_len)
        device = self.pool.device
        first, count = self.slots[0], len(self.slots)
        if count == 1:
            self.writes = Writes(first, self.starts[0], self.lengths[0], self.key_len, first, 1, None, None, None, None, None)
            return
        src_b = torch.cat([torch.full((n,), b) for b, n in enumerate(self.lengths)]).to(device)
        src_n = torch.cat([torch.arange(n) for n in self.lengths]).to(device)
        dst_slot = torch.tensor(self.slots).repeat_interleave(torch.tensor(self.lengths)).to(device)
        dst_pos = torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths)]).to(device)
        contiguous = self.slots == list(range(first, first + count))
        read = None if contiguous else torch.tensor(self.slots, device=device)
        self.writes = Writes(0, 0, 0, self.key_len, first, count, src_b, src_n, dst_slot, dst_pos, read)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype attention runs in over this KV."""
        return self.pool.kv.dtype

    def append(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows' k, v [B, kv_heads, N, hd] (pads skipped) -> keys, values [B, kv_heads, key_len, hd]."""
        return write_and_read(self.pool.kv[layer], self.writes, k, v)

    def scripted(self) -> tuple[torch.Tensor | None, Writes | None]:
        """The pool and writes a scripted block passes to `write_and_read`."""
        return self.pool.kv, self.writes


class PassThroughKV:
    """KV for a cache-free forward (training's teacher): attention reads exactly the rows being run."""

    dtype = None  # attention runs in the model's dtype

    def append(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def scripted(self) -> tuple[torch.Tensor | None, Writes | None]:
        """No pool: a scripted block attends to the new rows alone."""
        return None, None
