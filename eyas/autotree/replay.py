"""Replaying smaller policies on a round's recorded nodes."""

from __future__ import annotations

from ..outcomes import Calibration, children_of
from ..tree import DraftTree, TreePolicy
from .grid import EXPLORE


class Replay:
    """One explored round, prepared for replaying many policies on its recorded nodes.

    accept[node]: probability the node is accepted given its parent was (verified nodes). A node left unverified
    counts its rate under `rates` (`Calibration.rates`, frozen when the round was explored), or 0 without them.
    The children of every node are kept in the drafter's own top-k order, and each (width, depth, stop) expansion
    is replayed once: its nodes in global order give the expected accepted tokens of every budget as a prefix sum.
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
        """[D] for each depth k, had `policy` drafted this round: (the chance the accepted path reaches a node at depth
        k - 1 that has a verified child, the chance it reaches depth k). Their ratio is the acceptance at depth k of
        the policy's own tree, what `LevelCorrection` sets its rounds beside."""
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
        """Whether this round scores `policy` exactly, with no calibrated rate: every node its expansion would have
        drafted and verified is recorded here with its acceptance. A chosen round does so for a policy whose tree its
        own holds (a narrower, shallower, smaller one, or the same). Whether it does depends on the drafter's
        confidences alone, never on what the target accepted: keeping only the rounds whose accepted path did not
        reach a missing node would keep the rounds that went badly."""
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
        """[b] expected accepted tokens of the best b nodes the (width, depth, stop) expansion records, b = 0 .. all;
        the levels it drafts (fewer than `depth` where it stops); the recorded nodes' (node, depth, chance to be on
        the accepted path), best first; and the largest budget it scores exactly (`exact`)."""
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
