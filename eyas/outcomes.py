"""What verifying a drafted tree will decide, guessed before the target has run: how often the target accepts a
node of a given drafter confidence (`Calibration`, learned from verified rounds), and the likeliest outcomes of a
round (`likeliest_outcomes`), which drafting ahead pre-builds the next trees for (docs/runtime.md).

Pure bookkeeping over `DraftTree` records and numpy arrays: no model, no torch.
"""

from __future__ import annotations

import numpy as np

from .tree import DraftTree

REST_FLOOR = 1e-6  # the drafter's mass left to a node's unverified tokens, at least (a node whose children took it all)


class Calibration:
    """How often the target accepts a drafted node, given its parent was accepted, by the drafter's own conditional
    probability of that node, recent rounds weighing more. A drafter's probabilities are rarely the target's: a
    distilled drafter decoded greedily is accepted at its high-confidence nodes nearly always, and at its
    low-confidence ones less often than it says. Tree auto counts the nodes an exploring round recorded but left
    unverified at these rates (`autotree.Replay`); drafting ahead prices the outcomes it guesses at with them."""

    BINS = 10  # equal-width bins of the drafter's probability
    PRIOR = 2.0  # pseudo-nodes pulling a bin towards its own mid probability (the drafter taken at its word)

    def __init__(self, decay: float = 0.97) -> None:
        """`decay`: the weight left to earlier rounds at each new one."""
        self.decay = decay
        self.accepted = [0.0] * self.BINS
        self.counts = [0.0] * self.BINS

    @classmethod
    def bin(cls, probability: float) -> int:
        """The bin of a drafter probability."""
        return min(cls.BINS - 1, int(probability * cls.BINS))

    def add(self, tree: DraftTree, accept: dict[int, float]) -> None:
        """Fold in one verified round: accept[node], for nodes whose parent was accepted, is the probability the
        target accepted it (1 or 0 where the outcome is known)."""
        self.accepted = [a * self.decay for a in self.accepted]
        self.counts = [c * self.decay for c in self.counts]
        for node, probability in accept.items():
            if node:
                b = self.bin(tree.confidences[node])
                self.accepted[b] += probability
                self.counts[b] += 1.0

    def rates(self) -> list[float]:
        """Acceptance rate of each bin."""
        return [(a + self.PRIOR * (b + 0.5) / self.BINS) / (c + self.PRIOR) for b, (a, c) in enumerate(zip(self.accepted, self.counts))]


def children_of(tree: DraftTree, nodes: list[int]) -> dict[int, list[int]]:
    """Each of `nodes` -> its children among `nodes` (the verified nodes of a flattened tree)."""
    children: dict[int, list[int]] = {n: [] for n in nodes}
    for n in nodes:
        if n and tree.parents[n] in children:
            children[tree.parents[n]].append(n)
    return children


def observed_acceptance(tree: DraftTree, nodes: list[int], accepted: tuple[int, ...]) -> dict[int, float]:
    """What one decided round shows of acceptance: for every verified node (of `nodes`) whose parent the target
    accepted, 1.0 if it accepted the node too, else 0.0. `accepted`: the accepted tokens after the root."""
    children = children_of(tree, nodes)
    seen: dict[int, float] = {}
    node = 0
    for token in (*accepted, None):
        taken = None
        for child in children[node]:
            hit = tree.tokens[child] == token
            seen[child] = 1.0 if hit else 0.0
            taken = child if hit else taken
        if taken is None:
            break
        node = taken
    return seen


def likeliest_outcomes(
    tree: DraftTree, nodes: list[int], tokens: np.ndarray, probs: np.ndarray, rates: Calibration, count: int
) -> list[tuple[float, int, int]]:
    """The `count` likeliest outcomes of verifying `nodes` of `tree` (a flattened tree's nodes, in row order),
    likeliest first (ties in row and rank order), as (probability, node n, bonus b): the target accepts the path from
    the root to n, none of n's verified children, and then picks b.

    `tokens`, `probs` [N, k]: the drafter's candidate tokens at each of `nodes` and their probabilities (float64),
    best first. The path and the children's rejection are priced at the calibrated acceptance of each node's drafter
    probability; the bonus at the drafter's probability of b among the tokens that are not n's verified children.
    With no rounds seen, `rates` takes the drafter about at its word, and this is about the drafter's own probability
    of the path followed by b.
    """
    row_of = {node: row for row, node in enumerate(nodes)}
    up = np.array([row_of[tree.parents[n]] for n in nodes[1:]], dtype=np.int64)  # [N - 1]: each other row's parent row
    confidences = np.array([tree.confidences[n] for n in nodes])  # [N]
    bins = np.minimum(Calibration.BINS - 1, (confidences * Calibration.BINS).astype(np.int64))  # `Calibration.bin`
    accept = np.array(rates.rates())[bins]  # [N] (the root's unused)
    reach = [1.0] * len(nodes)
    for row, (parent, a) in enumerate(zip(up.tolist(), accept[1:].tolist()), 1):  # a parent's row before its children's
        reach[row] = reach[parent] * a
    # summed over each row's verified children, in row order
    taken, mass = (np.bincount(up, weights=x[1:], minlength=len(nodes)) for x in (accept, confidences))  # [N] each
    scale = np.array(reach) * np.maximum(0.0, 1.0 - taken)  # [N]
    weights = scale[:, None] * probs / np.maximum(REST_FLOOR, 1.0 - mass)[:, None]  # [N, k]
    child_tokens = np.array([tree.tokens[n] for n in nodes[1:]], dtype=np.int64)  # [N - 1]
    verified = np.zeros(tokens.shape, dtype=bool)  # [N, k]: a verified child's token is no bonus
    np.logical_or.at(verified, up, tokens[up] == child_tokens[:, None])
    order = np.argsort(np.where(verified, np.inf, -weights), axis=None, kind="stable")[: min(count, int((~verified).sum()))]
    at, rank = np.divmod(order, tokens.shape[1])
    return list(zip(weights[at, rank].tolist(), np.asarray(nodes)[at].tolist(), tokens[at, rank].tolist()))


GROWN_TOGETHER_SLACK = 1.25  # a merged level of the first trees may cost this much more than one tree's level


def grown_together(rows: list[int], seconds: list[float], width: int, trees: int) -> int:
    """How many of the likeliest trees drafting ahead grows together first: the most (up to `trees`) whose merged
    level of `width` rows each costs at most GROWN_TOGETHER_SLACK x one tree's level on the drafter's measured curve
    (`seconds` of a step of `rows` rows; linear between points, beyond the last along its last segment)."""

    def cost(n: int) -> float:
        i = next((i for i, r in enumerate(rows) if r >= n), len(rows) - 1)
        i = max(i, 1)
        r0, r1, s0, s1 = rows[i - 1], rows[i], seconds[i - 1], seconds[i]
        return s0 + (s1 - s0) * (n - r0) / (r1 - r0)

    one = cost(width)
    return max([1] + [n for n in range(2, trees + 1) if cost(n * width) <= GROWN_TOGETHER_SLACK * one])
