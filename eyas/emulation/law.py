"""The synthetic law of the timed models: next-token distributions keyed by the last tokens of a row's context.

A row's context is the tokens it sees (its KV: the committed prefix and its tree ancestors), by position; the
target's and the drafter's outputs for a row are functions of the hash of its last `law.context` tokens, so a
tree's rows score exactly as plain decoding of their paths would (docs/emulation.md).
"""

from __future__ import annotations

import torch

from .profile import Law

MODULUS = 16777213  # below 2^24: a hash is exact in a float32 drafter state
BASE = 8191


def context_hashes(
    tokens: torch.Tensor, key_positions: torch.Tensor, visible: torch.Tensor, row_positions: torch.Tensor, context: int
) -> torch.Tensor:
    """Keys' tokens and positions [B, W], what each row sees [B, N, W], rows' positions [B, N] -> hashes [B, N] of each
    row's last `context` tokens (its own included)."""
    offset = row_positions[:, :, None] - key_positions[:, None, :]  # [B, N, W]
    used = visible & (offset >= 0) & (offset < context)
    powers = torch.tensor([pow(BASE, i, MODULUS) for i in range(context)], dtype=torch.long)
    terms = (tokens[:, None, :] + 1) * powers[offset.clamp(0, context - 1)]  # < 2^48
    return scramble((terms * used).sum(-1) % MODULUS)


def scramble(h: torch.Tensor) -> torch.Tensor:
    """Spread hashes over [0, 2^24) (multiplicative hashing): nearby contexts get unrelated outputs."""
    return (h * 2654435761) % (1 << 32) >> 8


def uniform(h: torch.Tensor, salt: int) -> torch.Tensor:
    """A number in [0, 1) drawn from each hash, independent across salts."""
    return scramble(h ^ (salt * 5_000_011)).double() / (1 << 24)


def ranked_tokens(h: torch.Tensor, law: Law) -> torch.Tensor:
    """[R] hashes -> [R, ranked] distinct tokens, the target's likeliest first."""
    base = h % law.vocab
    stride = 1 + (h // law.vocab) % (law.vocab // law.ranked - 1)
    return (base[:, None] + torch.arange(law.ranked) * stride[:, None]) % law.vocab


def target_logits(h: torch.Tensor, law: Law) -> torch.Tensor:
    """[R] hashes -> [R, vocab] float32 logits: ranked tokens fall by a per-context sharpness, the rest lie below."""
    sharpness = law.sharpness * (0.5 + uniform(h, 1))  # [R]
    drop = sharpness[:, None] * torch.arange(law.ranked + 1)  # [R, ranked + 1]
    logits = (-drop[:, -1:]).expand(len(h), law.vocab).clone()
    logits.scatter_(1, ranked_tokens(h, law), -drop[:, :-1])
    return logits.float()


def draft_candidates(h: torch.Tensor, law: Law, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R] hashes -> the drafter's k likeliest tokens [R, k] and their probabilities [R, k] float64: the target's
    ranking with its top token moved to the rank `law.agree` draws; past those ranks, further down with odds halving
    rank by rank."""
    ranks = len(law.agree)
    cumulative = torch.tensor(law.agree, dtype=torch.float64).cumsum(0)
    rank = (uniform(h, 2)[:, None] >= cumulative).sum(-1)  # [R] in [0, len(agree)]
    beyond = ranks + (torch.log(1 - uniform(h, 3)) / -torch.log(torch.tensor(2.0, dtype=torch.float64))).long()  # geometric
    rank = torch.where(rank == ranks, beyond.clamp(max=law.ranked - 1), rank)
    j = torch.arange(law.ranked)
    source = torch.where(j < rank[:, None], j + 1, torch.where(j == rank[:, None], 0, j))  # [R, ranked]
    order = ranked_tokens(h, law).gather(1, source)
    fall = torch.where(rank == 0, law.confident, law.unsure).double()  # [R]
    probs = torch.softmax(-fall[:, None] * j, dim=-1)
    k = min(k, law.ranked)
    return order[:, :k], probs[:, :k]
