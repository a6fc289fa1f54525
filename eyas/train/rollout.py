"""Training-time rollouts (docs/training.md#hass, #eagle-3): later steps see the drafter's own earlier states.

Rows are indexed by their root: at rollout step s, root row t simulates the depth-s tree node
whose root is row t. It feeds back the state the drafter produced for row t at step s - 1, reads
the advanced token x_{t+s+1}, sits at position t + s, and is trained toward the targets of row
t + s. Its attention sees exactly what it will see at inference: the target-derived step-0 rows
up to its root (the legal target prefix), its draft ancestors (row t at steps 1..s-1) and itself.
"""

from __future__ import annotations

import torch

from .rows import RowPlan


def rollout_mask(plan: RowPlan, step: int) -> torch.Tensor:
    """[B, 1, L, (step + 1) L] bool visibility of step-`step` queries over the keys of steps 0..step."""
    b, _, l, _ = plan.mask.shape
    eye = torch.eye(l, dtype=torch.bool).expand(b, 1, l, l)
    if step == 0:
        return plan.mask
    ancestors_and_self = [eye] * step  # row t at steps 1..step
    return torch.cat([plan.mask, *ancestors_and_self], dim=-1)


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
