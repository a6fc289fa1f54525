"""The target distribution sampling options define, and the position-keyed noise that samples it.

The token at sequence position t is argmax_v(log p_t(v) + G(seed, t)[v]) with Gumbel noise G that
depends only on (seed, t) (docs/sampling.md). Whichever tree, batch, worker or device verifies a
position, and whether speculation is on at all, the same seed therefore picks the same token.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .sampling import SamplingError, SamplingParams


def target_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float64 log-probabilities after temperature, then top-k, then top-p (-inf: excluded)."""
    scores = logits.to(torch.float64) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    log_probs = torch.log_softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(log_probs.exp(), dim=-1, descending=True)
        # Keep the smallest most-probable set whose mass reaches top_p (always at least one token).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        log_probs = torch.log_softmax(log_probs.masked_fill(drop, -math.inf), dim=-1)
    return log_probs


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float64 distribution after temperature, then top-k, then top-p."""
    return target_log_probs(logits, params).exp()


def position_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """[V] float64 standard Gumbel noise of sequence position `position` of a request seeded with `seed`.

    Counter-based and computed on the CPU: Philox4x64-10 keyed by (seed, position) gives V 64-bit words; the
    top 52 bits of each, plus one half, give a uniform u strictly inside (0, 1), and G = -log(-log u). No
    state is consumed, so the noise of a position is the same whoever asks, in whatever order, wherever the
    logits live.
    """
    if type(position) is not int or not 0 <= position < 2**63:
        raise SamplingError(f"position must be an integer in [0, 2**63), got {position!r}")
    words = np.random.Philox(key=[seed, position]).random_raw(vocab_size)  # [V] uint64
    uniforms = ((words >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52  # [V] in (0, 1)
    return torch.from_numpy(-np.log(-np.log(uniforms)))


def keyed_token(log_probs: torch.Tensor, seed: int, position: int) -> int:
    """The token that the noise of `position` picks from a [V] log-distribution (Gumbel-max: drawn from exp(log_probs))."""
    noise = position_noise(seed, position, log_probs.shape[-1]).to(log_probs.device)
    return int(torch.argmax(log_probs + noise))
