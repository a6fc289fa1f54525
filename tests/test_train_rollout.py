"""Rollout contract (docs/training.md#hass, #eagle-3): training-time steps see exactly what drafting will see.

The mask is checked as a dependency graph, and the rollout's outputs are checked against the
drafter's own tree proposals on the same path.
"""

import pytest
import torch
from tests.helpers.tiny import make_drafter, make_target

from eyas.drafters import load_drafter
from eyas.manifest import FeatureAddress
from eyas.proposer import DraftModel, DraftSession
from eyas.target import TargetModel, TargetSession
from eyas.train.data import segment_causal_mask
from eyas.train.features import teacher_features
from eyas.train.objectives import rollout_states
from eyas.train.rollout import RolloutKV, step_supervised, step_valid
from eyas.train.rows import compile_rows, gather_rows
from eyas.tree import TreePolicy

SEGMENTS = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]


def rollout_mask(plan, step: int) -> torch.Tensor:
    """The rollout's visibility written densely: [B, 1, L, (step + 1) L] over the keys of steps 0..step."""
    b, _, l, _ = plan.mask.shape
    ancestors_and_self = [torch.eye(l, dtype=torch.bool).expand(b, 1, l, l)] * step  # row t at steps 1..step
    return torch.cat([plan.mask, *ancestors_and_self], dim=-1)


def packed_plan():
    segment = torch.tensor([SEGMENTS])
    position = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    return compile_rows(torch.ones(1, 10), segment, position, torch.ones(1, 10))


@pytest.mark.parametrize("step", [0, 1, 2, 3])
def test_rollout_mask_is_the_dependency_graph(step):
    """Query (step s, root row t) sees: the target prefix (step 0, rows <= t in its segment),
    its draft ancestors (row t at steps 1..s-1) and itself; no sibling, future or cross-segment edge."""
    plan = packed_plan()
    rows = int(plan.valid.sum())
    width = plan.mask.shape[-1]
    mask = rollout_mask(plan, step)[0, 0]  # [L, (step + 1) L]
    for t in range(rows):
        seen = {(k // width, k % width) for k in mask[t].nonzero().flatten().tolist()}
        prefix = {
            (0, j)
            for j in range(rows)
            if plan.segment[0, j] == plan.segment[0, t] and plan.position[0, j] <= plan.position[0, t]
        }
        ancestors = {(k, t) for k in range(1, step)}
        own = {(step, t)}
        assert seen == prefix | ancestors | own
        assert not any(k >= 1 and j != t for k, j in seen)  # no sibling edge
        assert not any(k > step for k, _ in seen)  # no future step


def test_rollout_attention_reads_exactly_what_the_dense_mask_shows():
    """RolloutKV's diagonal reading equals attention over every step's keys under the dense mask, for GQA too."""
    plan = packed_plan()
    b, _, l, _ = plan.mask.shape
    generator = torch.Generator().manual_seed(0)
    kv, keys, values = RolloutKV(), [], []
    for step in range(4):
        q = torch.randn(b, 4, l, 8, generator=generator, requires_grad=True)
        k, v = (torch.randn(b, 2, l, 8, generator=generator) for _ in range(2))
        keys.append(k)
        values.append(v)
        got = kv.attend(q, k, v, plan.mask)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=rollout_mask(plan, step), enable_gqa=True
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        (g_got,) = torch.autograd.grad(got.sum(), q)
        (g_want,) = torch.autograd.grad(want.sum(), q)
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


def test_step_validity_follows_the_segment_chain():
    plan = packed_plan()  # rows: t = 0..4 (segment 0) and 6..8 (segment 1)
    assert plan.source[0, :8].tolist() == [0, 1, 2, 3, 4, 6, 7, 8]
    assert step_valid(plan, 2)[0, :8].tolist() == [True, True, True, False, False, True, False, False]
    supervise = torch.ones(1, 10)
    supervise[0, 2] = 0
    plan = compile_rows(torch.ones(1, 10), torch.tensor([SEGMENTS]), torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]]), supervise)
    # step 1 of root row 1 is trained toward row 2's targets, which are unsupervised
    assert step_supervised(plan, 1)[0, :3].tolist() == [True, False, True]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_rollout_outputs_equal_the_drafters_tree_proposals(tmp_path, kind):
    target_dir = make_target(tmp_path / "t")
    address = FeatureAddress.eagle1() if kind == "eagle1" else FeatureAddress.eagle3(4)
    target = TargetModel.from_pretrained(target_dir, address)
    drafter, _ = load_drafter(make_drafter(tmp_path / "d", target_dir, kind), target.embed, target.lm_head)
    with torch.no_grad():  # sharp attention, so that a wrong position or mask changes the output
        for name, p in drafter.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(std=1.0)

    # inference: seed rows 0..t, then a greedy chain of depth 4 from the drafter itself
    prompt = [5, 17, 33, 8, 9, 41, 77]
    t = len(prompt) - 2
    tsession = TargetSession(target)
    features = tsession.prefill(0, prompt[:-1])
    dsession = DraftSession(DraftModel(drafter, 1, target.max_seq_len))
    dsession.start(0, features, prompt[1:])
    assert dsession.committed == len(prompt) - 1 and not dsession.pending_tokens  # the drafter's prefill ran at start
    tree = dsession.propose(0, prompt[-1], TreePolicy(width=1, depth=4, budget=4)).tree
    chain = tree.tokens[1:].tolist()
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]

    # training: the same tokens as one sequence, rolled out 4 steps from root row t
    tokens = torch.tensor([prompt + chain])
    n = tokens.shape[1]
    valid, segment, position = torch.ones(1, n, dtype=torch.bool), torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None]
    feats, _ = teacher_features(target, tokens, position, segment_causal_mask(valid, segment))
    plan = compile_rows(valid, segment, position, torch.ones(1, n))
    rows = gather_rows(plan, tokens, feats)
    with torch.no_grad():
        outs = list(rollout_states(drafter, plan, rows["source_feature"], rows["advanced_token"], 4, detach_state=False))
    for s, out in enumerate(outs):
        probs = torch.softmax(drafter.logits(out[0, t]).double(), -1)
        draft_id = probs.argmax().item()
        assert drafter.to_target_ids(torch.tensor(draft_id)).item() == chain[s]
        assert 0.01 < probs[draft_id].item() < 0.99  # not saturated: the comparison below can see a difference
        assert probs[draft_id].item() == pytest.approx(tree.draft_probs[s + 1].item(), abs=1e-5)
