"""EAGLE-3 drafter (docs/drafters.md#eagle-3): three fused target taps, a midlayer, its own draft-vocabulary head.

fc reduces [low; mid; high] taps (3 * d_target) to d. The midlayer's attention reads
cat(input_layernorm(embedding), hidden_norm(state)) (2d wide) with the state as residual; its
pre-norm output is the next step's state; `norm` then `lm_head` give draft-vocabulary logits,
mapped to target ids by target = draft + d2t[draft].
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from .base import Drafter
from .layers import MLP, Attention, KVCache, RMSNorm


def draft_to_target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids -> target ids (target = draft + d2t[draft]). Plain torch, so TorchScript compiles it inside
    the served drafter's candidates too (eyas.proposer.ServedStep)."""
    return draft_ids + d2t[draft_ids]


class Eagle3Layer(nn.Module):
    """`midlayer`: token embedding and drafter state enter attention side by side."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = Attention(config, 2 * d)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, embedding, state, rope, kv: KVCache, mask) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embedding), self.hidden_norm(state)], dim=-1)  # [B, Q, 2d]
        h = state + self.self_attn(x, rope, kv, mask)  # [B, Q, d]
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(Drafter):
    kind = "eagle3"

    def __init__(self, config: LlamaConfig, target_hidden_size: int | None = None, num_taps: int = 3):
        super().__init__(config)
        d = config.hidden_size
        self.target_hidden_size = int(target_hidden_size or getattr(config, "target_hidden_size", None) or d)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = nn.Linear(num_taps * self.target_hidden_size, d, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    def set_vocab_map(self, draft_to_target: torch.Tensor, vocab_size: int) -> None:
        """Install the draft vocabulary: `draft_to_target[i]` is the target id of draft id i."""
        draft_to_target = draft_to_target.long()
        if draft_to_target.numel() != self.draft_vocab_size:
            raise ValueError(f"d2t: {draft_to_target.numel()} ids for a draft vocabulary of {self.draft_vocab_size}")
        self.d2t = draft_to_target - torch.arange(self.draft_vocab_size)
        self.t2d = torch.zeros(vocab_size, dtype=torch.bool)
        self.t2d[draft_to_target] = True

    @property
    def attention(self) -> nn.Module:
        return self.midlayer.self_attn

    def seed_hidden(self, target_features: torch.Tensor) -> torch.Tensor:
        return self.fc(target_features.to(self.dtype))  # [..., 3 d_target] -> [..., d]

    def step(self, hidden, tokens, positions, kv, mask):
        rope = self.rotary(positions, hidden.dtype)
        return self.midlayer(self.embed(tokens), hidden, rope, kv, mask)  # [B, Q, d], pre-norm

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(state))  # [..., V_draft]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_to_target_ids(draft_ids, self.d2t)
