"""Linear layers for serving: on a CPU, products of 1 to MAX_PACKED_ROWS rows in float32 (and bfloat16 where oneDNN
has bf16 products) go through oneDNN on a weight reordered once, rows padded to a few buckets; elsewhere `F.linear`
(docs/runtime.md, "Linear layers")."""

from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .script import script

MAX_PACKED_ROWS = 128


def row_bucket(rows: int) -> int:
    """The row count a product of `rows` rows runs at: exact up to 8, then 4 sizes per doubling (<= 25% padding)."""
    if rows <= 8:
        return rows
    top = 1  # the largest power of two <= rows
    while top * 2 <= rows:
        top *= 2
    step = top // 4
    return (rows + step - 1) // step * step


@script
def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[torch.Tensor], max_rows: int = MAX_PACKED_ROWS
) -> torch.Tensor:
    """[..., in] -> [..., out]: x W^T + b, through oneDNN's `packed` copy of W (rows padded to a bucket) when there is
    one and the product has 1 to `max_rows` rows, else `F.linear`."""
    rows = x.numel() // x.shape[-1]
    if packed is None or rows <= 0 or rows > max_rows:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])  # [R, in]
    padded = row_bucket(rows)
    if padded != rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])  # [R', in]
    scalars: List[Optional[Union[int, float, complex]]] = []
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", scalars, "")  # [R', out]
    return (out if padded == rows else out[:rows]).view(list(x.shape[:-1]) + [out.shape[-1]])


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products in `dtype` on `device` go through oneDNN: on a CPU, float32, and bfloat16 where oneDNN has
    bf16 products."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bucketed_rows(calls: int, rows: int) -> int:
    """Rows per call (at least `rows`, at most 25% more) such that `calls` x rows is a bucket, else `rows`."""
    if calls * rows > MAX_PACKED_ROWS:
        return rows
    for n in range(rows, rows + rows // 4 + 1):
        if row_bucket(calls * n) == calls * n:
            return n
    return rows


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """[out, in] weight -> a copy reordered for oneDNN where products go through it (`packs`), else None."""
    if not packs(weight.dtype, weight.device):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are views of the same elements (same storage, offset, shape and strides)."""
    return (
        a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


class Linear:
    """A frozen weight [out, in] (and bias [out]) for inference, with its oneDNN copy where products use one."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.packed = prepack(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out]."""
        return linear(x, self.weight, self.bias, self.packed)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this layer holds (weight, bias, packed copy), e.g. to count its bytes."""
        return [t for t in (self.weight, self.bias, self.packed) if t is not None]


class PackedLinear(nn.Module):
    """A frozen `nn.Linear` for inference: keeps `weight` and `bias` (state dicts read the same) and multiplies
    through `Linear`."""

    def __init__(self, layer: nn.Linear, shared: Linear | None = None):
        """`shared`: a `Linear` of the same weight storage and no bias (the target's LM head, for a drafter bound to
        it in process) whose packed copy serves this layer too; else the layer packs its own."""
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight = layer.weight
        self.bias = layer.bias
        if shared is not None and layer.bias is None and shared.bias is None and same_tensor(shared.weight, layer.weight):
            self.linear = shared
        else:
            self.linear = Linear(layer.weight.detach(), None if layer.bias is None else layer.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            raise RuntimeError("PackedLinear is for inference: its packed weight does not follow training updates")
        return self.linear(x)


def pack_linears(module: nn.Module, skip: frozenset[int] = frozenset()) -> nn.Module:
    """Replace every `nn.Linear` inside `module` in place by a `PackedLinear`, but those whose id is in `skip`."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            if id(child) not in skip:
                setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child, skip)
    return module
