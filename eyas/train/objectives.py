"""The three drafter objectives as one rollout: EAGLE-1 (1 step), HASS (3 aligned steps), EAGLE-3 (7 TTT steps).

EAGLE-1: 1.0 * SmoothL1(feature) + 0.1 * soft CE against the frozen head's distribution of the
target feature, with paper or pinned noise on the input features. HASS adds the unnormalised
Top-K loss and alignment steps that feed back the drafter's detached predictions. EAGLE-3 fuses
three taps, drops feature regression and trains soft CE over its draft vocabulary at every
training-time-test step with weights 0.8^s, feeding its states back undetached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..drafters import Drafter, Eagle3Drafter
from .losses import masked_smooth_l1, masked_soft_ce, masked_topk_ce
from .rollout import RolloutKV, shift_rows, step_supervised
from .rows import RowPlan

NOISE_KINDS = ("paper", "pinned", "none")


@dataclass
class Objective:
    """Loss weights and rollout shape of one recipe; stored in every checkpoint."""

    kind: str = "eagle1"
    steps: int = 1
    step_weights: list[float] = field(default_factory=lambda: [1.0])
    feature_weight: float = 1.0
    token_weight: float = 0.1
    topk_weight: float = 0.0
    topk: int = 10
    detach_state: bool = True
    noise: str = "paper"
    noise_scale: float = 0.1
    recall_k: int = 8

    def __post_init__(self) -> None:
        if self.kind not in ("eagle1", "hass", "eagle3"):
            raise ValueError(f"objective kind must be eagle1, hass or eagle3, got {self.kind!r}")
        if self.noise not in NOISE_KINDS:
            raise ValueError(f"noise must be one of {NOISE_KINDS}, got {self.noise!r}")
        if self.steps < 1 or len(self.step_weights) != self.steps:
            raise ValueError(f"step_weights needs one weight per rollout step ({self.steps}), got {self.step_weights}")

    @classmethod
    def preset(cls, kind: str, **overrides) -> "Objective":
        """The published defaults: EAGLE-1 (1.0 / 0.1), HASS (+ Top-10, 3 steps), EAGLE-3 (7 steps, 0.8^s)."""
        if kind == "eagle1":
            base = {}
        elif kind == "hass":
            steps = overrides.get("steps", 3)
            base = {"steps": steps, "step_weights": [1.0] * steps, "topk_weight": 1.0}
        elif kind == "eagle3":
            steps = overrides.get("steps", 7)
            base = {
                "steps": steps,
                "step_weights": [0.8**s for s in range(steps)],
                "feature_weight": 0.0,
                "token_weight": 1.0,
                "detach_state": False,
                "noise": "none",
            }
        else:
            raise ValueError(f"objective kind must be eagle1, hass or eagle3, got {kind!r}")
        return cls(kind=kind, **{**base, **overrides})


def feature_noise(shape: torch.Size, objective: Objective, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Paper: U[-scale, scale]. Pinned: (rand - 0.5) * 2 scale * 512 / seq_len, as the reference code does."""
    if objective.noise == "none":
        return torch.zeros(shape)
    uniform = torch.rand(shape, generator=generator) - 0.5
    if objective.noise == "paper":
        return uniform * 2 * objective.noise_scale
    return uniform * 2 * objective.noise_scale * 512 / seq_len


@dataclass
class TeacherRows:
    """Per-row teacher data of one batch: [B, L] tokens, [B, L, F] features, [B, L, V'] target distribution."""

    source_feature: torch.Tensor
    advanced_token: torch.Tensor
    target_feature: torch.Tensor  # f_{t+1} (EAGLE-1/HASS regression target)
    target_probs: torch.Tensor  # q_{t+2} over the drafter's vocabulary
    in_vocab: torch.Tensor  # [B, L] target argmax lies in the drafter's vocabulary


def count_rows(mask: torch.Tensor) -> float:
    return float(mask.sum())


def rollout_states(
    drafter: Drafter,
    plan: RowPlan,
    source_feature: torch.Tensor,
    advanced_token: torch.Tensor,
    steps: int,
    detach_state: bool,
) -> Iterator[torch.Tensor]:
    """Yield the drafter's output [B, L, d] at each rollout step, each step fed the previous step's output."""
    kv = RolloutKV()
    state = drafter.seed_hidden(source_feature)  # [B, L, d]
    for s in range(steps):
        out = drafter.step(state, shift_rows(advanced_token, s), plan.position + s, kv, plan.mask)
        yield out  # [B, L, d]
        state = out.detach() if detach_state else out


def rollout_loss(
    drafter: Drafter,
    plan: RowPlan,
    teacher: TeacherRows,
    objective: Objective,
    noise: torch.Tensor | None = None,
    denominator: Callable[[torch.Tensor], float] = count_rows,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total weighted loss over rollout steps plus per-step metrics.

    `denominator(mask)` gives each masked mean's normaliser (the global supervised count divided by
    the number of data-parallel workers, so that averaged gradients equal the single-process ones).
    """
    features = teacher.source_feature if noise is None else teacher.source_feature + noise
    states = rollout_states(drafter, plan, features, teacher.advanced_token, objective.steps, objective.detach_state)
    total = torch.zeros(())
    metrics: dict[str, float] = {}
    for s, out in enumerate(states):
        mask = step_supervised(plan, s) & shift_rows(teacher.in_vocab, s, False)
        count = denominator(mask)
        if count == 0:
            continue
        logits = drafter.logits(out)  # [B, L, V']
        q = shift_rows(teacher.target_probs, s)
        loss = objective.token_weight * masked_soft_ce(logits, q, mask, count)
        if objective.feature_weight:
            feature_loss = masked_smooth_l1(out, shift_rows(teacher.target_feature, s), mask, denominator=count)
            loss = loss + objective.feature_weight * feature_loss
            metrics[f"feature_error/{s}"] = float(feature_loss.detach())
        if objective.topk_weight:
            loss = loss + objective.topk_weight * masked_topk_ce(logits, q, mask, objective.topk, count)
        total = total + objective.step_weights[s] * loss
        metrics[f"loss/{s}"] = float(loss.detach())
        metrics.update(_accuracy(logits, q, mask, objective.recall_k, s))
    return total, metrics


@torch.no_grad()
def _accuracy(logits: torch.Tensor, q: torch.Tensor, mask: torch.Tensor, k: int, step: int) -> dict[str, float]:
    """Top-1 agreement with the target argmax, and recall of the target argmax in the draft top-k."""
    target_top = q.argmax(-1)
    draft_top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices
    rows = mask.sum().clamp(min=1)
    return {
        f"top1/{step}": float(((draft_top[..., 0] == target_top) & mask).sum() / rows),
        f"recall@{k}/{step}": float(((draft_top == target_top[..., None]).any(-1) & mask).sum() / rows),
    }


@torch.no_grad()
def teacher_rows(
    drafter: Drafter, rows: dict[str, torch.Tensor], hidden_next: torch.Tensor
) -> TeacherRows:
    """Turn gathered rows into teacher targets: q_{t+2} from the frozen head at position t+1.

    rows: `gather_rows` output over the drafter's feature address; hidden_next: [B, L, d] target
    final-norm hidden states at t+1 (for EAGLE-1 these are the target features themselves).
    """
    logits = drafter.target_head(hidden_next).float()  # [B, L, V]
    if isinstance(drafter, Eagle3Drafter):
        draft_ids = torch.arange(drafter.draft_vocab_size) + drafter.d2t
        in_vocab = drafter.t2d[logits.argmax(-1)]
        logits = logits[..., draft_ids]  # [B, L, V_draft]
    else:
        in_vocab = torch.ones(logits.shape[:-1], dtype=torch.bool)
    return TeacherRows(
        source_feature=rows["source_feature"],
        advanced_token=rows["advanced_token"],
        target_feature=rows["target_feature"],
        target_probs=torch.softmax(logits, dim=-1),
        in_vocab=in_vocab,
    )
