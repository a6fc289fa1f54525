"""EAGLE-2 dynamic draft trees (docs/tree.md) and their flattened form.

`DraftTree` records expansion results with the receipt rules of docs/tree.md#growing;
`DraftTree.select` reranks to an ancestor-closed verify budget; `flatten` turns a
selection into the rows the target verifies; `validate_tree` is the receipt check
every consumer of a `FlattenedTree` runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TREE_ABI_VERSION = 1
LOG_FLOOR = 1e-12  # ranking floor for log(confidence); the stored probability is never changed
MASS_SLACK = 1e-12  # sibling probabilities may sum to one plus rounding, not more


class TreeError(ValueError):
    """A tree knob, expansion record or flattened tree breaks a contract; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class TreePolicy:
    """The three separate EAGLE-2 knobs: expansion width, maximum depth, verify budget.

    `budget` counts candidate nodes; the root (last committed token) is verified on top of it.
    """

    width: int = 8
    depth: int = 5
    budget: int = 32

    def __post_init__(self) -> None:
        if type(self.width) is not int or self.width < 1:
            raise TreeError("width", f"expansion width must be a positive integer, got {self.width!r}")
        for name in ("depth", "budget"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise TreeError(name, f"must be a nonnegative integer, got {value!r}")

    @classmethod
    def from_dict(cls, spec: dict | "TreePolicy" | None) -> "TreePolicy":
        """Build a policy from a `{"width", "depth", "budget"}` mapping, refusing unknown keys (and the old name
        `top_k`, which now means only sampling top-k)."""
        if spec is None:
            return cls()
        if isinstance(spec, TreePolicy):
            return spec
        if "top_k" in spec:
            raise TreeError("top_k", "the tree's expansion width is now called width (top_k is sampling top-k only)")
        unknown = set(spec) - {"width", "depth", "budget"}
        if unknown:
            raise TreeError(sorted(unknown)[0], "unknown tree knob (expected width, depth, budget)")
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

    def ranked(self, nodes: list[int]) -> list[int]:
        """`nodes` in global order: higher path value first, then shallower, then earlier id (docs/tree.md#ranking)."""
        values = torch.tensor([self.log_values[n] for n in nodes], dtype=torch.float64)
        order = torch.argsort(-values, stable=True)
        return [nodes[i] for i in order.tolist()]

    def expandable(self, width: int) -> list[int]:
        """The `width` highest-value nodes of the latest frontier: the ones the drafter expands next."""
        return self.ranked(self.frontier)[:width]

    def add_children(self, expanded: list[int], children: list[tuple[int, int, float]]) -> list[int]:
        """Record `(parent, token, confidence)` children of the `expanded` nodes; they become the new frontier."""
        if not children:
            return self.add_expansion(expanded, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), torch.empty(0))
        parents, tokens, confidences = zip(*children)
        return self.add_expansion(
            expanded,
            torch.tensor(parents, dtype=torch.long),
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(confidences, dtype=torch.float64),
        )

    def add_expansion(
        self, expanded: list[int], parents: torch.Tensor, tokens: torch.Tensor, confidences: torch.Tensor
    ) -> list[int]:
        """Vectorised `add_children`: parents, tokens, confidences [n]. All records are validated before any
        is stored, so a rejected expansion leaves the tree unchanged."""
        outside = sorted(set(expanded) - set(self.frontier))
        if outside:
            raise TreeError("parent", f"expanded node {outside[0]} is not in the latest frontier")
        stray = ~torch.isin(parents, torch.tensor(expanded, dtype=torch.long))
        if stray.any():
            raise TreeError("parent", f"node {int(parents[stray][0])} is not in the expanded frontier {sorted(expanded)}")
        c = confidences.to(torch.float64)
        bad = ~torch.isfinite(c) | (c < 0) | (c > 1)
        if bad.any():
            raise TreeError("confidence", f"must be a finite probability, got {float(c[bad][0])!r}")
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
        parent_list = parents.tolist()
        log_values = torch.tensor([self.log_values[p] for p in parent_list], dtype=torch.float64)
        log_values += torch.log(c.clamp(min=LOG_FLOOR))
        added = list(range(len(self), len(self) + len(parent_list)))
        self.tokens += tokens.tolist()
        self.parents += parent_list
        self.depths += [self.depths[p] + 1 for p in parent_list]
        self.confidences += c.tolist()
        self.log_values += log_values.tolist()
        self.frontier = added
        return added

    def select(self, budget: int) -> list[int]:
        """The best `budget` non-root nodes in global order; every prefix of that order is ancestor-closed."""
        return self.ranked(list(range(1, len(self))))[:budget]


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

    def children(self, row: int) -> list[int]:
        """Child rows of `row`, most confident first (ties: lower row first): the order verification tries them."""
        rows = (self.parents == row).nonzero().flatten().tolist()
        probs = self.draft_probs.tolist()
        return sorted(rows, key=lambda r: (-probs[r], r))

    def path_to(self, row: int) -> list[int]:
        """Rows from the root to `row` inclusive."""
        path = [row]
        parents = self.parents.tolist()
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]


def ancestry_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: row i sees row j iff j is i or an ancestor of i (parents precede children)."""
    n = len(parents)
    up = torch.tensor(parents, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool)
    rows = torch.arange(n)
    current = up.clone()
    while (current >= 0).any():  # pointer jumping: one tree level per pass
        live = current >= 0
        mask[rows[live], current[live]] = True
        current = torch.where(live, up[current.clamp(min=0)], -1)
    return mask


def retrieve_paths(parents: list[int]) -> torch.Tensor:
    """[L, max_depth + 1] root-to-leaf row paths (leaves in row order), padded with -1."""
    up = torch.tensor(parents, dtype=torch.long)
    n = len(parents)
    is_parent = torch.zeros(n, dtype=torch.bool)
    is_parent[up[up >= 0]] = True
    leaves = (~is_parent).nonzero().flatten()
    depth = ancestry_mask(parents).sum(dim=1) - 1  # [N]
    paths = torch.full((len(leaves), int(depth.max()) + 1), -1, dtype=torch.long)
    current = leaves.clone()
    line = torch.arange(len(leaves))
    while (current >= 0).any():
        live = current >= 0
        paths[line[live], depth[current[live]]] = current[live]
        current = torch.where(live, up[current.clamp(min=0)], -1)
    return paths


def flatten(tree: DraftTree, selected: list[int], prefix_len: int) -> FlattenedTree:
    """Flatten the root plus `selected` nodes (in selection order) into verification rows."""
    row_of = {0: 0}
    for node in selected:
        if tree.parents[node] not in row_of:
            raise TreeError("parents", f"selected node {node} comes before its parent {tree.parents[node]}")
        row_of[node] = len(row_of)
    nodes = [0, *selected]
    parents = [-1] + [row_of[tree.parents[n]] for n in selected]
    depths = torch.tensor([tree.depths[n] for n in nodes], dtype=torch.long)
    return FlattenedTree(
        tokens=torch.tensor([tree.tokens[n] for n in nodes], dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=depths,
        positions=depths + prefix_len,
        mask=ancestry_mask(parents),
        retrieve=retrieve_paths(parents),
        draft_probs=torch.tensor([tree.confidences[n] for n in nodes], dtype=torch.float64),
        prefix_len=prefix_len,
    )


def check_fit(tree: FlattenedTree, *, budget: int | None = None, root_token: int | None = None) -> None:
    """The cheap checks of a tree against what its requester asked: the root row exists, carries `root_token`,
    and at most `budget` candidate rows follow it; raises `TreeError` naming the field."""
    n = tree.num_rows
    if n < 1:
        raise TreeError("tokens", "a tree has at least the root row")
    if budget is not None and n - 1 > budget:
        raise TreeError("tokens", f"{n - 1} candidate rows exceed the verify budget {budget}")
    if root_token is not None and int(tree.tokens[0]) != root_token:
        raise TreeError("tokens", f"root row token {int(tree.tokens[0])} is not the append-required token {root_token}")


def validate_tree(
    tree: FlattenedTree,
    *,
    vocab_size: int,
    prefix_len: int | None = None,
    budget: int | None = None,
    root_token: int | None = None,
) -> None:
    """Receipt check of a flattened tree (its structure, and `check_fit`); raises `TreeError` naming the first broken field.

    Run once where a tree crosses a trust boundary before it is verified (a target worker, a trace replay).
    """
    check_fit(tree, budget=budget, root_token=root_token)
    n = tree.num_rows
    for name in ("parents", "depths", "positions", "draft_probs"):
        if tuple(getattr(tree, name).shape) != (n,):
            raise TreeError(name, f"shape {tuple(getattr(tree, name).shape)} does not match {n} rows")
    if tuple(tree.mask.shape) != (n, n):
        raise TreeError("mask", f"shape {tuple(tree.mask.shape)} is not [{n}, {n}]")
    tokens = tree.tokens.tolist()
    if any(not 0 <= t < vocab_size for t in tokens):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise TreeError("tokens", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    parents = tree.parents.tolist()
    if parents[0] != -1:
        raise TreeError("parents", "row 0 is the root and has parent -1")
    for i in range(1, n):
        if not 0 <= parents[i] < i:
            raise TreeError("parents", f"row {i} has parent {parents[i]}: parents must precede children")
    siblings = set()
    for i in range(1, n):
        if (parents[i], tokens[i]) in siblings:
            raise TreeError("tokens", f"row {i} repeats token {tokens[i]} under parent row {parents[i]}")
        siblings.add((parents[i], tokens[i]))
    depths = tree.depths.tolist()
    expected_depths = [0]
    for i in range(1, n):
        expected_depths.append(expected_depths[parents[i]] + 1)
    if depths != expected_depths:
        raise TreeError("depths", "depths do not equal the parent depth plus one")
    prefix = tree.prefix_len if prefix_len is None else prefix_len
    if tree.prefix_len != prefix:
        raise TreeError("prefix_len", f"tree built on prefix {tree.prefix_len}, committed prefix is {prefix}")
    if tree.positions.tolist() != [prefix + d for d in depths]:
        raise TreeError("positions", f"positions must equal prefix length {prefix} plus depth")
    if not torch.equal(tree.mask.to(torch.bool), ancestry_mask(parents)):
        raise TreeError("mask", "mask is not the ancestry closure of parents")
    probs = tree.draft_probs.tolist()
    if any(not math.isfinite(p) or not 0.0 <= p <= 1.0 for p in probs):
        raise TreeError("draft_probs", "draft probabilities must be finite and in [0, 1]")
    if not torch.equal(tree.retrieve, retrieve_paths(parents)):
        raise TreeError("retrieve", "retrieve map is not the list of root-to-leaf paths")
