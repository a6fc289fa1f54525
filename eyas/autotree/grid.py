"""The policies tree auto scores: the exploring trees and the grid of candidates, with their shapes."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..rounds import RoundRecord
from ..tree import TreePolicy


def reachable(width: int, depth: int) -> int:
    """Nodes a (width, depth) expansion records: `width` at depth 1, `width` x `width` at each further depth."""
    return width + (depth - 1) * width * width


EXPLORE = TreePolicy(width=8, depth=8, budget=64)
EXPLORE_CHAIN = TreePolicy(width=1, depth=EXPLORE.depth, budget=EXPLORE.depth)
EXPLORE_NARROW = TreePolicy(width=2, depth=EXPLORE.depth, budget=reachable(2, EXPLORE.depth))  # verifies all it records
EXPLORATIONS = (EXPLORE, EXPLORE_NARROW, EXPLORE_CHAIN)  # in the order exploring rounds take them
TOP_KS = (1, 2, 3, 4, 6, 8)
STOPS = (0.05, 0.1, 0.2, 0.3)  # floors of the chains scored beside fixed depths (TreePolicy.stop, docs/tree.md#stopping)
BUDGETS = (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@functools.cache
def grid() -> tuple[TreePolicy, ...]:
    """Candidate policies: chains of every depth, deep chains stopping at each of STOPS, and every tree of TOP_KS,
    depth and BUDGETS that fits."""
    policies = [TreePolicy(1, d, d) for d in range(1, EXPLORE.depth + 1)]
    policies += [TreePolicy(1, EXPLORE.depth, EXPLORE.depth, stop) for stop in STOPS]
    for k in TOP_KS[1:]:
        for d in range(1, EXPLORE.depth + 1):
            policies += [TreePolicy(k, d, b) for b in BUDGETS if d <= b <= reachable(k, d)]
    return tuple(policies)


@functools.cache
def grid_index() -> dict[TreePolicy, int]:
    """Each grid policy's place in `grid()`."""
    return {policy: i for i, policy in enumerate(grid())}


@functools.cache
def under(policy: TreePolicy) -> tuple[TreePolicy, ...]:
    """Grid policies a round of `policy` may score exactly (`Replay.exact`): no wider, deeper or larger, with a floor
    as high or higher (docs/autotree.md)."""
    return tuple(
        q for q in grid()
        if q.width <= policy.width and q.depth <= policy.depth and q.budget <= policy.budget and q.stop >= policy.stop
    )


class GridArrays(NamedTuple):
    """[len(grid())] each policy's width, depth and full-budget rows, to price the whole grid at once."""

    width: np.ndarray
    depth: np.ndarray
    rows: np.ndarray


@functools.cache
def grid_arrays() -> GridArrays:
    """`grid()` as arrays (built once)."""
    policies = grid()
    return GridArrays(
        np.array([float(p.width) for p in policies]),
        np.array([float(p.depth) for p in policies]),
        np.array([p.budget + 1.0 for p in policies]),
    )


Shape = tuple[float, float]  # a round's drafting levels and verified rows (the root's included)


def full_shape(policy: TreePolicy) -> Shape:
    """The levels and rows of a round that drafts every level of `policy` and verifies its whole budget."""
    return float(policy.depth), float(policy.budget + 1)


def realised_shape(record: RoundRecord) -> Shape:
    """The levels a finished round drafted (its deepest recorded node, else verified row) and the rows it verified."""
    tree = record.draft_tree
    levels = max(tree.depths) if tree is not None else int(record.tree.depths.max()) if record.tree.num_rows else 0
    return float(levels), float(record.tree.num_rows)


def priced_shape(record: RoundRecord, policy: TreePolicy) -> Shape:
    """A finished round's shape as priced: as realised under a floor (its levels vary), else the policy's full shape."""
    return realised_shape(record) if policy.stop else full_shape(policy)
