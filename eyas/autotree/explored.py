"""Explored rounds kept for scoring, and the per-depth correction chosen rounds make to them."""

from __future__ import annotations

from collections import deque

import numpy as np

from ..tree import TreePolicy
from .grid import EXPLORE, Shape
from .replay import Replay


LEVEL_PRIOR = 8.0  # pseudo-trials at the predicted rate that hold each level's correction near 1 (LevelCorrection)


class Explored:
    """The last `size` rounds of one of EXPLORATIONS, with every scored policy's sums over them kept up to date as
    rounds come and go (a new round costs one replay)."""

    def __init__(self, size: int = 32):
        self.size = size
        self.replays: deque[Replay] = deque()
        # policy -> sum and sum of squares of its tokens, and the sum of its accepted nodes at each depth
        self._sums: dict[TreePolicy, tuple[float, float, list[float]]] = {}
        self._levels: dict[TreePolicy, list[tuple[float, float]]] = {}  # policy -> its mean `Replay.levels`
        # policy -> `tokens(policy, factors)` for the factors in `_tokens_for`
        self._tokens: dict[TreePolicy, tuple[float, float]] = {}
        self._tokens_for: tuple[float, ...] | None = None

    def __len__(self) -> int:
        return len(self.replays)

    def append(self, replay: Replay) -> None:
        """Add an explored round, dropping the oldest once `size` are kept."""
        if len(self.replays) == self.size:
            self._add(self.replays.popleft(), -1.0)
        self.replays.append(replay)
        self._add(replay, 1.0)
        self._levels.clear()
        self._tokens.clear()

    def _add(self, replay: Replay, sign: float) -> None:
        for policy, (total, squares, depths) in self._sums.items():
            x = 1.0 + replay.expected(policy)
            depths = [d + sign * v for d, v in zip(depths, replay.by_depth(policy))]
            self._sums[policy] = (total + sign * x, squares + sign * x * x, depths)

    def tokens(self, policy: TreePolicy, factors: list[float] | None = None) -> tuple[float, float]:
        """(mean, variance of the mean) of the tokens per round `policy` would have committed here; with `factors` [D]
        an accepted node at depth k counts `factors[k - 1]` (`LevelCorrection`)."""
        key = None if factors is None else tuple(factors)
        if key != self._tokens_for:
            self._tokens.clear()
            self._tokens_for = key
        if policy not in self._tokens:
            self._tokens[policy] = self._mean(policy, factors)
        return self._tokens[policy]

    def means(self, policies: list[TreePolicy], factors: list[float] | None = None) -> np.ndarray:
        """[P] the mean of `tokens` of each of `policies`, at once."""
        sums = [self._sums_of(policy) for policy in policies]
        n = len(self.replays)
        if factors is None:
            return np.array([total for total, _, _ in sums]) / n
        depths = np.array([d for _, _, d in sums]).reshape(len(sums), -1)  # [P, D]
        accepted = np.zeros(len(sums))
        for k, factor in enumerate(factors[: depths.shape[1]]):  # depth by depth: the same sums as one policy's
            accepted = accepted + factor * depths[:, k]
        return 1.0 + accepted / n

    def _sums_of(self, policy: TreePolicy) -> tuple[float, float, list[float]]:
        """The kept sums of `policy`'s tokens over these rounds (computed on first use, then kept up to date)."""
        if policy not in self._sums:
            values = [1.0 + replay.expected(policy) for replay in self.replays]
            depths = [sum(column) for column in zip(*(replay.by_depth(policy) for replay in self.replays))]
            self._sums[policy] = (sum(values), sum(x * x for x in values), depths)
        return self._sums[policy]

    def _mean(self, policy: TreePolicy, factors: list[float] | None) -> tuple[float, float]:
        """`tokens`, computed from the kept sums (the mean as `means` computes it for many)."""
        total, squares, _ = self._sums_of(policy)
        n = len(self.replays)
        mean = total / n
        spread = max(0.0, squares - n * mean * mean) / max(1, n - 1)
        return float(self.means([policy], factors)[0]), spread / n

    def levels(self, policy: TreePolicy) -> list[tuple[float, float]]:
        """`Replay.levels` of `policy` averaged over these rounds (kept until the rounds change)."""
        if policy not in self._levels:
            n = len(self.replays)
            columns = zip(*(replay.levels(policy) for replay in self.replays))
            self._levels[policy] = [(sum(r for r, _ in c) / n, sum(a for _, a in c) / n) for c in columns]
        return self._levels[policy]


def lockstep_shape(draws: list[tuple[int, int, float]], concurrent: int) -> Shape:
    """From weighted draws (levels, rows, weight) of one request's rounds: the expected levels of the deepest of
    `concurrent` requests drafting in lockstep, and the mean rows one verifies."""
    total = sum(weight for _, _, weight in draws)
    by_level: dict[int, float] = {}
    for levels, _, weight in draws:
        by_level[levels] = by_level.get(levels, 0.0) + weight
    # E[max of `concurrent` draws] = sum over k >= 1 of P(max >= k) = 1 - P(one draw < k) ** concurrent
    deepest, below = 0.0, 0.0
    for k in range(1, max(by_level) + 1):
        below += by_level.get(k - 1, 0.0)
        deepest += 1.0 - (below / total) ** concurrent
    return deepest, sum(rows * weight for _, rows, weight in draws) / total


class LevelCorrection:
    """Per depth k, the ratio C_k of the acceptance chosen rounds saw to what the explored rounds predicted for the
    same policy; an accepted node at depth k then counts C_1 x ... x C_k (docs/autotree.md)."""

    def __init__(self, size: int = 256):
        """`size`: the latest rounds kept at each depth, of those that could reach it."""
        # per depth: (reached, accepted) as run and as predicted, for the latest rounds either side says may reach it
        self.depths: list[deque[tuple[float, float, float, float]]] = [deque(maxlen=size) for _ in range(EXPLORE.depth)]

    def add(self, seen: list[tuple[float, float]], predicted: list[tuple[float, float]]) -> None:
        """One chosen round: per depth, [D] (reached, accepted) as it ran and as the explored rounds predict."""
        for kept, (reached, accepted), (predicted_reached, predicted_accepted) in zip(self.depths, seen, predicted):
            if reached or predicted_reached:
                kept.append((reached, accepted, predicted_reached, predicted_accepted))

    def factors(self) -> list[float]:
        """[D] the weight of an accepted node at depths 1 .. D: C_1 x ... x C_k, each C pulled towards 1 by LEVEL_PRIOR
        trials and capped where the corrected rate would pass 1."""
        out, product = [], 1.0
        for kept in self.depths:
            sums = [sum(column) for column in zip(*kept)] if kept else [0.0] * 4
            reached, accepted, predicted_reached, predicted_accepted = sums
            if predicted_accepted > 0.0:
                rate = predicted_accepted / predicted_reached
                product *= min(1.0 / rate, (accepted + LEVEL_PRIOR * rate) / (reached + LEVEL_PRIOR) / rate)
            out.append(product)
        return out
