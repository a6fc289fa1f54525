"""EAGLE-2 dynamic draft trees (docs/tree.md) and their flattened form.

`DraftTree` records expansion results with the receipt rules of docs/tree.md#growing;
`DraftTree.select` reranks to an ancestor-closed verify budget; `flatten` turns a
selection into the rows the target verifies; `validate_tree` is the receipt check
every consumer of a `FlattenedTree` runs (written over lists in `eyas.treerows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from .errors import renamed
from .treerows import TreeError, TreeRows, check_tree, children, path_to

TREE_ABI_VERSION = 1
LOG_FLOOR = 1e-12  # ranking floor for log(confidence); the stored probability is never changed
MASS_SLACK = 1e-12  # sibling probabilities may sum to one plus rounding, not more


def log_values(confidences: np.ndarray) -> np.ndarray:
    """The ranking value each confidence adds to its path: log of it, floored at LOG_FLOOR (one function for every
    tree, so that trees grown apart rank their nodes alike to the bit)."""
    return np.log(np.maximum(confidences, LOG_FLOOR))


@dataclass(frozen=True)
class TreePolicy:
    """The EAGLE-2 knobs: expansion width, maximum depth, verify budget, and a floor on the path value of the nodes
    expanded.

    `budget` counts candidate nodes; the root (last committed token) is verified on top of it. `stop` (0 <= stop < 1)
    ends a round's drafting early: a node is expanded only while its path value (the product of the drafter's
    probabilities from the root) is at least `stop`, and a round whose frontier has no such node drafts no further
    (docs/tree.md#stopping). 0 drafts every level up to `depth`. Errors name a knob as `tree.<knob>`.
    """

    width: int = 8
    depth: int = 5
    budget: int = 32
    stop: float = 0.0

    def __post_init__(self) -> None:
        if type(self.width) is not int or self.width < 1:
            raise TreeError("tree.width", f"expansion width must be a positive integer, got {self.width!r}")
        for name in ("depth", "budget"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise TreeError(f"tree.{name}", f"must be a nonnegative integer, got {value!r}")
        if type(self.stop) not in (int, float) or not 0.0 <= self.stop < 1.0:  # NaN fails the comparison too
            raise TreeError("tree.stop", f"must be a number in [0, 1), got {self.stop!r}")

    @classmethod
    def from_official(cls, depth: int, top_k: int, total_token: int) -> "TreePolicy":
        """The policy drafting the tree of the official EAGLE-2 code's knobs (docs/tree.md#the-official-knobs): its
        `depth` counts the levels after the first, its `total_token` the root too."""
        return cls(width=top_k, depth=depth + 1, budget=total_token - 1)

    @classmethod
    def from_dict(cls, spec: dict | "TreePolicy" | None) -> "TreePolicy":
        """Build a policy from a `{"width", "depth", "budget", "stop"}` mapping (`stop` may be left out), refusing
        unknown keys (and the old name `top_k`, which now means only sampling top-k)."""
        if spec is None:
            return cls()
        if isinstance(spec, TreePolicy):
            return spec
        if "top_k" in spec:
            raise TreeError("tree.top_k", "the tree's expansion width is now called width (top_k is sampling top-k only)")
        unknown = set(spec) - {"width", "depth", "budget", "stop"}
        if unknown:
            raise TreeError(f"tree.{sorted(unknown)[0]}", "unknown tree knob (expected width, depth, budget, stop)")
        return cls(**spec)


class DraftTree:
    """Expansion records of one round: node 0 is the root; every other node has a parent, token and confidence.

    Nodes are added one frontier at a time, so node ids never decrease with depth: a stable sort by
    path value alone then realises the full tie rule (higher value, then shallower, then earlier id).
    """

    def __init__(self, root_token: int):
        self.tokens = [int(root_token)]
        self.parents = [-1]
        self.depths = [0]
        self.confidences = [1.0]
        self.log_values = [0.0]
        self.frontier: list[int] = [0]

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_records(cls, tokens: list[int], parents: list[int], confidences: list[float]) -> "DraftTree":
        """The tree its records describe (node 0 the root, every parent before its children), ids kept: what a
        proposal's records rebuild on the coordinator for `tree: auto`. Records that form no such tree raise
        `TreeError` naming the field."""
        if not tokens or len(parents) != len(tokens) or len(confidences) != len(tokens):
            raise TreeError("tokens", f"{len(tokens)} tokens for {len(parents)} parents and {len(confidences)} confidences")
        if parents[0] != -1:
            raise TreeError("parents", f"node 0 is the root, with parent -1, not {parents[0]}")
        tree = cls(tokens[0])
        for node in range(1, len(tokens)):
            parent, token, q = int(parents[node]), int(tokens[node]), float(confidences[node])
            if not 0 <= parent < node:
                raise TreeError("parents", f"node {node} has parent {parent}, not an earlier node")
            if token < 0:
                raise TreeError("tokens", f"node {node} has the negative token id {token}")
            if not (math.isfinite(q) and 0.0 <= q <= 1.0):
                raise TreeError("confidences", f"node {node} has confidence {q!r}, not a probability")
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.depths.append(tree.depths[parent] + 1)
            tree.confidences.append(q)
        for parent, value in zip(tree.parents[1:], log_values(np.asarray(tree.confidences[1:])).tolist()):
            tree.log_values.append(tree.log_values[parent] + value)
        tree.frontier = []
        return tree

    def ranked(self, nodes: list[int]) -> list[int]:
        """`nodes` in global order: higher path value first, then shallower, then earlier id (docs/tree.md#ranking)."""
        values = self.log_values
        return sorted(nodes, key=lambda n: -values[n])  # stable: equal values keep their given order

    def expandable(self, width: int, stop: float = 0.0) -> list[int]:
        """The nodes the drafter expands next: `best_of` the latest frontier."""
        return self.best_of(self.frontier, width, stop)

    def best_of(self, nodes: list[int], width: int, stop: float = 0.0) -> list[int]:
        """The `width` highest-value `nodes` whose path value is at least `stop` (TreePolicy.stop), best first."""
        best = self.ranked(nodes)[:width]
        if stop <= 0.0:
            return best
        floor = math.log(stop)
        return [n for n in best if self.log_values[n] >= floor]

    def add_children(self, expanded: list[int], children: list[tuple[int, int, float]]) -> list[int]:
        """Record `(parent, token, confidence)` children of the `expanded` nodes; they become the new frontier."""
        parents, tokens, confidences = zip(*children) if children else ((), (), ())
        return self.add_expansion(expanded, list(parents), list(tokens), list(confidences))

    def add_expansion(
        self,
        expanded: list[int],
        parents: Sequence[int] | torch.Tensor,
        tokens: Sequence[int] | torch.Tensor,
        confidences: Sequence[float] | torch.Tensor,
        top_k: bool = False,
    ) -> list[int]:
        """Record a frontier of children at once: parents, tokens, confidences [n] (lists or tensors). All records
        are validated before any is stored, so a rejected expansion leaves the tree unchanged. `top_k`: the records
        are a drafter's top-k of each expanded node in order (distinct tokens, at most one unit of mass under each
        parent by construction), so only the confidences are checked, in plain Python: a round grows its tree a
        level at a time, a few records each, where tensor checks cost more than the records."""
        outside = sorted(set(expanded) - set(self.frontier))
        if outside:
            raise TreeError("parent", f"expanded node {outside[0]} is not in the latest frontier")
        parent_list, token_list, q_list = (x.tolist() if isinstance(x, torch.Tensor) else list(x) for x in (parents, tokens, confidences))
        q_list = [float(q) for q in q_list]
        bad = next((q for q in q_list if not 0.0 <= q <= 1.0), None)  # NaN and infinities fail the comparison too
        if bad is not None:
            raise TreeError("confidence", f"must be a finite probability, got {bad!r}")
        if not top_k:
            self._check_records(
                expanded,
                torch.tensor(parent_list, dtype=torch.long),
                torch.tensor(token_list, dtype=torch.long),
                torch.tensor(q_list, dtype=torch.float64),
            )
        values = [self.log_values[p] + value for p, value in zip(parent_list, log_values(np.asarray(q_list, dtype=np.float64)).tolist())]
        added = list(range(len(self), len(self) + len(parent_list)))
        self.tokens += [int(t) for t in token_list]
        self.parents += parent_list
        self.depths += [self.depths[p] + 1 for p in parent_list]
        self.confidences += q_list
        self.log_values += values
        self.frontier = added
        return added

    def _check_records(self, expanded: list[int], parents: torch.Tensor, tokens: torch.Tensor, c: torch.Tensor) -> None:
        """Parents in the expanded frontier, nonnegative distinct tokens per parent, sibling mass at most one."""
        stray = ~torch.isin(parents, torch.tensor(expanded, dtype=torch.long))
        if stray.any():
            raise TreeError("parent", f"node {int(parents[stray][0])} is not in the expanded frontier {sorted(expanded)}")
        if (tokens < 0).any():
            raise TreeError("token", f"token id {int(tokens[tokens < 0][0])} is negative")
        width = int(tokens.max()) + 1 if len(tokens) else 1
        keys = torch.sort(parents * width + tokens).values  # one key per (parent, token) pair
        repeated = keys[1:] == keys[:-1]
        if repeated.any():
            key = int(keys[1:][repeated][0])
            raise TreeError("token", f"duplicate token {key % width} under parent node {key // width}")
        mass = torch.zeros(len(self), dtype=torch.float64).index_add_(0, parents, c)
        if (mass > 1.0 + MASS_SLACK).any():
            parent = int((mass > 1.0 + MASS_SLACK).nonzero()[0])
            raise TreeError("confidence", f"sibling probability mass under node {parent} exceeds one")

    def select(self, budget: int) -> list[int]:
        """The best `budget` non-root nodes in global order; every prefix of that order is ancestor-closed."""
        return self.ranked(list(range(1, len(self))))[:budget]


class RecordedTree(DraftTree):
    """A tree grown by `add_expansion`'s rules elsewhere (a forest's arrays, `DraftSession._grow_forest`): its records
    [n] as they would stand here, read out as lists when first asked for (most trees of a forest never are)."""

    def __init__(
        self, tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, confidences: np.ndarray, log_values: np.ndarray,
        frontier: list[int],
    ):
        self.records = (tokens, parents, depths, confidences, log_values)
        self.frontier = frontier

    tokens = cached_property(lambda self: self.records[0].tolist())
    parents = cached_property(lambda self: self.records[1].tolist())
    depths = cached_property(lambda self: self.records[2].tolist())
    confidences = cached_property(lambda self: self.records[3].tolist())
    log_values = cached_property(lambda self: self.records[4].tolist())


ARRAY_FIELDS = ("tokens", "parents", "depths", "positions", "mask", "retrieve", "draft_probs")  # TreeRows' order


@dataclass
class FlattenedTree:
    """The rows one verification runs: row 0 is the root (the last committed token, target-append-required).

    tokens/parents/depths/positions: [N]; mask: [N, N] ancestry closure including the diagonal;
    retrieve: [L, max_depth + 1] root-to-leaf row paths padded with -1; draft_probs: [N] conditional
    draft confidence of each node (1 for the root).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    retrieve: torch.Tensor
    draft_probs: torch.Tensor
    prefix_len: int

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self) -> TreeRows:
        """The same tree as plain lists, for the receipt checks and tools that need no tensors."""
        return TreeRows(*(getattr(self, name).tolist() for name in ARRAY_FIELDS), self.prefix_len)

    def arrays(self) -> TreeRows:
        """The same tree as numpy views of its tensors (no copy), for a receipt check that reads a few rows of it."""
        return TreeRows(*(getattr(self, name).cpu().numpy() for name in ARRAY_FIELDS), self.prefix_len)

    def children(self, row: int) -> list[int]:
        """Child rows of `row`, most confident first (ties: lower row first): the order verification tries them."""
        return children(self.parents.tolist(), self.draft_probs.tolist(), row)

    def path_to(self, row: int) -> list[int]:
        """Rows from the root to `row` inclusive."""
        return path_to(self.parents.tolist(), row)


def flatten(tree: DraftTree, selected: list[int], prefix_len: int) -> FlattenedTree:
    """Flatten the root plus `selected` nodes (in selection order) into verification rows."""
    row_of = {0: 0}
    for node in selected:
        if tree.parents[node] not in row_of:
            raise TreeError("parents", f"selected node {node} comes before its parent {tree.parents[node]}")
        row_of[node] = len(row_of)
    nodes = [0, *selected]
    rows = [[tree.tokens[n] for n in nodes], [-1] + [row_of[tree.parents[n]] for n in selected], [tree.depths[n] for n in nodes]]
    tokens, parents, depths = (np.asarray([r], dtype=np.int64) for r in rows)
    return flattened(tokens, parents, depths, np.asarray([[tree.confidences[n] for n in nodes]]), [prefix_len])[0]


def flatten_many(
    tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, confidences: np.ndarray, nodes: np.ndarray, prefix_lens: list[int]
) -> list[FlattenedTree]:
    """`flatten` for several trees at once: their records [T, N] (parent -1 at the root) and each one's rows `nodes`
    [T, R] (the root, then an ancestor-closed selection in order)."""
    tree = np.arange(nodes.shape[0])[:, None]
    row_of = np.full(tokens.shape, -1, dtype=np.int64)
    row_of[tree, nodes] = np.arange(nodes.shape[1])
    row_parents = row_of[tree, parents[tree, nodes]]  # [T, R]
    row_parents[:, 0] = -1
    return flattened(tokens[tree, nodes], row_parents, depths[tree, nodes], confidences[tree, nodes], prefix_lens)


def flattened(
    tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, confidences: np.ndarray, prefix_lens: list[int]
) -> list[FlattenedTree]:
    """The verification rows of trees already laid out in rows [T, R] (tokens, parent rows with -1 at the root,
    depths, draft probabilities), their masks and leaf paths read off each row's ancestors, for all of them at once."""
    n_trees, n_rows = tokens.shape
    parents, depths = parents.astype(np.int64), depths.astype(np.int64)
    # each row's k-th ancestor for k = 0..max depth (the root its own parent), as rows of the trees laid end to end
    depth = int(depths.max(initial=0))
    first = np.arange(n_trees)[:, None] * n_rows  # [T, 1]: each tree's first row, end to end
    up = (np.where(parents >= 0, parents, 0) + first).ravel()  # [T * R]
    ancestor = np.empty((depth + 1, n_trees * n_rows), dtype=np.int64)
    ancestor[0] = np.arange(n_trees * n_rows)
    for k in range(depth):
        ancestor[k + 1] = up[ancestor[k]]
    local = ancestor - first.repeat(n_rows)  # [D + 1, T * R]: within its tree
    # a row's path is its ancestors: the ancestry closure with the diagonal, and the root-to-row path by depth
    mask = np.zeros((n_trees, n_rows, n_rows), dtype=np.bool_)
    mask.reshape(-1)[ancestor[0] * n_rows + local] = True
    paths = np.full((n_trees, n_rows, depth + 1), -1, dtype=np.int64)
    paths.reshape(-1)[ancestor[0] * (depth + 1) + depths.reshape(-1)[ancestor]] = local
    is_parent = np.zeros((n_trees, n_rows), dtype=np.bool_)
    t, r = np.nonzero(parents >= 0)
    is_parent[t, parents[t, r]] = True
    leaf_tree, leaf = np.nonzero(~is_parent)  # tree-major, rows in order
    leaf_paths = paths[leaf_tree, leaf]  # [L, D + 1]
    leaves = np.bincount(leaf_tree, minlength=n_trees).tolist()
    widths = (depths.max(axis=1) + 1).tolist()
    positions = depths + np.asarray(prefix_lens, dtype=np.int64)[:, None]
    tokens, confidences = tokens.astype(np.int64), confidences.astype(np.float64)
    flat, start = [], 0
    for i in range(n_trees):
        flat.append(FlattenedTree(
            tokens=torch.from_numpy(tokens[i]),
            parents=torch.from_numpy(parents[i]),
            depths=torch.from_numpy(depths[i]),
            positions=torch.from_numpy(positions[i]),
            mask=torch.from_numpy(mask[i]),
            retrieve=torch.from_numpy(np.ascontiguousarray(leaf_paths[start : start + leaves[i], : widths[i]])),
            draft_probs=torch.from_numpy(confidences[i]),
            prefix_len=prefix_lens[i],
        ))
        start += leaves[i]
    return flat


def validate_tree(
    tree: FlattenedTree,
    *,
    vocab_size: int,
    prefix_len: int | None = None,
    budget: int | None = None,
    root_token: int | None = None,
) -> None:
    """Receipt check of a flattened tree (`eyas.treerows.check_tree`); raises `TreeError` naming the first broken field.

    Run once where a tree crosses a trust boundary before it is verified (a target worker, a trace replay); fields are
    named as the message carrying the tree spells them (`tree.parents`).
    """
    try:
        check_tree(tree.rows(), vocab_size=vocab_size, prefix_len=prefix_len, budget=budget, root_token=root_token)
    except TreeError as exc:
        raise renamed(exc, f"tree.{exc.field}") from None
