"""Sampling options, the target distribution they define, and the per-round random draws.

The draws of a round come from a generator keyed by (seed, version), so whichever worker
verifies a round, and however often it is retried, it sees the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


class SamplingError(ValueError):
    """A sampling option is out of range; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those truncations."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if type(self.seed) is not int or not 0 <= self.seed < 2**63:
            raise SamplingError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float64 distribution after temperature, then top-k, then top-p."""
    scores = logits.to(torch.float64) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest most-probable set whose mass reaches top_p (always at least one token).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def round_draws(seed: int, version: int, count: int) -> torch.Tensor:
    """`count` uniforms in [0, 1) for the round that builds on `version` of a request seeded with `seed`."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + version) % 2**63)
    return torch.rand(count, generator=generator, dtype=torch.float64)
