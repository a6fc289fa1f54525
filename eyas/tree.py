"""EAGLE-2 dynamic draft trees (design reference 0x06) and their flattened form.

`DraftTree` records expansion results with the reference's validation rules;
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

    top_k: int = 8
    depth: int = 5
    budget: int = 32

    def __post_init__(self) -> None:
        if type(self.top_k) is not int or self.top_k < 1:
            raise TreeError("top_k", f"expansion width must be a positive integer, got {self.top_k!r}")
        for name in ("depth", "budget"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise TreeError(name, f"must be a nonnegative integer, got {value!r}")

    @classmethod
    def from_dict(cls, spec: dict | "TreePolicy" | None) -> "TreePolicy":
        """Build a policy from a `{"top_k", "depth", "budget"}` mapping, refusing unknown keys."""
        if spec is None:
            return cls()
        if isinstance(spec, TreePolicy):
            return spec
        unknown = set(spec) - {"top_k", "depth", "budget"}
        if unknown:
            raise TreeError(sorted(unknown)[0], "unknown tree knob (expected top_k, depth, budget)")
        return cls(**spec)


class DraftTree:
    """Expansion records of one round: node 0 is the root; every other node has a parent, token and confidence."""

    def __init__(self, root_token: int):
        self.tokens = [int(root_token)]
        self.parents = [-1]
        self.depths = [0]
        self.confidences = [1.0]
        self.log_values = [0.0]
        self.frontier: list[int] = [0]

    def __len__(self) -> int:
        return len(self.tokens)

    def rank_key(self, node: int) -> tuple[float, int, int]:
        """Global order: higher path value first, then shallower, then earlier node id (0x06A tie rule)."""
        return (-self.log_values[node], self.depths[node], node)

    def expandable(self, width: int) -> list[int]:
        """The `width` highest-value nodes of the latest frontier: the ones the drafter expands next."""
        return sorted(self.frontier, key=self.rank_key)[:width]

    def add_children(self, expanded: list[int], children: list[tuple[int, int, float]]) -> list[int]:
        """Record `(parent, token, confidence)` children of the `expanded` nodes; they become the new frontier.

        Validates all records before storing any, so a rejected expansion leaves the tree unchanged.
        """
        allowed = set(expanded)
        seen: set[tuple[int, int]] = set()
        mass: dict[int, float] = {}
        for parent, token, confidence in children:
            if parent not in allowed:
                raise TreeError("parent", f"node {parent} is not in the expanded frontier {sorted(allowed)}")
            if not math.isfinite(confidence) or not 0.0 <= confidence <= 1.0:
                raise TreeError("confidence", f"must be a finite probability, got {confidence!r}")
            if (parent, token) in seen:
                raise TreeError("token", f"duplicate token {token} under parent node {parent}")
            seen.add((parent, token))
            mass[parent] = mass.get(parent, 0.0) + confidence
            if mass[parent] > 1.0 + MASS_SLACK:
                raise TreeError("confidence", f"sibling probability mass under node {parent} exceeds one")
        added = []
        for parent, token, confidence in children:
            added.append(len(self.tokens))
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.confidences.append(float(confidence))
            self.log_values.append(self.log_values[parent] + math.log(max(confidence, LOG_FLOOR)))
        self.frontier = added
        return added

    def select(self, budget: int) -> list[int]:
        """The best `budget` non-root nodes in global order; every prefix of that order is ancestor-closed."""
        return sorted(range(1, len(self.tokens)), key=self.rank_key)[:budget]


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
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def retrieve_paths(parents: list[int]) -> torch.Tensor:
    """[L, max_depth + 1] root-to-leaf row paths (leaves in row order), padded with -1."""
    has_child = set(parents)
    leaves = [i for i in range(len(parents)) if i not in has_child]
    paths = []
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    width = max(len(p) for p in paths)
    return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)


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


def validate_tree(
    tree: FlattenedTree,
    *,
    vocab_size: int,
    prefix_len: int | None = None,
    budget: int | None = None,
    root_token: int | None = None,
) -> None:
    """Receipt check of a flattened tree; raises `TreeError` naming the first broken field."""
    n = tree.num_rows
    if n < 1:
        raise TreeError("tokens", "a tree has at least the root row")
    for name in ("parents", "depths", "positions", "draft_probs"):
        if tuple(getattr(tree, name).shape) != (n,):
            raise TreeError(name, f"shape {tuple(getattr(tree, name).shape)} does not match {n} rows")
    if tuple(tree.mask.shape) != (n, n):
        raise TreeError("mask", f"shape {tuple(tree.mask.shape)} is not [{n}, {n}]")
    if budget is not None and n - 1 > budget:
        raise TreeError("tokens", f"{n - 1} candidate rows exceed the verify budget {budget}")
    tokens = tree.tokens.tolist()
    if any(not 0 <= t < vocab_size for t in tokens):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise TreeError("tokens", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if root_token is not None and tokens[0] != root_token:
        raise TreeError("tokens", f"root row token {tokens[0]} is not the append-required token {root_token}")
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
