"""Reading a Hugging Face checkpoint's safetensors one shard at a time, a tensor-parallel rank only its part of each
tensor; a model fuses them as they arrive."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open


class WeightsError(ValueError):
    """A checkpoint lacks a tensor the runtime needs, or has one of the wrong shape; the message names it."""


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every *.safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{directory}: no *.safetensors weights found")
    return files


# (prefix-stripped name) -> () for the whole tensor, (dim, indices) for a contiguous part of it, None to skip it
Selection = Callable[[str], "tuple[()] | tuple[int, range] | None"]


def read_tensors(directory: Path, select: Selection | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (prefix-stripped name, tensor) of the checkpoint, one shard at a time; with `select`, only the part
    of each tensor it names is read from disk."""
    for path in shard_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                stripped = strip_prefix(name)
                part = () if select is None else select(stripped)
                if part is None:
                    continue
                if not part:
                    yield stripped, handle.get_tensor(name)
                    continue
                dim, indices = part
                index = (slice(None),) * dim + (slice(indices.start, indices.stop),)
                yield stripped, handle.get_slice(name)[index]


def strip_prefix(name: str) -> str:
    """`model.layers.3.x` -> `layers.3.x` (also for multimodal `model.language_model.` wrappers)."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def load_state(directory: Path, dtype: torch.dtype, select: Selection | None = None) -> dict[str, torch.Tensor]:
    """All tensors (or the parts `select` names), prefix-stripped and cast to `dtype` (integer buffers keep theirs)."""
    state = {}
    for name, tensor in read_tensors(directory, select):
        state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def take(state: dict[str, torch.Tensor], name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Remove and return one tensor, checking its shape."""
    if name not in state:
        raise WeightsError(f"missing tensor {name}")
    tensor = state.pop(name)
    if shape is not None and tuple(tensor.shape) != shape:
        raise WeightsError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def take_optional(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    return state.pop(name, None)


def take_experts(state: dict[str, torch.Tensor], prefix: str, experts: range, d: int, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral experts `experts` as (gate_up [E, 2I, d], down [E, d, I]), from per-expert `w1/w3/w2` or the stacked
    `mlp.experts.gate_up_proj` / `down_proj` layout (already cut to the share when read)."""
    fused = f"{prefix}.mlp.experts.gate_up_proj"
    n = len(experts)
    if fused in state:
        return take(state, fused, (n, 2 * inner, d)), take(state, f"{prefix}.mlp.experts.down_proj", (n, d, inner))
    base = f"{prefix}.block_sparse_moe.experts"
    gate_up = torch.stack(
        [
            torch.cat([take(state, f"{base}.{e}.w1.weight", (inner, d)), take(state, f"{base}.{e}.w3.weight", (inner, d))])
            for e in experts
        ]
    )  # [E, 2I, d]
    down = torch.stack([take(state, f"{base}.{e}.w2.weight", (d, inner)) for e in experts])  # [E, d, I]
    return gate_up, down


def router_name(state: dict[str, torch.Tensor], prefix: str) -> str:
    for name in (f"{prefix}.block_sparse_moe.gate.weight", f"{prefix}.mlp.gate.weight"):
        if name in state:
            return name
    raise WeightsError(f"missing tensor {prefix}.block_sparse_moe.gate.weight (the MoE router)")
