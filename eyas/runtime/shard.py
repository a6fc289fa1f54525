"""Tensor parallelism (docs/groups.md): the contiguous share of heads, kv heads, MLP columns, experts and vocabulary
rows a rank holds, the collectives of a sharded forward, the process group, and `RankSteps`, which keeps the ranks'
steps in one order. A size-1 shard is the plain model: every collective is the identity."""

from __future__ import annotations

import datetime
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = datetime.timedelta(days=30)  # a follower waits this long for rank 0's next step while idle


class ShardError(ValueError):
    """A model cannot be split over the asked number of ranks; `field` is the knob to change."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class GroupError(RuntimeError):
    """A collective of a tensor-parallel group failed (a rank died or timed out): the group is unusable."""


@dataclass(frozen=True)
class Shard:
    """One rank's place in a tensor-parallel group; `group` runs the forward's collectives, `control` (gloo) the
    broadcasts of steps."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup
    control: Any = None

    def span(self, total: int) -> range:
        """This rank's contiguous share of `total` equal parts (heads, kv heads, experts, vocabulary rows)."""
        share = total // self.size
        return range(self.rank * share, (self.rank + 1) * share)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results over the ranks, in place (identity for one rank)."""
        if self.size > 1:
            _collective(dist.all_reduce, x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size n], rank order (identity for one rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective(dist.all_gather, parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def embed(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """tokens [B, N] over a vocabulary-split table [V / size, d] -> [B, N, d] on every rank (each rank's own rows,
        summed)."""
        if self.size == 1:
            return torch.nn.functional.embedding(tokens, table)
        local = tokens - self.span(table.shape[0] * self.size).start
        inside = (local >= 0) & (local < table.shape[0])
        x = torch.nn.functional.embedding(local.clamp(0, table.shape[0] - 1), table) * inside[..., None].to(table.dtype)
        return self.all_reduce(x)


def _collective(fn: Callable, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except RuntimeError as exc:  # gloo: a peer closed its connection; NCCL: a watchdog timeout
        raise GroupError(f"tensor-parallel collective failed: {exc}") from exc


_LAYER = re.compile(r"^layers\.\d+\.")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.")


def shard_selection(name: str, config, shard: Shard) -> tuple[()] | tuple[int, range] | None:
    """The part of checkpoint tensor `name` (prefix-stripped) this rank reads: (dim, indices) of a split tensor, ()
    for a replicated one (norms, router, o bias), None for one it skips (another rank's expert)."""
    if shard.size == 1:
        return ()
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return 0, shard.span(int(config.vocab_size))
    match = _LAYER.match(name)
    if match is None:
        return ()
    rest = name[match.end():]
    heads, kv_heads, hd = dims(config)
    if rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
        return 0, _scaled(shard.span(heads), hd)
    if rest in ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias"):
        return 0, _scaled(shard.span(kv_heads), hd)
    if rest == "self_attn.o_proj.weight":
        return 1, _scaled(shard.span(heads), hd)
    inner = int(config.intermediate_size)
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return 0, shard.span(inner)
    if rest == "mlp.down_proj.weight":
        return 1, shard.span(inner)
    experts = int(getattr(config, "num_local_experts", 0) or 0)
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return 0, shard.span(experts)
    expert = _EXPERT.match(rest)
    if expert is not None:
        return () if int(expert.group(1)) in shard.span(experts) else None
    return ()


def _scaled(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def dims(config) -> tuple[int, int, int]:
    """(attention heads, kv heads, head_dim) of a Llama-family config."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    return heads, kv_heads, head_dim


def check_shardable(config, size: int, field: str = "tensor_parallel") -> None:
    """Refuse a split that would not give every rank equal whole heads, kv heads, experts, MLP columns and vocabulary rows."""
    if type(size) is not int or size < 1:
        raise ShardError(field, f"must be an integer >= 1, got {size!r}")
    heads, kv_heads, _ = dims(config)
    counts = {
        "attention heads": heads,
        "key/value heads": kv_heads,
        "vocabulary rows": int(config.vocab_size),
    }
    experts = int(getattr(config, "num_local_experts", 0) or 0)
    counts.update({"experts": experts} if experts else {"intermediate columns": int(config.intermediate_size)})
    for what, count in counts.items():
        if count % size:
            raise ShardError(field, f"{size} ranks do not divide the target's {count} {what}")


def open_rendezvous(host: str) -> dist.TCPStore:
    """Rank 0's store on a free port of `host` (read it back as `.port`); the other ranks connect to it."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=CONTROL_TIMEOUT)


def join_group(
    host: str, port: int, rank: int, size: int, device: torch.device, timeout: datetime.timedelta, store: dist.TCPStore | None = None
) -> Shard:
    """Join a group of `size` ranks at rank 0's store (rank 0 passes the store it opened): the forward over NCCL on
    CUDA and gloo on CPU, the steps over gloo."""
    if size == 1:
        return Shard()
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Shard(rank, size, dist.group.WORLD, control)


class RankSteps:
    """Rank 0 broadcasts each step (an op name and its arguments) before running it and the other ranks run the steps
    in the same order, so every collective inside a step meets; a failed collective breaks the group for good."""

    def __init__(self, shard: Shard, ops: dict[str, Callable[..., Any]]):
        self.shard = shard
        self.ops = ops
        self.broken: GroupError | None = None
        self._lock = threading.Lock()  # a broadcast and its local run are one step

    def lead(self, op: str, *args: Any) -> Any:
        """Run `op` here and on every other rank (rank 0 only)."""
        with self._lock:
            if self.broken is not None:
                raise self.broken
            try:
                if self.shard.size > 1:
                    _collective(dist.broadcast_object_list, [(op, args)], src=0, group=self.shard.control)
                return self.ops[op](*args)
            except GroupError as exc:
                self.broken = exc
                raise

    def follow(self) -> None:
        """Run rank 0's steps until it sends `stop` (ranks > 0); raises GroupError when the group breaks."""
        while True:
            step: list[Any] = [None]
            _collective(dist.broadcast_object_list, step, src=0, group=self.shard.control)
            op, args = step[0]
            if op == "stop":
                return
            self.ops[op](*args)

    def stop(self) -> None:
        """Release the followers (rank 0); a broken group has nobody to release."""
        with self._lock:
            if self.shard.size > 1 and self.broken is None:
                _collective(dist.broadcast_object_list, [("stop", ())], src=0, group=self.shard.control)
