"""The synthetic law of the timed models: next-token distributions keyed by the last tokens of a row's context.

A row's context is the tokens it sees (its KV: the committed prefix and its tree ancestors), by position; the
target's and the drafter's outputs for a row are functions of the hash of its last `law.context` tokens, so a
tree's rows score exactly as plain decoding of their paths would (docs/emulation.md).

Numpy over int64 hashes (torch only once per law, for the drafter's two probability rows): a real device computes
these outputs off the host, so the host pays as little for them as it can (docs/emulation.md, "The law's host
cost").
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from .profile import Law

MODULUS = 16777213  # below 2^24: a hash is exact in a float32 drafter state
BASE = 8191


@lru_cache(maxsize=None)
def powers(context: int) -> np.ndarray:
    """BASE^i mod MODULUS for i < context: a token's weight by its distance from the row."""
    return np.array([pow(BASE, i, MODULUS) for i in range(context)], dtype=np.int64)


def context_hashes(
    tokens: np.ndarray, key_positions: np.ndarray, seen: tuple[np.ndarray, np.ndarray, np.ndarray], row_positions: np.ndarray, context: int
) -> np.ndarray:
    """Keys' tokens and positions [B, K], what each row sees (`seen`: entry, row and key indices [P] each, in
    `np.nonzero`'s order), rows' positions [B, N] -> hashes [B, N] of each row's last `context` tokens (its own
    included)."""
    entry, row, key = seen
    offset = row_positions[entry, row] - key_positions[entry, key]  # [P]
    used = (offset >= 0) & (offset < context)
    entry, row, key, offset = entry[used], row[used], key[used], offset[used]
    terms = (tokens[entry, key] + 1) * powers(context)[offset]  # [P'], each < 2^48
    flat = entry * row_positions.shape[1] + row  # [P'], ascending: a row's terms lie together
    sums = np.zeros(row_positions.size, dtype=np.int64)
    if len(flat):
        first = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])  # each row's first term
        sums[flat[first]] = np.add.reduceat(terms, first)
    return scramble(sums.reshape(row_positions.shape) % MODULUS)


def scramble(h: np.ndarray) -> np.ndarray:
    """Spread hashes over [0, 2^24) (multiplicative hashing): nearby contexts get unrelated outputs."""
    return (h * 2654435761) % (1 << 32) >> 8


def uniform(h: np.ndarray, salt: int) -> np.ndarray:
    """A number in [0, 1) drawn from each hash, independent across salts."""
    return scramble(h ^ (salt * 5_000_011)).astype(np.float64) / (1 << 24)


def ranked_tokens(h: np.ndarray, law: Law) -> np.ndarray:
    """[R] hashes -> [R, ranked] distinct tokens, the target's likeliest first."""
    base = h % law.vocab
    stride = 1 + (h // law.vocab) % (law.vocab // law.ranked - 1)
    return (base[:, None] + np.arange(law.ranked) * stride[:, None]) % law.vocab


def target_logits(h: np.ndarray, law: Law) -> np.ndarray:
    """[R] hashes -> [R, vocab] float32 logits: ranked tokens fall by a per-context sharpness, the rest lie below."""
    sharpness = law.sharpness * (0.5 + uniform(h, 1))  # [R]
    drop = sharpness[:, None] * np.arange(law.ranked + 1)  # [R, ranked + 1]
    logits = np.repeat(-drop[:, -1:], law.vocab, axis=1)
    logits[np.arange(len(h))[:, None], ranked_tokens(h, law)] = -drop[:, :-1]
    return logits.astype(np.float32)


@lru_cache(maxsize=None)
def _candidate_tables(law: Law) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `draft_candidates` reads for every row alike: the agreement ranks' cumulative odds, every rank's source
    order [ranked, ranked], and the drafter's probabilities when it agrees and when not [2, ranked]."""
    cumulative = np.cumsum(np.array(law.agree, dtype=np.float64))
    j = np.arange(law.ranked)
    rank = j[:, None]
    source = np.where(j < rank, j + 1, np.where(j == rank, 0, j))  # a row's order given its top token's rank
    fall = torch.tensor([law.confident, law.unsure]).double()  # each fall as float32 holds it
    probs = torch.softmax(-fall[:, None] * torch.arange(law.ranked), dim=-1).numpy()
    return cumulative, source, probs


def draft_candidates(h: np.ndarray, law: Law, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[R] hashes -> the drafter's k likeliest tokens [R, k] and their probabilities [R, k] float64: the target's
    ranking with its top token moved to the rank `law.agree` draws; past those ranks, further down with odds halving
    rank by rank."""
    cumulative, source, probs = _candidate_tables(law)
    ranks = len(law.agree)
    rank = (uniform(h, 2)[:, None] >= cumulative).sum(-1)  # [R] in [0, len(agree)]
    beyond = ranks + (np.log(1 - uniform(h, 3)) / -np.log(2.0)).astype(np.int64)  # geometric
    rank = np.where(rank == ranks, np.minimum(beyond, law.ranked - 1), rank)
    k = min(k, law.ranked)
    order = ranked_tokens(h, law)[np.arange(len(h))[:, None], source[rank, :k]]
    return order, probs[(rank != 0).astype(np.int64), :k]
