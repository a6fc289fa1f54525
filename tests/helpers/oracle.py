"""Oracle drafters for tests: they know the target's greedy continuation and propose it at a chosen rank.

A row at draft position p carries the token at target position p + 1 and predicts position p + 2.
When that token is on the reference path, the true next token is placed at rank `rank(p)` among
the candidates (rank >= the tree's width means it is left out); off the path the proposals are arbitrary.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from eyas.drafters import Drafter
from eyas.drafters.layers import KVCache


class OracleDrafter(Drafter):
    kind = "eagle1"

    def __init__(self, config, reference: list[int], rank: Callable[[int], int] = lambda p: 0):
        super().__init__(config)
        self.reference = reference
        self.rank = rank
        self.vocab = int(config.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def attention(self) -> SimpleNamespace:
        return SimpleNamespace(kv_heads=1, head_dim=1)  # the one zero row per step that `step` appends

    def seed_hidden(self, target_features: torch.Tensor) -> torch.Tensor:
        return target_features

    def step(self, hidden, tokens, positions, kv: KVCache, mask):
        b, q = tokens.shape
        kv.append(torch.zeros(b, 1, q, 1), torch.zeros(b, 1, q, 1))  # keep draft-KV row bookkeeping honest
        ref = self.reference
        on_path = torch.tensor(
            [[p + 1 < len(ref) and ref[p + 1] == t for p, t in zip(ps, ts)] for ps, ts in zip(positions.tolist(), tokens.tolist())]
        )
        return torch.stack([positions.float(), on_path.float()], dim=-1)  # [B, Q, 2]

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        flat = state.reshape(-1, 2)
        logits = torch.zeros(flat.shape[0], self.vocab)
        for i, (p, on_path) in enumerate(flat.tolist()):
            p = int(p)
            truth = self.reference[p + 2] if on_path and p + 2 < len(self.reference) else (p * 7 + 1) % self.vocab
            rank = self.rank(p) if on_path else 0
            candidates = [(truth + j) % self.vocab for j in range(1, 6)]
            if rank < 5:
                candidates.insert(rank, truth)
            for r, token in enumerate(candidates[:5]):
                logits[i, token] = 10.0 - 2.0 * r
        return logits.reshape(*state.shape[:-1], self.vocab)
