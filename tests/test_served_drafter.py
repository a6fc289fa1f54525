"""A drafter's served step and candidates (one scripted call each over a KV pool, eyas.proposer.ServedStep) compute
what the drafter's own modules compute over a growing KVCache; a drafter in its target's process multiplies by the
target's own packed LM head."""

import pytest
import torch
from tests.helpers.tiny import make_drafter, make_target

from eyas import Engine
from eyas.drafters import load_drafter
from eyas.drafters.layers import KVCache
from eyas.proposer import DraftModel
from eyas.runtime.batch import RowsCall
from eyas.target import TargetModel


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target"))


@pytest.mark.parametrize("kind, draft_vocab", [("eagle1", None), ("eagle3", None), ("eagle3", 32)])
def test_a_served_step_computes_what_the_drafters_modules_compute(kind, draft_vocab, target_dir, tmp_path):
    overrides = {"draft_vocab_size": draft_vocab} if draft_vocab else {}
    drafter_dir = make_drafter(tmp_path / kind, target_dir, kind, **overrides)
    target = TargetModel.from_pretrained(target_dir)
    eager, served_drafter = (load_drafter(drafter_dir, target.embed, target.lm_head)[0] for _ in range(2))
    generator = torch.Generator().manual_seed(0)
    if draft_vocab:  # a reduced draft vocabulary: candidates come back as target ids
        draft_to_target = torch.randperm(target.vocab_size, generator=generator)[:draft_vocab]
        for drafter in (eager, served_drafter):
            drafter.set_vocab_map(draft_to_target, target.vocab_size)
    model = DraftModel(served_drafter, kv_slots=1, max_seq_len=64)
    prefix, rows = 10, 3
    tokens = torch.randint(0, 96, (prefix + rows,), generator=generator)
    states = torch.randn(prefix + rows, eager.hidden_size, generator=generator)
    causal = torch.ones(prefix + rows, prefix + rows, dtype=torch.bool).tril()
    tree = causal[prefix:].clone()
    tree[:, prefix:] = torch.eye(rows, dtype=torch.bool)  # three siblings: each sees the prefix and itself
    slot = model.pool.acquire(prefix + rows)
    with torch.no_grad():
        served = [
            model.run([RowsCall(slot, 0, tokens[:prefix], torch.arange(prefix), causal[:prefix, :prefix], states[:prefix])])[0].states,
            model.run([RowsCall(slot, prefix, tokens[prefix:], torch.arange(prefix, prefix + rows), tree, states[prefix:], top_k=4)])[0],
        ]
        served, candidates = [served[0], served[1].states], served[1]
        cache = KVCache()
        positions = torch.arange(prefix + rows)[None]
        expected = [
            eager.step(states[None, :prefix], tokens[None, :prefix], positions[:, :prefix], cache, causal[None, None, :prefix, :prefix])[0],
            eager.step(states[None, prefix:], tokens[None, prefix:], positions[:, prefix:], cache, tree[None, None])[0],
        ]
        probs = torch.softmax(eager.logits(expected[1]).double(), dim=-1)  # [rows, V_draft]
    for got, want in zip(served, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the top-k candidates: the likeliest draft ids, mapped to target ids, with their probabilities
    top = probs.topk(4, dim=-1)
    assert torch.equal(candidates.tokens, eager.to_target_ids(top.indices))
    torch.testing.assert_close(candidates.probs, top.values, rtol=1e-5, atol=1e-6)


def test_a_drafter_in_its_targets_process_shares_the_targets_packed_head(target_dir, tmp_path):
    drafter_dir = make_drafter(tmp_path / "eagle1", target_dir, "eagle1")
    engine = Engine.from_pretrained(target_dir, drafter_dir, tree={"width": 1, "depth": 2, "budget": 2}, draft_dtype="float32")
    assert engine.target.head.packed is not None  # a CPU, float32: there is a packed copy to share
    assert engine.draft.drafter.target_head.linear is engine.target.head
    # a drafter in another dtype binds a copy in its own, and the target's stays as it was
    half = Engine.from_pretrained(target_dir, drafter_dir, tree={"width": 1, "depth": 2, "budget": 2}, draft_dtype="bfloat16")
    head = half.draft.drafter.target_head.linear
    assert head is not half.target.head and head.weight.dtype == torch.bfloat16 and half.target.head.weight.dtype == torch.float32
    assert torch.equal(head.weight, half.target.head.weight.to(torch.bfloat16)) and half.draft.drafter.embed.weight.dtype == torch.bfloat16
    # a head over other storage (another load of the same target) is not shared: the drafter makes its own copy
    target, other = TargetModel.from_pretrained(target_dir), TargetModel.from_pretrained(target_dir)
    model = DraftModel(load_drafter(drafter_dir, target.embed, target.lm_head)[0], kv_slots=1, max_seq_len=64, target_head=other.head)
    own = model.drafter.target_head.linear
    assert own is not other.head and torch.equal(own.weight, other.head.weight)
