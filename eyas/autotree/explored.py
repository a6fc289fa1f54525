"""Explored rounds kept for scoring, and the per-depth correction chosen rounds make to them."""

from __future__ import annotations

from collections import deque

import numpy as np

from ..tree import TreePolicy
from .grid import EXPLORE, Shape
from .replay import Replay


LEVEL_PRIOR = 8.0  # pseudo-trials at the predicted rate that hold each level's correction near 1 (LevelCorrection)


class Explored:
    """The last `size` explored rounds of one of EXPLORATIONS and, for every policy scored so far, its
    total expected tokens per round over them, kept up to date as rounds come and go: scoring the grid again after
    each new round costs one replay of that round, not one of every round."""

    def __init__(self, size: int = 32):
        self.size = size
        self.replays: deque[Replay] = deque()
        # policy -> sum and sum of squares of its tokens, and the sum of its accepted nodes at each depth
        self._sums: dict[TreePolicy, tuple[float, float, list[float]]] = {}
        self._levels: dict[TreePolicy, list[tuple[float, float]]] = {}  # policy -> its mean `Replay.levels`
        # policy -> `tokens(policy, factors)` for the factors in `_tokens_for` (a choice asks for all of them, and the
        # rounds and factors change far less often than choices are made)
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
        """(mean, variance of that mean) of the tokens per round `policy` would have committed on these rounds. With
        `factors` [D], its accepted nodes at depth k count `factors[k - 1]` each (`LevelCorrection`); the variance is
        that of the rounds as recorded."""
        key = None if factors is None else tuple(factors)
        if key != self._tokens_for:
            self._tokens.clear()
            self._tokens_for = key
        if policy not in self._tokens:
            self._tokens[policy] = self._mean(policy, factors)
        return self._tokens[policy]

    def means(self, policies: list[TreePolicy], factors: list[float] | None = None) -> np.ndarray:
        """[P] the mean of `tokens` of each of `policies`, at once (`tokens` asks for one): a choice asks for the
        whole grid, and after each level correction the cache of `tokens` is cold (one policy at a time, that took
        8-13 ms, once in 4 steps of a batch of 8 on the 2-core machine)."""
        sums = [self._sums_of(policy) for policy in policies]
        n = len(self.replays)
        if factors is None:
            return np.array([total for total, _, _ in sums]) / n
        depths = np.array([d for _, _, d in sums]).reshape(len(sums), -1)  # [P, D]
        accepted = np.zeros(len(sums))
        for k, factor in enumerate(factors[: depths.shape[1]]):  # depth by depth: a policy's mean whatever its batch
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
    """From weighted draws (levels drafted, rows verified, weight) of one request's rounds: the levels of the deepest
    of `concurrent` requests drafting together (their levels run in lockstep), each drawing from them, and the mean
    rows one request verifies."""
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
    """How much more or less often the target accepts a node at each depth in the rounds being run than in the rounds
    explored, measured like for like on chosen rounds.

    The explored rounds are few, and the first ones are one prompt's opening, so their acceptance can be far from
    that of the text being decoded, the more so the deeper a policy drafts (each level's error multiplies). A chosen
    round is a direct sample: at each depth k, whether its accepted path reached a node at depth k - 1 with a verified
    child, and whether it went on to depth k. Set beside what the explored rounds predict of the same policy
    (`Explored.levels`), the recent chosen rounds give at each depth k the ratio C_k of the acceptance seen to that
    predicted, and every policy's accepted nodes at depth k then count C_1 x ... x C_k each (`Explored.tokens`). Both
    sides count the policy's own tree: a fixed depth that ends a path whatever it accepts, a floor that stops where
    the drafter is unsure, a budget that leaves a node's children unverified.
    """

    def __init__(self, size: int = 256):
        """`size`: the rounds kept at each depth, the latest that could reach it (deep ones are rarer than shallow)."""
        # per depth: (reached, accepted) as run and as predicted, for the latest rounds either side says may reach it
        self.depths: list[deque[tuple[float, float, float, float]]] = [deque(maxlen=size) for _ in range(EXPLORE.depth)]

    def add(self, seen: list[tuple[float, float]], predicted: list[tuple[float, float]]) -> None:
        """One chosen round: per depth, [D] (reached, accepted) as it ran and as the explored rounds predict."""
        for kept, (reached, accepted), (predicted_reached, predicted_accepted) in zip(self.depths, seen, predicted):
            if reached or predicted_reached:
                kept.append((reached, accepted, predicted_reached, predicted_accepted))

    def factors(self) -> list[float]:
        """[D] the weight of an accepted node at depth 1 .. D: the product of the corrections C_1 .. C_k, each pulled
        towards 1 by LEVEL_PRIOR trials at the predicted rate, and capped where the corrected rate would exceed 1."""
        out, product = [], 1.0
        for kept in self.depths:
            sums = [sum(column) for column in zip(*kept)] if kept else [0.0] * 4
            reached, accepted, predicted_reached, predicted_accepted = sums
            if predicted_accepted > 0.0:
                rate = predicted_accepted / predicted_reached
                product *= min(1.0 / rate, (accepted + LEVEL_PRIOR * rate) / (reached + LEVEL_PRIOR) / rate)
            out.append(product)
        return out
