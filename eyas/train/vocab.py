"""EAGLE-3 draft vocabulary: the most frequent target tokens among the supervised training tokens."""

from __future__ import annotations

import torch

from .data import Packed


def draft_vocabulary(data: Packed, draft_size: int, vocab_size: int) -> torch.Tensor:
    """[draft_size] target ids in ascending order: the `draft_size` most frequent predicted tokens.

    A supervised source row t is trained toward token x_{t+2}, so counts are taken over the tokens
    two places after supervised, valid rows of one segment. Ties break toward the lower id.
    """
    if not 0 < draft_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_size}")
    target = data.tokens[:, 2:]
    keep = (
        data.supervise[:, :-2]
        & data.valid[:, :-2]
        & data.valid[:, 2:]
        & (data.segment[:, :-2] == data.segment[:, 2:])
    )
    counts = torch.bincount(target[keep], minlength=vocab_size).double()
    order = torch.argsort(-counts, stable=True)  # stable: ties keep ascending ids
    return order[:draft_size].sort().values


@torch.no_grad()
def outside_mass(probs: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Target mass a draft vocabulary cannot propose: probs [..., V], ids [V'] target ids, mask [...] rows to count.

    Returns the mean probability outside the vocabulary and the share of rows whose target argmax is outside.
    """
    inside = torch.zeros(probs.shape[-1], dtype=torch.bool)
    inside[ids] = True
    rows = mask.sum().clamp(min=1)
    outside = (probs * ~inside).sum(-1)
    return {"mass": float((outside * mask).sum() / rows), "argmax": float((~inside[probs.argmax(-1)] & mask).sum() / rows)}
