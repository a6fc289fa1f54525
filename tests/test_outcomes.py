"""Drafting ahead's odds: what a decided round shows of acceptance, and the outcomes it guesses from it."""

import numpy as np
import pytest

from eyas.outcomes import GROWN_TOGETHER_SLACK, Calibration, grown_together, likeliest_outcomes, observed_acceptance
from eyas.tree import DraftTree


def small_tree() -> tuple[DraftTree, list[int]]:
    """root -> a (token 1, q .75), b (token 2, q .2); a -> c (token 3, q .95): every node verified."""
    tree = DraftTree(0)
    a, b = tree.add_children([0], [(0, 1, 0.75), (0, 2, 0.2)])
    (c,) = tree.add_children([a], [(a, 3, 0.95)])
    return tree, [0, a, b, c]


def test_a_decided_round_shows_the_verified_children_of_every_accepted_node():
    tree, nodes = small_tree()
    _, a, b, c = nodes
    assert observed_acceptance(tree, nodes, ()) == {a: 0.0, b: 0.0}  # c's parent was rejected: c shows nothing
    assert observed_acceptance(tree, nodes, (1,)) == {a: 1.0, b: 0.0, c: 0.0}
    assert observed_acceptance(tree, nodes, (1, 3)) == {a: 1.0, b: 0.0, c: 1.0}
    assert observed_acceptance(tree, [0, a, b], (1,)) == {a: 1.0, b: 0.0}  # c unverified: not observed


def chain() -> tuple[DraftTree, list[int], tuple[np.ndarray, np.ndarray]]:
    """root -> a (token 1, q .65) -> c (token 3, q .65), with the drafter's candidates (tokens, probabilities
    [3, 2]) at each node."""
    tree = DraftTree(0)
    (a,) = tree.add_children([0], [(0, 1, 0.65)])
    (c,) = tree.add_children([a], [(a, 3, 0.65)])
    candidates = np.array([[1, 5], [3, 6], [7, 8]]), np.array([[0.65, 0.3], [0.65, 0.3], [0.9, 0.05]])
    return tree, [0, a, c], candidates


def test_with_no_round_seen_outcomes_are_priced_about_at_the_drafters_word():
    """The path's drafter probability times the bonus's: bin mid-points stand in for the nodes' probabilities."""
    tree, nodes, candidates = chain()
    _, a, c = nodes
    outcomes = likeliest_outcomes(tree, nodes, *candidates, Calibration(), 8)
    assert [(n, b) for _, n, b in outcomes] == [(c, 7), (0, 5), (a, 6), (c, 8)]  # verified children are no bonus
    weights = {(n, b): w for w, n, b in outcomes}
    assert weights[c, 7] == pytest.approx(0.65 * 0.65 * 0.9)
    assert weights[0, 5] == pytest.approx(0.3)
    assert weights[a, 6] == pytest.approx(0.65 * 0.3)
    assert len(likeliest_outcomes(tree, nodes, *candidates, Calibration(), 2)) == 2


def test_equally_likely_outcomes_keep_row_then_rank_order():
    """Ties rank by node row, then by the drafter's rank at the node; a verified child's token is never a bonus."""
    tree = DraftTree(0)
    a, b = tree.add_children([0], [(0, 1, 0.25), (0, 2, 0.25)])
    tokens = np.array([[1, 2, 4, 5], [6, 7, 8, 9], [6, 7, 8, 9]])
    probs = np.full((3, 4), 0.25)
    outcomes = likeliest_outcomes(tree, [0, a, b], tokens, probs, Calibration(), 10)
    best = max(w for w, _, _ in outcomes)  # the root's: its path is certain
    assert [(n, t) for w, n, t in outcomes if w == best] == [(0, 4), (0, 5)]
    assert [(n, t) for w, n, t in outcomes if w < best] == [(a, 6), (a, 7), (a, 8), (a, 9), (b, 6), (b, 7), (b, 8), (b, 9)]


def test_guesses_follow_what_the_target_accepted():
    """A drafter whose 0.65 nodes the target always rejects: the root's bonus becomes the likeliest outcome; one
    whose 0.65 nodes it always accepts: outcomes that reject such a node fall to the bottom."""
    tree, nodes, candidates = chain()
    _, a, c = nodes
    rejecting, accepting = Calibration(), Calibration()
    for _ in range(50):
        rejecting.add(tree, {a: 0.0})
        accepting.add(tree, {a: 1.0, c: 1.0})
    assert rejecting.rates()[Calibration.bin(0.65)] < 0.05 and accepting.rates()[Calibration.bin(0.65)] > 0.95
    best, *_ = likeliest_outcomes(tree, nodes, *candidates, rejecting, 8)
    assert best[1:] == (0, 5) and best[0] > 0.8  # the root's other tokens share what the drafter left besides a
    ranked = [(n, b) for _, n, b in likeliest_outcomes(tree, nodes, *candidates, accepting, 8)]
    assert ranked[:2] == [(c, 7), (c, 8)]


def test_later_rounds_weigh_more():
    tree, nodes = small_tree()
    _, a, _, _ = nodes
    calibration = Calibration(decay=0.5)
    calibration.add(tree, {a: 1.0})
    before = calibration.rates()[Calibration.bin(0.75)]
    calibration.add(tree, {a: 0.0})
    after = calibration.rates()[Calibration.bin(0.75)]
    assert after < before
    assert after == pytest.approx((0.5 + Calibration.PRIOR * 0.75) / (1.5 + Calibration.PRIOR))


ROWS = [1, 2, 4, 8, 16, 32, 64]


def test_trees_grow_together_first_as_far_as_a_step_costs_about_one_trees():
    flat = [1e-3] * len(ROWS)  # a device below its knee: a step of 64 rows costs what one of 8 does
    assert grown_together(ROWS, flat, width=8, trees=8) == 8
    assert grown_together(ROWS, flat, width=8, trees=16) == 16  # past the curve: along its last (flat) segment
    linear = [r * 1e-4 for r in ROWS]  # every row pays: the likeliest tree grows alone
    assert grown_together(ROWS, linear, width=8, trees=8) == 1
    knee = [1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 2e-3, 4e-3]  # flat to 16 rows, then linear
    assert grown_together(ROWS, knee, width=8, trees=8) == 2
    slack = [1e-3, 1e-3, 1e-3, 1e-3, GROWN_TOGETHER_SLACK * 1e-3, 2e-3, 4e-3]
    assert grown_together(ROWS, slack, width=8, trees=8) == 2  # at the slack exactly: still together
    assert grown_together(ROWS, flat, width=8, trees=1) == 1
