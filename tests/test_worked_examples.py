"""The executable fixtures of docs/round.md and docs/rows.md: row plan, loss weighting, tree budget, publication."""

import pytest
import torch

from eyas.publish import publish
from eyas.request import RequestState, StopRules
from eyas.sampling import SamplingParams
from eyas.target import TargetModel, TargetSession
from eyas.train.losses import eagle1_objective
from eyas.train.rows import compile_rows, gather_rows
from eyas.tree import DraftTree, flatten
from eyas.verify import AcceptanceDecision


def test_row_fixture_four_soft_three_hard_rows():
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 0]])
    plan = compile_rows(valid, torch.zeros_like(tokens), torch.arange(6)[None], torch.ones_like(tokens))
    assert plan.num_soft == 4
    assert plan.num_hard == 3
    assert plan.source[0, :4].tolist() == [0, 1, 2, 3]
    features = torch.arange(6, dtype=torch.float)[None, :, None] * 10  # f_t = 10 t
    rows = gather_rows(plan, tokens, features)
    # first row: f_0 + token 12 -> f_1 (+ q_2); last soft row: f_3 + token 15 -> f_4 (+ q_5)
    assert (rows["source_feature"][0, 0, 0].item(), rows["advanced_token"][0, 0].item()) == (0.0, 12)
    assert rows["target_feature"][0, 0, 0].item() == 10.0
    assert (rows["source_feature"][0, 3, 0].item(), rows["advanced_token"][0, 3].item()) == (30.0, 15)
    assert rows["target_feature"][0, 3, 0].item() == 40.0
    # token slot 5 is invalid and never read as a hard label
    assert rows["hard_label"][0].tolist() == [13, 14, 15, -100]


def test_loss_fixture_weights_regression_one_and_classification_point_one():
    assert eagle1_objective(0.6, 2.4) == pytest.approx(0.84)


def test_tree_fixture_budget_four_selects_a_a1_b_b1():
    tree = DraftTree(root_token=0)
    a, b = tree.add_children([0], [(0, 1, 0.60), (0, 2, 0.40)])
    tree.add_children([a, b], [(a, 11, 0.80), (a, 12, 0.20), (b, 21, 0.95)])
    values = {tree.tokens[n]: round(float(torch.tensor(tree.log_values[n]).exp()), 4) for n in range(1, len(tree))}
    assert values == {1: 0.60, 2: 0.40, 11: 0.48, 12: 0.12, 21: 0.38}
    selected = tree.select(4)
    assert [tree.tokens[n] for n in selected] == [1, 11, 2, 21]  # A, A1, B, B1 (not breadth-first A2)
    flat = flatten(tree, selected, prefix_len=7)
    assert flat.tokens.tolist() == [0, 1, 11, 2, 21]
    assert flat.parents.tolist() == [-1, 0, 1, 0, 3]  # ancestor-closed without repair


def test_publication_fixture_rows_0_2_and_append_required_frontier(tmp_path):
    from tests.helpers.tiny import make_target

    target = TargetModel.from_pretrained(make_target(tmp_path / "t"))
    session = TargetSession(target)
    session.prefill(0, [5, 6, 7])
    # root 8 with two children: row 1 (token 9) and row 2 (token 10)
    tree = DraftTree(8)
    tree.add_children([0], [(0, 9, 0.5), (0, 10, 0.4)])
    flat = flatten(tree, tree.select(2), prefix_len=3)
    session.verify(flat, 0, SamplingParams())
    verified = session.model.pool.kv[:, :, session.slot, :, : 3 + flat.num_rows].clone()  # [L, 2, KVH, rows, hd]

    decision = AcceptanceDecision(accepted_rows=(0, 2), accepted_tokens=(10,), frontier_token=42, frontier_prob=1.0)
    request = RequestState("r", [4, 5, 6, 7, 8], SamplingParams(), StopRules(16))
    reseeded = []

    class DraftSide:
        def reseed(self, version, features, tokens):
            reseeded.append((version, features.shape[0], tokens))

    emitted = publish(request, decision, torch.zeros(2, target.feature_width), session, DraftSide())
    assert emitted == [10, 42]
    assert request.root_token == 42  # frontier emitted, marked target-append-required
    assert session.committed == 3 + 2 and session.version == 1
    kept = session.model.pool.kv[:, :, session.slot, :, : session.committed]
    assert torch.equal(kept, verified[:, :, :, [0, 1, 2, 3, 5]])  # prefix + flat rows [0, 2]
    assert reseeded == [(0, 2, [10, 42])]
