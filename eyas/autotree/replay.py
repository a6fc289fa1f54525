"""Replaying smaller policies on a round's recorded nodes."""

from __future__ import annotations

from ..outcomes import Calibration, children_of
from ..tree import DraftTree, TreePolicy
from .grid import EXPLORE


class Replay:
    """One round's recorded nodes, replayed for any policy whose tree they hold (docs/autotree.md).

    accept[node]: the chance a verified node is accepted given its parent was; an unverified node counts its bin's
    rate in `rates` (`Calibration.rates`), or 0 without them.
    """

    def __init__(self, tree: DraftTree, accept: dict[int, float], rates: list[float] | None = None):
        self.tree = tree
        self.accept = accept
        self.rates = rates
        self.children = children_of(tree, list(range(len(tree))))
        for kids in self.children.values():
            kids.sort(key=lambda n: -tree.confidences[n])
        self._expansions: dict[tuple[int, int, float], tuple[list[float], int, list[tuple[int, int, float]], int]] = {}

    def expected(self, policy: TreePolicy) -> float:
        """Expected accepted draft tokens had `policy` drafted this round."""
        by_budget, _, _, _ = self._expansion(policy)
        return by_budget[self._verified(policy)]

    def by_depth(self, policy: TreePolicy) -> list[float]:
        """`expected(policy)` split by depth: [D] the expected accepted nodes at depths 1 .. D (D = EXPLORE.depth)."""
        _, _, ranked, _ = self._expansion(policy)
        sums = [0.0] * EXPLORE.depth
        for _, depth, value in ranked[: self._verified(policy)]:
            sums[depth - 1] += value
        return sums

    def levels(self, policy: TreePolicy) -> list[tuple[float, float]]:
        """[D] per depth k, had `policy` drafted this round: (chance the accepted path reaches a node at depth k - 1
        with a verified child, chance it reaches depth k)."""
        _, _, ranked, _ = self._expansion(policy)
        selected = ranked[: self._verified(policy)]
        parents = {self.tree.parents[node] for node, _, _ in selected}
        reached = [1.0 if 0 in parents else 0.0] + [0.0] * (EXPLORE.depth - 1)
        for node, depth, value in selected:
            if node in parents and depth < EXPLORE.depth:
                reached[depth] += value
        return list(zip(reached, self.by_depth(policy)))

    def drafted(self, policy: TreePolicy) -> tuple[int, int]:
        """The levels `policy` would have drafted this round and the rows it would have verified (root included)."""
        _, levels, _, _ = self._expansion(policy)
        return levels, self._verified(policy) + 1

    def exact(self, policy: TreePolicy) -> bool:
        """Whether every node `policy` would have drafted and verified is recorded here with its acceptance (decided by
        the drafter's confidences alone, never by what the target accepted)."""
        _, _, _, exact = self._expansion(policy)
        return self._verified(policy) <= exact

    def _verified(self, policy: TreePolicy) -> int:
        """The nodes `policy` would have verified this round: its budget, or every node its expansion recorded."""
        by_budget, _, _, _ = self._expansion(policy)
        return min(policy.budget, len(by_budget) - 1)

    def _expansion(self, policy: TreePolicy) -> tuple[list[float], int, list[tuple[int, int, float]], int]:
        key = (policy.width, policy.depth, policy.stop)
        if key not in self._expansions:
            self._expansions[key] = self._replay(*key)
        return self._expansions[key]

    def _acceptance(self, node: int) -> float:
        probability = self.accept.get(node)
        if probability is not None:
            return probability
        return self.rates[Calibration.bin(self.tree.confidences[node])] if self.rates else 0.0

    def _replay(self, width: int, depth: int, stop: float) -> tuple[list[float], int, list[tuple[int, int, float]], int]:
        """The (width, depth, stop) expansion: [b] expected accepted tokens of its best b nodes, the levels it drafts,
        its nodes' (node, depth, chance on the accepted path) best first, and the largest budget known exactly."""
        tree = self.tree
        frontier, recorded, levels, short = [0], [], 0, []
        for _ in range(depth):
            expanded = tree.best_of(frontier, width, stop)
            if not expanded:
                break
            levels += 1
            short += [n for n in expanded if len(self.children.get(n, ())) < width]  # this tree expanded it less
            frontier = [c for n in expanded for c in self.children.get(n, [])[:width]]
            recorded += frontier
        on_path = {0: 1.0}
        by_budget = [0.0]
        ranked = []
        exact = -1 if short else None  # with nodes it would have recorded missing, no budget of it is known here
        for rank, node in enumerate(tree.ranked(recorded)):  # every prefix of the global order is ancestor-closed
            if exact is None and node not in self.accept:
                exact = rank  # the first node whose acceptance is unknown
            on_path[node] = on_path[tree.parents[node]] * self._acceptance(node)
            by_budget.append(by_budget[-1] + on_path[node])
            ranked.append((node, tree.depths[node], on_path[node]))
        return by_budget, levels, ranked, len(ranked) if exact is None else exact


def expected_accepted(tree: DraftTree, accept: dict[int, float], policy: TreePolicy) -> float:
    """Expected accepted draft tokens had `policy` drafted this round: replay its expansion on the recorded nodes."""
    return Replay(tree, accept).expected(policy)
