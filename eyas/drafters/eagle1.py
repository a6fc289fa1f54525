"""EAGLE-1 drafter (docs/drafters.md#eagle-1): fc over [embedding(x_{t+1}); feature_t], one decoder layer.

The layer has no input norm; logits come from the target's frozen LM head applied to the
predicted feature, which is also the next draft step's input feature.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from .base import Drafter
from .layers import MLP, Attention, KVCache, RMSNorm


class Eagle1Layer(nn.Module):
    """`layers.0`: attention and MLP with a post-attention norm, and no input norm."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(config, config.hidden_size)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, kv: KVCache, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(x, rope, kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Drafter(Drafter):
    kind = "eagle1"

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=bool(getattr(config, "bias", True)))
        self.layers = nn.ModuleList([Eagle1Layer(config)])

    @property
    def attention(self) -> nn.Module:
        return self.layers[0].self_attn

    def seed_hidden(self, target_features: torch.Tensor) -> torch.Tensor:
        return target_features.to(self.dtype)

    def step(self, hidden, tokens, positions, kv, mask):
        fused = self.fc(torch.cat([self.embed(tokens), hidden], dim=-1))  # [B, Q, 2d] -> [B, Q, d]
        rope = self.rotary(positions, fused.dtype)
        return self.layers[0](fused, rope, kv, mask)  # [B, Q, d]: predicted feature f_{t+1}

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.target_head(state)  # [..., V]
