"""A served drafter layer (one call of the runtime's scripted blocks over a KV pool) computes what the layer's own
modules compute over a growing KVCache, and refuses to run where its weights would be trained; a drafter in its
target's process multiplies by the target's own packed LM head."""

import pytest
import torch
from tests.helpers.tiny import make_drafter, make_target

from eyas import Engine
from eyas.drafters import load_drafter
from eyas.drafters.layers import KVCache, ServedLayer
from eyas.proposer import DraftModel
from eyas.runtime.batch import RowsCall
from eyas.runtime.kv import PassThroughKV
from eyas.target import TargetModel


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target"))


def layer_of(drafter) -> ServedLayer:
    (layer,) = [m for m in drafter.modules() if isinstance(m, ServedLayer)]
    return layer


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_served_layer_computes_what_its_modules_compute(kind, target_dir, tmp_path):
    drafter_dir = make_drafter(tmp_path / kind, target_dir, kind)
    target = TargetModel.from_pretrained(target_dir)
    eager, _ = load_drafter(drafter_dir, target.embed, target.lm_head)
    model = DraftModel(load_drafter(drafter_dir, target.embed, target.lm_head)[0], kv_slots=1, max_seq_len=64)
    assert layer_of(model.drafter).served is not None and layer_of(eager).served is None
    generator = torch.Generator().manual_seed(0)
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
            model.run([RowsCall(slot, prefix, tokens[prefix:], torch.arange(prefix, prefix + rows), tree, states[prefix:])])[0].states,
        ]
        cache = KVCache()
        positions = torch.arange(prefix + rows)[None]
        expected = [
            eager.step(states[None, :prefix], tokens[None, :prefix], positions[:, :prefix], cache, causal[None, None, :prefix, :prefix])[0],
            eager.step(states[None, prefix:], tokens[None, prefix:], positions[:, prefix:], cache, tree[None, None])[0],
        ]
    for got, want in zip(served, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_served_layer_refuses_to_run_where_its_weights_would_be_trained(target_dir, tmp_path):
    drafter_dir = make_drafter(tmp_path / "eagle1", target_dir, "eagle1")
    target = TargetModel.from_pretrained(target_dir)
    model = DraftModel(load_drafter(drafter_dir, target.embed, target.lm_head)[0], kv_slots=1, max_seq_len=64)
    layer = layer_of(model.drafter)
    x = torch.randn(1, 2, model.drafter.hidden_size)
    rope = model.drafter.rotary(torch.arange(2)[None], x.dtype)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool).tril()
    for p in layer.parameters():
        p.requires_grad_(True)  # as training would: the served copies would not follow its updates
    with torch.enable_grad(), pytest.raises(RuntimeError, match="for inference"):
        layer(x, rope, PassThroughKV(), mask)
    with torch.no_grad():
        assert layer(x, rope, PassThroughKV(), mask).shape == x.shape


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
