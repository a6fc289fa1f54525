"""A flattened tree and an acceptance decision as plain Python values, their receipt checks, and their wire decoding.

This is the part of the tree contract (docs/tree.md) that needs no tensors: the checks every tree and decision
pass where they cross a trust boundary, written once over lists. The engine runs them on `FlattenedTree.rows()`;
trace tools (show, diff, check) run them on recorded messages without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import WireError
from .v1 import round_pb2 as pb
from .v1 import tensor_pb2 as tpb

# wire dtype name -> the little-endian numpy type of its bytes (bfloat16 travels as its int16 bit pattern), the same
# type in native order, and the value type the bytes are viewed as (None: kept as the bit pattern)
WIRE_ARRAYS = {
    name: (np.dtype(little), np.dtype(little).newbyteorder("="), value)
    for name, little, value in (
        ("bool", "<u1", np.bool_), ("int32", "<i4", None), ("int64", "<i8", None), ("float16", "<i2", None),
        ("bfloat16", "<i2", None), ("float32", "<i4", np.float32), ("float64", "<i8", np.float64),
    )
}


class TreeError(ValueError):
    """A tree knob, expansion record or flattened tree breaks a contract; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class AcceptanceDecision:
    """Accepted flat rows (root first, one root-to-node path), their tokens after the root, and the frontier token.

    `frontier_prob` is the target probability of the frontier token at the last accepted row.
    `token_probs[i]` is the target probability of row i's token under its parent row's distribution (1 for the
    root), so a recorded round shows how much the target liked every node it was offered. A sampled decision
    used the noise of positions `tree.positions[accepted_rows] + 1` of the request's seed, nothing else.
    """

    accepted_rows: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    frontier_token: int
    frontier_prob: float
    token_probs: tuple[float, ...] = ()

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted this round (the root is not a draft)."""
        return len(self.accepted_tokens)


@dataclass(frozen=True)
class TreeRows:
    """The fields of a FlattenedTree as lists (or numpy arrays, `FlattenedTree.arrays`): tokens/parents/depths/
    positions/draft_probs [N], mask [N][N], retrieve [L][max_depth + 1]."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    positions: list[int]
    mask: list[list[bool]]
    retrieve: list[list[int]]
    draft_probs: list[float]
    prefix_len: int

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    def children(self, row: int) -> list[int]:
        return children(self.parents, self.draft_probs, row)

    def path_to(self, row: int) -> list[int]:
        return path_to(self.parents, row)


def children(parents: list[int], draft_probs: list[float], row: int) -> list[int]:
    """Child rows of `row`, most confident first (ties: lower row first): the order verification tries them."""
    return sorted((r for r, p in enumerate(parents) if p == row), key=lambda r: (-draft_probs[r], r))


def path_to(parents: list[int], row: int) -> list[int]:
    """Rows from the root to `row` inclusive."""
    path = [row]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def ancestry(parents: list[int]) -> list[list[bool]]:
    """[N][N]: row i sees row j iff j is i or an ancestor of i; parents must precede children."""
    mask: list[list[bool]] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise TreeError("parents", f"row {i} has parent {p}: parents must precede children")
        row = list(mask[p]) if p >= 0 else [False] * len(parents)
        row[i] = True
        mask.append(row)
    return mask


def leaf_paths(parents: list[int]) -> list[list[int]]:
    """[L][max_depth + 1] root-to-leaf row paths (leaves in row order), padded with -1; parents must precede children."""
    paths: list[list[int]] = []  # each row's path: its parent's, then itself
    for i, p in enumerate(parents):
        paths.append(paths[p] + [i] if p >= 0 else [i])
    is_parent = set(parents)
    leaves = [path for i, path in enumerate(paths) if i not in is_parent]
    width = max(map(len, leaves), default=0)
    return [path + [-1] * (width - len(path)) for path in leaves]


def check_fit(num_rows: int, root: int | None, *, budget: int | None = None, root_token: int | None = None) -> None:
    """The cheap checks of a tree against what its requester asked: the root row exists, carries `root_token`,
    and at most `budget` candidate rows follow it; raises `TreeError` naming the field."""
    if num_rows < 1:
        raise TreeError("tokens", "a tree has at least the root row")
    if budget is not None and num_rows - 1 > budget:
        raise TreeError("tokens", f"{num_rows - 1} candidate rows exceed the verify budget {budget}")
    if root_token is not None and root != root_token:
        raise TreeError("tokens", f"root row token {root} is not the append-required token {root_token}")


def check_tree(
    tree: TreeRows,
    *,
    vocab_size: int,
    prefix_len: int | None = None,
    budget: int | None = None,
    root_token: int | None = None,
) -> None:
    """Receipt check of a flattened tree (its structure, and `check_fit`); raises `TreeError` naming the first broken field."""
    n = tree.num_rows
    check_fit(n, tree.tokens[0] if n else None, budget=budget, root_token=root_token)
    for name in ("parents", "depths", "positions", "draft_probs"):
        if len(getattr(tree, name)) != n:
            raise TreeError(name, f"shape ({len(getattr(tree, name))},) does not match {n} rows")
    if len(tree.mask) != n or any(len(row) != n for row in tree.mask):
        raise TreeError("mask", f"shape is not [{n}, {n}]")
    tokens, parents = tree.tokens, tree.parents
    if any(not 0 <= t < vocab_size for t in tokens):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise TreeError("tokens", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
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
    expected_depths = [0]
    for i in range(1, n):
        expected_depths.append(expected_depths[parents[i]] + 1)
    if tree.depths != expected_depths:
        raise TreeError("depths", "depths do not equal the parent depth plus one")
    prefix = tree.prefix_len if prefix_len is None else prefix_len
    if tree.prefix_len != prefix:
        raise TreeError("prefix_len", f"tree built on prefix {tree.prefix_len}, committed prefix is {prefix}")
    if tree.positions != [prefix + d for d in expected_depths]:
        raise TreeError("positions", f"positions must equal prefix length {prefix} plus depth")
    if tree.mask != ancestry(parents):  # bools compare equal to the 0/1 a mask may hold
        raise TreeError("mask", "mask is not the ancestry closure of parents")
    if any(not math.isfinite(p) or not 0.0 <= p <= 1.0 for p in tree.draft_probs):
        raise TreeError("draft_probs", "draft probabilities must be finite and in [0, 1]")
    if tree.retrieve != leaf_paths(parents):
        raise TreeError("retrieve", "retrieve map is not the list of root-to-leaf paths")


def check_decision(decision: AcceptanceDecision, tree: TreeRows, vocab_size: int) -> None:
    """Receipt check of a decision against the tree it decides: one root-to-node path, its tokens, the frontier."""
    rows = list(decision.accepted_rows)
    if not rows or rows[0] != 0 or any(not 0 <= r < tree.num_rows for r in rows):
        raise WireError("decision.accepted_rows", f"{rows} is not a path of the tree's {tree.num_rows} rows")
    if any(tree.parents[child] != parent for parent, child in zip(rows, rows[1:])):
        raise WireError("decision.accepted_rows", f"{rows} is not a root-to-node path")
    if list(decision.accepted_tokens) != [tree.tokens[r] for r in rows[1:]]:
        raise WireError("decision.accepted_tokens", "tokens do not match the tree rows of the accepted path")
    if not 0 <= decision.frontier_token < vocab_size:
        raise WireError("decision.frontier_token", f"{decision.frontier_token} is outside the vocabulary [0, {vocab_size})")
    if not 0.0 <= decision.frontier_prob <= 1.0:
        raise WireError("decision.frontier_prob", f"{decision.frontier_prob} is not a probability")
    if decision.token_probs and len(decision.token_probs) != tree.num_rows:
        raise WireError("decision.token_probs", f"{len(decision.token_probs)} values for {tree.num_rows} rows")
    if any(not 0.0 <= p <= 1.0 for p in decision.token_probs):
        raise WireError("decision.token_probs", "values must be probabilities")


def array_from_proto(msg: tpb.Tensor, field: str, dtypes: tuple[str, ...], ndim: int) -> np.ndarray:
    """Decode a tensor field to a native-order numpy array of its bit pattern's integer type for the 16-bit floats
    and of its value type otherwise, refusing a dtype outside `dtypes`, a rank other than `ndim`, or a wrong byte count."""
    if msg.dtype not in dtypes:
        raise WireError(f"{field}.dtype", f"{msg.dtype!r} is not one of {list(dtypes)}")
    shape = tuple(msg.shape)
    if len(shape) != ndim or any(d < 0 for d in shape):
        raise WireError(f"{field}.shape", f"{list(shape)} is not a valid rank-{ndim} shape")
    little, native, value = WIRE_ARRAYS[msg.dtype]
    expected = math.prod(shape) * little.itemsize
    data = msg.data  # each read of a bytes field copies it
    if len(data) != expected:
        raise WireError(f"{field}.data", f"{len(data)} bytes for shape {list(shape)} of {msg.dtype} ({expected} expected)")
    array = np.frombuffer(data, dtype=little).astype(native)  # a writable copy in native order
    if value is np.bool_ and array.size and array.max() > 1:
        raise WireError(f"{field}.data", "bool tensors hold only the bytes 0 and 1")
    if value is not None:
        array = array.view(value)
    return array.reshape(shape)


def rows_from_proto(msg: pb.FlattenedTree) -> TreeRows:
    """Decode a tree's fields as lists; its structure is checked separately with `check_tree`."""
    ints = ("int64",)
    return TreeRows(
        tokens=array_from_proto(msg.tokens, "tree.tokens", ints, 1).tolist(),
        parents=array_from_proto(msg.parents, "tree.parents", ints, 1).tolist(),
        depths=array_from_proto(msg.depths, "tree.depths", ints, 1).tolist(),
        positions=array_from_proto(msg.positions, "tree.positions", ints, 1).tolist(),
        mask=array_from_proto(msg.mask, "tree.mask", ("bool",), 2).tolist(),
        retrieve=array_from_proto(msg.retrieve, "tree.retrieve", ints, 2).tolist(),
        draft_probs=array_from_proto(msg.draft_probs, "tree.draft_probs", ("float64",), 1).tolist(),
        prefix_len=msg.prefix_len,
    )


def decision_from_proto(d: pb.AcceptanceDecision) -> AcceptanceDecision:
    """The decision's fields (its accepted features are decoded separately, against the feature width)."""
    return AcceptanceDecision(
        accepted_rows=tuple(d.accepted_rows),
        accepted_tokens=tuple(d.accepted_tokens),
        frontier_token=d.frontier_token,
        frontier_prob=d.frontier_prob,
        token_probs=tuple(d.token_probs),
    )
