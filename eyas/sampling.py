"""Sampling options: temperature, top-p, top-k and the seed, checked on construction (no torch).

The distribution they define and the noise that samples it are in `eyas.keyed` (docs/sampling.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


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
