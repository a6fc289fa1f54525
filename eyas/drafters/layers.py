"""Llama building blocks for the one-layer drafters: RMSNorm, RoPE attention over an explicit KV cache, MLP.

Parameter names follow Hugging Face Llama so official EAGLE checkpoints load by name.
Attention always takes an explicit boolean mask, because drafting runs over trees and
training runs over packed, rolled-out rows; neither is plain causal.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin [B, Q, 1, head_dim] (see `rotate`)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in float32, scale in the input dtype, as Hugging Face computes it (no weight: the
    normalised rows alone). torch's `F.rms_norm` gives the same bits in float32, but on a CPU it runs these
    operators and more. Plain torch, so TorchScript compiles it inside the runtime's blocks too, as `rotate`."""
    normed = x.float()
    normed = (normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if weight is None:
        return normed
    return weight * normed


class RMSNorm(nn.Module):
    """Llama RMSNorm as a module with its weight (`rms_norm`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def frozen_product(layers: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linear layers that read the same input (their outputs side by side), as a
    frozen copy for inference: [sum out, in] and [sum out] or None."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    biases = [layer.bias for layer in layers]
    return weight, None if biases[0] is None else torch.cat([b.detach() for b in biases])


class KVCache:
    """One drafter layer's keys and values, [B, kv_heads, S, head_dim]; grows by appends, shrinks by truncation."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Append k, v [B, KVH, Q, hd] and attend q [B, H, Q, hd] over every key the mask [B, 1, Q, S] shows."""
        keys, values = self.append(k, v)  # [B, KVH, S, hd], in the cache's dtype
        return F.scaled_dot_product_attention(
            q.to(keys.dtype), keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1]
        )  # [B, H, Q, hd]

    def truncate(self, length: int) -> None:
        if self.keys is not None and length < len(self):
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]

    def nbytes(self, rows: int | None = None) -> int:
        """Bytes held for `rows` rows (all rows when None)."""
        if self.keys is None:
            return 0
        per_row = 2 * self.keys[:, :, :1].numel() * self.keys.element_size()
        return per_row * (len(self) if rows is None else rows)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [..., hd] with the half-split convention of Llama checkpoints: x cos + rotate_half(x) sin, where
    rotate_half(x) = [-x2, x1]; `signed_sin` = [-sin1, sin2] carries the sign, so [x2, x1] * signed_sin is the
    same product (negation is exact). Plain torch, so TorchScript compiles it inside the runtime's blocks too."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * signed_sin


def rotary_tables(rope: LlamaRotaryEmbedding, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and signed sin [length, head_dim] (for `rotate`) for positions 0..length-1, computed as Hugging
    Face's RoPE computes them for any RoPE variant the config names (inverse frequencies and attention scaling from
    `rope`)."""
    positions = torch.arange(length, dtype=torch.float32, device=rope.inv_freq.device)
    freqs = positions[:, None] * rope.inv_freq.float()[None]  # [P, head_dim / 2]
    table = torch.cat([freqs, freqs], dim=-1)  # [P, head_dim]
    cos, sin = table.cos() * rope.attention_scaling, table.sin() * rope.attention_scaling
    half = sin.shape[-1] // 2
    sin[:, :half] = -sin[:, :half]
    return cos, sin


class Rotary(nn.Module):
    """cos and signed sin for explicit positions, looked up in tables computed once (and regrown when a position
    passes them)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.inner = LlamaRotaryEmbedding(config)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        cos, sin = self._tables.get(dtype, (None, None))
        if cos is None or cos.device != positions.device or int(positions.max()) >= cos.shape[0]:
            length = max(1024, 2 * int(positions.max()) + 1)
            cos, sin = (t.to(device=positions.device, dtype=dtype) for t in rotary_tables(self.inner, length))
            self._tables[dtype] = (cos, sin)
        return cos[positions][:, :, None], sin[positions][:, :, None]  # [B, Q, 1, head_dim]


class Attention(nn.Module):
    """Multi-head (grouped-query) attention whose q/k/v read `in_features` wide inputs."""

    def __init__(self, config: LlamaConfig, in_features: int):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        qkv_bias = bool(getattr(config, "qkv_bias", False) or getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(
            self.heads * self.head_dim, config.hidden_size, bias=bool(getattr(config, "attention_bias", False))
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv: KVCache,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B, Q, in]; mask: [B, 1, Q, S] bool over all S keys after this append -> [B, Q, d]."""
        b, q_len, _ = x.shape
        cos, sin = rope
        q = rotate(self.q_proj(x).view(b, q_len, self.heads, self.head_dim), cos, sin).transpose(1, 2)  # [B, H, Q, hd]
        k = rotate(self.k_proj(x).view(b, q_len, self.kv_heads, self.head_dim), cos, sin).transpose(1, 2)  # [B, KVH, Q, hd]
        v = self.v_proj(x).view(b, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        out = kv.attend(q, k, v, mask)  # [B, H, Q, hd]
        return self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_name = str(config.hidden_act)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
