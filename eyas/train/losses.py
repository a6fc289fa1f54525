"""Drafter objectives (docs/training.md): masked reductions in float32.

Every loss averages over supervised rows only; callers skip the optimizer step when a batch
has none (weight decay included), so a zero denominator never reaches these functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EAGLE1_WEIGHTS = {"feature": 1.0, "token": 0.1}


def _masked_mean(per_row: torch.Tensor, mask: torch.Tensor, denominator: float | None = None) -> torch.Tensor:
    """Sum of supervised rows over `denominator` (default: their count; data-parallel callers pass their share)."""
    mask = mask.float()
    count = mask.sum() if denominator is None else denominator
    if count == 0:
        raise ValueError("no supervised rows: skip the optimizer step instead of reducing an empty mask")
    return (per_row.float() * mask).sum() / count


def masked_smooth_l1(
    predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, beta: float = 1.0, denominator: float | None = None
) -> torch.Tensor:
    """Feature regression: SmoothL1 averaged over d, then over supervised rows. [..., d] x [..., d] x [...]."""
    per_row = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none", beta=beta).mean(-1)
    return _masked_mean(per_row, mask, denominator)


def masked_soft_ce(
    draft_logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor, denominator: float | None = None
) -> torch.Tensor:
    """-sum_v q(v) log p(v) per row, averaged over supervised rows. [..., V] x [..., V] x [...]."""
    per_row = -(target_probs.float() * F.log_softmax(draft_logits.float(), dim=-1)).sum(-1)
    return _masked_mean(per_row, mask, denominator)


def masked_topk_ce(
    draft_logits: torch.Tensor,
    target_probs: torch.Tensor,
    mask: torch.Tensor,
    k: int = 10,
    denominator: float | None = None,
) -> torch.Tensor:
    """HASS Top-K loss: -sum over the target's top-k of q(v) log p(v); q is NOT renormalised over the top-k."""
    top_q, top_idx = torch.topk(target_probs.float(), min(k, target_probs.shape[-1]), dim=-1)
    log_p = F.log_softmax(draft_logits.float(), dim=-1).gather(-1, top_idx)
    return _masked_mean(-(top_q * log_p).sum(-1), mask, denominator)


def eagle1_objective(feature_loss: torch.Tensor | float, token_loss: torch.Tensor | float, weights: dict | None = None):
    """EAGLE-1: v_w * L_reg + p_w * L_cls with the paper's v_w = 1.0, p_w = 0.1 by default."""
    w = {**EAGLE1_WEIGHTS, **(weights or {})}
    return w["feature"] * feature_loss + w["token"] * token_loss
