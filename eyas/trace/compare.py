"""Comparing recorded trees and decisions: the first node where two differ, and by how much probabilities moved.

Tokens and rows must match exactly; probabilities may differ by `tolerance` (0 asks for bit-for-bit).
Shared by replay (recorded against recomputed) and diff (one trace against another).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..treerows import AcceptanceDecision, TreeRows

Label = Callable[[int], str]


@dataclass(frozen=True)
class Difference:
    """What differs, at which tree node (row), and the expected and actual values in words."""

    what: str
    node: int | None
    expected: str
    actual: str

    def __str__(self) -> str:
        where = f"node {self.node}: " if self.node is not None else ""
        return f"{where}{self.what}: expected {self.expected}, actual {self.actual}"


def _gap(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def tree_difference(
    expected: TreeRows, actual: TreeRows, tolerance: float = 0.0, label: Label = str
) -> tuple[Difference | None, float]:
    """The first differing node of two trees (token, parent, draft probability), and the largest probability gap."""
    e_tokens, a_tokens = expected.tokens, actual.tokens
    e_parents, a_parents = expected.parents, actual.parents
    e_probs, a_probs = expected.draft_probs, actual.draft_probs
    gap = _gap(e_probs, a_probs)
    if expected.prefix_len != actual.prefix_len:
        return Difference("tree prefix", None, str(expected.prefix_len), str(actual.prefix_len)), gap
    for row in range(min(len(e_tokens), len(a_tokens))):
        e = f"token {label(e_tokens[row])} under node {e_parents[row]} (draft p {e_probs[row]:.6g})"
        a = f"token {label(a_tokens[row])} under node {a_parents[row]} (draft p {a_probs[row]:.6g})"
        if (e_tokens[row], e_parents[row]) != (a_tokens[row], a_parents[row]):
            return Difference("draft tree", row, e, a), gap
        if abs(e_probs[row] - a_probs[row]) > tolerance:
            return Difference("draft probability", row, e, a), gap
    if len(e_tokens) != len(a_tokens):
        return Difference("draft tree size", min(len(e_tokens), len(a_tokens)), f"{len(e_tokens)} rows", f"{len(a_tokens)} rows"), gap
    return None, gap


def decision_difference(
    tree: TreeRows,
    expected: AcceptanceDecision,
    actual: AcceptanceDecision,
    tolerance: float = 0.0,
    label: Label = str,
) -> tuple[Difference | None, float]:
    """The first difference of two decisions on the same tree, and the largest target probability gap."""
    tokens = tree.tokens
    e_probs, a_probs = list(expected.token_probs), list(actual.token_probs)
    gap = max(_gap(e_probs, a_probs), abs(expected.frontier_prob - actual.frontier_prob))

    def step(decision: AcceptanceDecision, probs: list[float], depth: int) -> str:
        rows = decision.accepted_rows
        if depth < len(rows):
            p = f" (target p {probs[rows[depth]]:.6g})" if rows[depth] < len(probs) else ""
            return f"token {label(tokens[rows[depth]])} accepted at node {rows[depth]}{p}"
        return (
            f"nothing accepted after node {rows[-1]}; frontier token {label(decision.frontier_token)} "
            f"(target p {decision.frontier_prob:.6g})"
        )

    e_rows, a_rows = expected.accepted_rows, actual.accepted_rows
    for depth in range(1, max(len(e_rows), len(a_rows))):
        if depth >= len(e_rows) or depth >= len(a_rows) or e_rows[depth] != a_rows[depth]:
            node = e_rows[depth] if depth < len(e_rows) else a_rows[depth]
            return Difference("accepted path", node, step(expected, e_probs, depth), step(actual, a_probs, depth)), gap
    last = e_rows[-1]
    if expected.frontier_token != actual.frontier_token or abs(expected.frontier_prob - actual.frontier_prob) > tolerance:
        depth = len(e_rows)
        return Difference("frontier token", last, step(expected, e_probs, depth), step(actual, a_probs, depth)), gap
    if len(e_probs) != len(a_probs):
        return Difference("target probabilities", None, f"{len(e_probs)} values", f"{len(a_probs)} values"), gap
    for row, (e, a) in enumerate(zip(e_probs, a_probs)):
        if abs(e - a) > tolerance:
            token = label(tokens[row])
            return Difference("target probability", row, f"token {token} target p {e:.6g}", f"target p {a:.6g}"), gap
    return None, gap
