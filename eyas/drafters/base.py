"""What every drafter offers the proposer and the trainer: seed, step, logits, top candidates.

A drafter holds the target's frozen embedding and (for EAGLE-1) LM head by reference, never as
its own parameters: they are not trained, not saved, and must be the target's exact tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from .layers import KVCache, Rotary


def best_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [Q, V] -> the k likeliest ids [Q, k] and their probabilities [Q, k] float64, best first. Plain torch,
    so TorchScript compiles it inside the served drafter's candidates too (eyas.proposer.ServedStep)."""
    logits = logits.float()
    top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, top.indices)  # float32: one fused pass over V
    return top.indices, log_probs.double().exp()


class Drafter(nn.Module):
    """Base class: subclasses define `seed_hidden`, `step`, `logits` and `to_target_ids`."""

    kind = ""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.rotary = Rotary(config)
        self._frozen: tuple[nn.Embedding, nn.Linear] | None = None

    def bind_target(self, embed: nn.Embedding, lm_head: nn.Linear) -> "Drafter":
        """Use the target's frozen embedding and LM head (held by reference, never trained or saved)."""
        if embed.weight.requires_grad or lm_head.weight.requires_grad:
            raise ValueError("the target's embedding and LM head must be frozen (requires_grad=False)")
        self._frozen = (embed, lm_head)
        return self

    @property
    def bound(self) -> bool:
        """Whether `bind_target` gave this drafter a target's embedding and LM head."""
        return self._frozen is not None

    @property
    def embed(self) -> nn.Embedding:
        if self._frozen is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target first")
        return self._frozen[0]

    @property
    def target_head(self) -> nn.Linear:
        if self._frozen is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target first")
        return self._frozen[1]

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def attention(self) -> nn.Module:
        """The one attention module, whose head layout sizes the drafter's KV."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def seed_hidden(self, target_features: torch.Tensor) -> torch.Tensor:
        """[..., F] target features at the declared address, in the dtype they came in -> [..., d] drafter input state."""
        raise NotImplementedError

    def step(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One drafter pass: state [B, Q, d] at row t with advanced token x_{t+1} [B, Q] -> next state [B, Q, d]."""
        raise NotImplementedError

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """[..., d] drafter output -> [..., V_draft] logits for the token after the advanced one."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids."""
        return draft_ids

    @torch.no_grad()
    def top_candidates(self, state: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Q, d] states -> (target token ids [Q, k], conditional probabilities [Q, k] float64), best first."""
        ids, probs = best_candidates(self.logits(state), k)  # [Q, k] draft ids
        return self.to_target_ids(ids), probs
