"""The KV pool a worker owns: one preallocated tensor, a fixed slot per session (see docs/runtime.md).

Layout [layers, 2 (k, v), slots, kv_heads, slot_len, head_dim]. A session borrows one slot; its
committed rows are slot positions [0, committed); a tree's rows are written right after them as
scratch, so dropping a tree is a length reset and a commit moves only the accepted rows into place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

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
        if len(self.slots) > 1:
            b_idx = torch.cat([torch.full((n,), b) for b, n in enumerate(self.lengths)])
            n_idx = torch.cat([torch.arange(n) for n in self.lengths])
            self._src = (b_idx.to(device), n_idx.to(device))
            slot_idx = torch.tensor(self.slots).repeat_interleave(torch.tensor(self.lengths))
            pos_idx = torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths)])
            self._dst = (slot_idx.to(device), pos_idx.to(device))
            first = self.slots[0]
            contiguous = self.slots == list(range(first, first + len(self.slots)))
            self._read = slice(first, first + len(self.slots)) if contiguous else torch.tensor(self.slots, device=device)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype attention runs in over this KV."""
        return self.pool.kv.dtype

    def append(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows' k, v [B, kv_heads, N, hd] (pads skipped) -> keys, values [B, kv_heads, key_len, hd]."""
        pool = self.pool.kv[layer]  # [2, S, kv_heads, T, hd]
        if len(self.slots) == 1:
            slot, start, n = self.slots[0], self.starts[0], self.lengths[0]
            pool[0, slot, :, start : start + n] = k[0, :, :n]
            pool[1, slot, :, start : start + n] = v[0, :, :n]
            return pool[0, slot : slot + 1, :, : self.key_len], pool[1, slot : slot + 1, :, : self.key_len]
        new = torch.stack([k, v]).permute(1, 3, 0, 2, 4)  # [B, N, 2, kv_heads, hd]
        pool.transpose(0, 1)[self._dst[0], :, :, self._dst[1]] = new[self._src].to(pool.dtype)  # [R, 2, kv_heads, hd]
        return pool[0, self._read, :, : self.key_len], pool[1, self._read, :, : self.key_len]


class PassThroughKV:
    """KV for a cache-free forward (training's teacher): attention reads exactly the rows being run."""

    dtype = None  # attention runs in the model's dtype

    def append(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v
