"""Training-time rollouts (docs/training.md#hass, #eagle-3): later steps see the drafter's own earlier states.

Rows are indexed by their root: at rollout step s, root row t simulates the depth-s tree node
whose root is row t. It feeds back the state the drafter produced for row t at step s - 1, reads
the advanced token x_{t+s+1}, sits at position t + s, and is trained toward the targets of row
t + s. Its attention sees exactly what it will see at inference: the target-derived step-0 rows
up to its root (the legal target prefix), its draft ancestors (row t at steps 1..s-1) and itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rows import RowPlan


class RolloutKV:
    """The drafter's keys during a rollout: step 0's rows, read under the plan's mask, and each later step's own row.

    A step-s query of root row t sees the step-0 rows the plan's mask shows it and row t at steps 1..s, so the
    later steps' keys are read along their diagonal rather than as s L more columns that the mask would hide.
    """

    def __init__(self) -> None:
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        self.own: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, L, hd], this step's k, v [B, KVH, L, hd], the plan's mask [B, 1, L, L] -> [B, H, L, hd]."""
        groups = q.shape[1] // k.shape[1]
        if self.prefix is None:
            self.prefix = (k, v)
            return F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, enable_gqa=groups > 1)
        self.own.append((k, v))
        k0, v0 = (t.repeat_interleave(groups, dim=1) for t in self.prefix)  # [B, H, L, hd]
        own_k, own_v = (torch.stack([t.repeat_interleave(groups, dim=1) for t in ts], dim=-2) for ts in zip(*self.own))
        scale = q.shape[-1] ** -0.5
        scores = torch.cat([
            (q @ k0.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")),  # [B, H, L, L]
            (q.unsqueeze(-2) * own_k).sum(-1) * scale,  # [B, H, L, s]: row t at steps 1..s
        ], dim=-1)
        weights = torch.softmax(scores.float(), dim=-1).to(v0.dtype)
        length = k0.shape[2]
        return weights[..., :length] @ v0 + (weights[..., length:, None] * own_v).sum(-2)


def shift_rows(x: torch.Tensor, step: int, fill: float | int = 0) -> torch.Tensor:
    """Row i of the result is row i + step of `x` ([B, L, ...]); rows past the end get `fill`."""
    if step == 0:
        return x
    pad = torch.full_like(x[:, :step], fill)
    return torch.cat([x[:, step:], pad], dim=1)


def step_valid(plan: RowPlan, step: int) -> torch.Tensor:
    """[B, L] rows whose chain t, t+1, ..., t+step are all legal rows of one segment, at consecutive positions."""
    ahead_valid = shift_rows(plan.valid, step, False)
    ahead_source = shift_rows(plan.source, step, -1)
    ahead_segment = shift_rows(plan.segment, step, -1)
    return plan.valid & ahead_valid & (ahead_source == plan.source + step) & (ahead_segment == plan.segment)


def step_supervised(plan: RowPlan, step: int) -> torch.Tensor:
    """[B, L] loss mask of rollout step `step`: the chain is legal and row t + step is supervised."""
    return step_valid(plan, step) & shift_rows(plan.soft, step, False)
