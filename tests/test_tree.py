"""EAGLE-2 tree contract (docs/tree.md): knobs, validation errors, ancestor-closed selection, flatten invariants."""

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.tree import DraftTree, TreeError, TreePolicy, flatten, flatten_many, validate_tree
from eyas.treerows import ancestry, leaf_paths


@pytest.mark.parametrize(
    "knobs, field",
    [
        ({"width": 0}, "tree.width"),
        ({"width": 2.0}, "tree.width"),
        ({"top_k": 4}, "tree.top_k"),
        ({"depth": -1}, "tree.depth"),
        ({"budget": -3}, "tree.budget"),
        ({"budget": 1.5}, "tree.budget"),
        ({"breadth": 3}, "tree.breadth"),
        ({"stop": -0.1}, "tree.stop"),
        ({"stop": 1.0}, "tree.stop"),
        ({"stop": math.nan}, "tree.stop"),
        ({"stop": "0.1"}, "tree.stop"),
        ({"stop": True}, "tree.stop"),
    ],
)
def test_bad_knobs_are_refused_by_name(knobs, field):
    with pytest.raises(TreeError) as err:
        TreePolicy.from_dict(knobs)
    assert err.value.field == field


def test_the_official_knobs_map_to_one_more_level_and_one_fewer_candidate():
    """The official code's depth=5, top_k=10, total_token=60 drafts 6 levels and verifies 60 rows, the root among them
    (docs/tree.md#the-official-knobs): grown level by level as eyas grows it, the policy's tree has exactly that."""
    policy = TreePolicy.from_official(depth=5, top_k=10, total_token=60)
    assert policy == TreePolicy(width=10, depth=6, budget=59)
    tree = DraftTree(root_token=0)
    for _ in range(policy.depth):
        expanded = tree.expandable(policy.width)
        tree.add_children(expanded, [(n, t, 0.9 if t == 0 else 0.01) for n in expanded for t in range(policy.width)])
    flat = flatten(tree, tree.select(policy.budget), prefix_len=0)
    assert (flat.num_rows, int(flat.depths.max())) == (60, 6)


def test_knobs_are_separate():
    policy = TreePolicy.from_dict({"width": 3, "depth": 7, "budget": 11})
    assert (policy.width, policy.depth, policy.budget, policy.stop) == (3, 7, 11, 0.0)
    assert TreePolicy.from_dict({"width": 1, "depth": 8, "budget": 8, "stop": 0.25}).stop == 0.25


def test_a_floor_keeps_only_the_best_nodes_whose_value_reaches_it():
    tree = DraftTree(0)
    a, b, c = tree.add_children([0], [(0, 1, 0.5), (0, 2, 0.3), (0, 3, 0.1)])
    assert tree.expandable(2) == [a, b]
    assert tree.expandable(2, stop=0.3) == [a, b]  # a value equal to the floor is expanded
    assert tree.expandable(3, stop=0.31) == [a]
    assert tree.expandable(3, stop=0.6) == []
    (a1,) = tree.add_children([a], [(a, 4, 0.5)])  # value 0.25
    assert tree.expandable(1, stop=0.2) == [a1] and tree.best_of([a1, b, c], 3, stop=0.2) == [b, a1]


@pytest.mark.parametrize(
    "children, field",
    [
        ([(0, 1, math.nan)], "confidence"),
        ([(0, 1, math.inf)], "confidence"),
        ([(0, 1, -0.1)], "confidence"),
        ([(0, 1, 1.5)], "confidence"),
        ([(0, 1, 0.3), (0, 1, 0.2)], "token"),
        ([(0, 1, 0.7), (0, 2, 0.4)], "confidence"),
        ([(5, 1, 0.3)], "parent"),
    ],
)
def test_expansion_records_are_validated_and_leave_the_tree_unchanged(children, field):
    tree = DraftTree(root_token=0)
    with pytest.raises(TreeError) as err:
        tree.add_children([0], children)
    assert err.value.field == field
    assert len(tree) == 1 and tree.frontier == [0]


def test_child_of_a_node_outside_the_expanded_frontier_is_refused():
    tree = DraftTree(root_token=0)
    a, b = tree.add_children([0], [(0, 1, 0.5), (0, 2, 0.5)])
    with pytest.raises(TreeError) as err:
        tree.add_children([a], [(b, 3, 0.5)])
    assert err.value.field == "parent"


def test_tie_rule_prefers_the_shallower_node_then_the_earlier_one():
    tree = DraftTree(root_token=0)
    (a,) = tree.add_children([0], [(0, 1, 1.0)])
    (a1,) = tree.add_children([a], [(a, 2, 1.0)])
    assert tree.select(1) == [a]
    assert tree.select(2) == [a, a1]


def test_log_space_values_do_not_underflow_on_long_paths():
    tree = DraftTree(root_token=0)
    frontier = [0]
    for depth in range(400):
        frontier = tree.add_children(frontier, [(frontier[0], depth + 1, 0.1)])
    assert tree.log_values[-1] == pytest.approx(400 * math.log(0.1))
    assert tree.select(400)[-1] == len(tree) - 1


@st.composite
def random_trees(draw):
    """A random expansion history with valid confidences, plus knobs."""
    top_k = draw(st.integers(1, 4))
    depth = draw(st.integers(0, 4))
    budget = draw(st.integers(0, 20))
    tree = DraftTree(root_token=0)
    expanded = [0]
    for level in range(depth):
        if level:
            expanded = tree.expandable(top_k)
        children = []
        for parent in expanded:
            weights = draw(st.lists(st.floats(0, 1), min_size=top_k, max_size=top_k))
            total = max(sum(weights), 1.0)
            tokens = draw(st.lists(st.integers(0, 50), min_size=top_k, max_size=top_k, unique=True))
            children += [(parent, t, w / total) for t, w in zip(tokens, weights)]
        tree.add_children(expanded, children)
    return tree, budget, draw(st.integers(0, 100))


@settings(max_examples=150, deadline=None)
@given(random_trees())
def test_any_valid_expansion_gives_an_ancestor_closed_tree_within_budget(case):
    tree, budget, prefix = case
    selected = tree.select(budget)
    assert len(selected) <= budget
    chosen = set(selected)
    for node in selected:
        assert tree.parents[node] == 0 or tree.parents[node] in chosen
    flat = flatten(tree, selected, prefix_len=prefix)
    validate_tree(flat, vocab_size=51, prefix_len=prefix, budget=budget)
    parents = flat.parents.tolist()
    # mask = ancestry closure
    for i in range(flat.num_rows):
        ancestors = set(flat.path_to(i))
        assert {j for j in range(flat.num_rows) if flat.mask[i, j]} == ancestors
    # positions = prefix + depth
    assert flat.positions.tolist() == [prefix + d for d in flat.depths.tolist()]
    # retrieve paths are legal root-to-leaf chains covering every leaf once
    leaves = set(range(flat.num_rows)) - set(parents)
    ends = []
    for path in flat.retrieve.tolist():
        path = [r for r in path if r >= 0]
        assert path[0] == 0
        assert all(parents[c] == p for p, c in zip(path, path[1:]))
        ends.append(path[-1])
    assert sorted(ends) == sorted(leaves)


def _flat():
    tree = DraftTree(root_token=3)
    a, b = tree.add_children([0], [(0, 4, 0.6), (0, 5, 0.3)])
    tree.add_children([a], [(a, 6, 0.9)])
    return flatten(tree, tree.select(3), prefix_len=10)


@pytest.mark.parametrize(
    "corrupt, field",
    [
        (lambda t: t.parents.__setitem__(2, 3), "tree.parents"),  # parent after child
        (lambda t: t.parents.__setitem__(1, 1), "tree.parents"),  # self-cycle
        (lambda t: t.parents.__setitem__(0, 2), "tree.parents"),  # root with a parent
        (lambda t: t.mask.__setitem__((2, 1), False), "tree.mask"),
        (lambda t: t.mask.__setitem__((1, 3), True), "tree.mask"),
        (lambda t: t.positions.__setitem__(2, 99), "tree.positions"),
        (lambda t: t.depths.__setitem__(2, 5), "tree.depths"),
        (lambda t: t.tokens.__setitem__(1, 1000), "tree.tokens"),
        (lambda t: t.tokens.__setitem__(3, -1), "tree.tokens"),
        (lambda t: t.draft_probs.__setitem__(1, math.nan), "tree.draft_probs"),
        (lambda t: t.retrieve.__setitem__((0, 1), 3), "tree.retrieve"),
    ],
)
def test_malformed_flattened_trees_are_refused_by_field(corrupt, field):
    flat = _flat()
    validate_tree(flat, vocab_size=100, prefix_len=10, budget=3)
    corrupt(flat)
    with pytest.raises(TreeError) as err:
        validate_tree(flat, vocab_size=100, prefix_len=10, budget=3)
    assert err.value.field == field


def test_over_budget_and_wrong_prefix_are_refused():
    flat = _flat()
    with pytest.raises(TreeError) as err:
        validate_tree(flat, vocab_size=100, prefix_len=10, budget=2)
    assert err.value.field == "tree.tokens"
    with pytest.raises(TreeError) as err:
        validate_tree(flat, vocab_size=100, prefix_len=11)
    assert err.value.field == "tree.prefix_len"


def test_a_chain_flattens_to_a_lower_triangle_and_one_path():
    tree = DraftTree(5)
    for token in (6, 7, 8):
        tree.add_children(tree.frontier, [(tree.frontier[0], token, 0.5)])
    flat = flatten(tree, [1, 2, 3], prefix_len=4)
    assert torch.equal(flat.mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert flat.retrieve.tolist() == [[0, 1, 2, 3]]


def test_trees_flattened_together_have_the_masks_and_paths_the_receipt_check_rebuilds():
    """`flatten_many` reads masks and leaf paths off each row's ancestors for many trees at once: each tree's are the
    ones the receipt check rebuilds row by row, whatever the other trees' shapes."""
    rng = random.Random(0)
    trees = []
    for _ in range(20):
        parents = [-1] + [rng.randrange(i) for i in range(1, 30)]
        depths = [0]
        for p in parents[1:]:
            depths.append(depths[p] + 1)
        trees.append((parents, depths))
    as_array = lambda i: np.asarray([t[i] for t in trees])
    n = len(trees[0][0])
    flats = flatten_many(np.zeros((len(trees), n), np.int64), as_array(0), as_array(1), np.ones((len(trees), n)),
                         np.tile(np.arange(n), (len(trees), 1)), [3] * len(trees))
    for (parents, depths), flat in zip(trees, flats):
        assert flat.mask.tolist() == ancestry(parents)
        assert flat.retrieve.tolist() == leaf_paths(parents)
        assert flat.parents.tolist() == parents
        assert flat.positions.tolist() == [3 + d for d in depths]
