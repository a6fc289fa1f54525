"""Drafter checkpoints in the official EAGLE layouts: exact key sets, round trips, and every refusal."""

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.tiny import make_drafter, make_target

from eyas import Engine
from eyas.drafters import CheckpointError, Eagle3Drafter, load_drafter, save_drafter
from eyas.drafters.checkpoint import same_up_to_rounding
from eyas.target import TargetModel

EAGLE1_KEYS = {
    "fc.weight",
    "fc.bias",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}
EAGLE3_KEYS = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("ckpt") / "target")


@pytest.fixture(scope="module")
def target(target_dir):
    return TargetModel.from_pretrained(target_dir)


def weights_of(directory):
    return load_file(str(directory / "model.safetensors"))


def rewrite(directory, weights):
    save_file(weights, str(directory / "model.safetensors"))


def test_saved_layouts_have_exactly_the_official_keys(tmp_path, target_dir):
    assert set(weights_of(make_drafter(tmp_path / "e1", target_dir, "eagle1"))) == EAGLE1_KEYS
    e3 = make_drafter(tmp_path / "e3", target_dir, "eagle3")
    assert set(weights_of(e3)) == EAGLE3_KEYS
    config = json.loads((e3 / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 96
    assert weights_of(e3)["fc.weight"].shape == (64, 3 * 64)
    assert weights_of(e3)["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_save_load_round_trip_is_exact(tmp_path, target_dir, target, kind):
    first = make_drafter(tmp_path / "a", target_dir, kind)
    drafter, report = load_drafter(first, target.embed, target.lm_head)
    assert report.problems() == [] and report.kind == kind
    save_drafter(drafter, tmp_path / "b")
    a, b = weights_of(first), weights_of(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_unexpected_and_misshaped_keys_are_reported_together(tmp_path, target_dir, target):
    d = make_drafter(tmp_path / "d", target_dir, "eagle1")
    w = weights_of(d)
    del w["layers.0.mlp.up_proj.weight"]
    w["layers.1.mlp.up_proj.weight"] = torch.zeros(1)
    w["fc.weight"] = torch.zeros(64, 64)
    rewrite(d, w)
    with pytest.raises(CheckpointError) as err:
        load_drafter(d, target.embed, target.lm_head)
    text = str(err.value)
    assert "missing key layers.0.mlp.up_proj.weight" in text
    assert "unexpected key layers.1.mlp.up_proj.weight" in text
    assert "mis-shaped key fc.weight (expected (64, 128), got (64, 64))" in text


def test_reduced_draft_vocabulary_without_d2t_is_refused(tmp_path, target_dir, target):
    d = make_drafter(tmp_path / "d", target_dir, "eagle3", draft_vocab_size=32)
    w = weights_of(d)
    del w["d2t"], w["t2d"]
    rewrite(d, w)
    with pytest.raises(CheckpointError, match="d2t is missing but the draft vocabulary \\(32\\) is smaller"):
        load_drafter(d, target.embed, target.lm_head)


def test_reduced_draft_vocabulary_maps_draft_ids_to_target_ids(tmp_path, target_dir, target):
    d = make_drafter(tmp_path / "d", target_dir, "eagle3", draft_vocab_size=4)
    drafter, _ = load_drafter(d, target.embed, target.lm_head)
    assert isinstance(drafter, Eagle3Drafter)
    drafter.set_vocab_map(torch.tensor([3, 10, 50, 90]), 96)
    assert drafter.to_target_ids(torch.tensor([0, 1, 2, 3])).tolist() == [3, 10, 50, 90]
    assert drafter.t2d.nonzero().flatten().tolist() == [3, 10, 50, 90]


def test_full_draft_vocabulary_may_omit_d2t(tmp_path, target_dir, target):
    d = make_drafter(tmp_path / "d", target_dir, "eagle3")
    w = weights_of(d)
    del w["d2t"], w["t2d"]
    rewrite(d, w)
    drafter, _ = load_drafter(d, target.embed, target.lm_head)
    assert drafter.to_target_ids(torch.tensor([5])).item() == 5


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("stored", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
def test_a_stored_copy_of_the_targets_embedding_loads_in_any_dtype(tmp_path_factory, family, stored, draft_dtype):
    """An official EAGLE-1 checkpoint stores the target's embedding (fp32, fp16 or bf16); it loads beside a float32
    target whatever the drafter's dtype, since both are roundings of the same weights."""
    root = tmp_path_factory.mktemp(f"{family}-{stored}-{draft_dtype}")
    target_dir = make_target(root / "target", family)
    drafter_dir = make_drafter(root / "d", target_dir, "eagle1", embedding=stored)
    engine = Engine.from_pretrained(target_dir, drafter_dir, tree={"width": 2, "depth": 2, "budget": 4}, draft_dtype=draft_dtype)
    assert engine.drafter.dtype == draft_dtype


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
def test_a_stored_embedding_that_is_not_the_targets_is_refused(tmp_path, target_dir, draft_dtype):
    d = make_drafter(tmp_path / "d", target_dir, "eagle1")
    w = weights_of(d)
    reference = TargetModel.from_pretrained(target_dir).embed.weight.detach()
    w["embed_tokens.weight"] = (reference * 1.02).to(torch.bfloat16)  # 2% off: beyond any rounding of bf16 or fp32
    rewrite(d, w)
    with pytest.raises(CheckpointError, match="embed_tokens.weight differs from the target's embedding beyond the rounding"):
        Engine.from_pretrained(target_dir, d, draft_dtype=draft_dtype)


def test_same_up_to_rounding_allows_one_unit_in_the_last_place_of_each_dtype():
    x = torch.tensor([0.1, -3.0, 1e-3, 0.0])
    for dtype in (torch.float16, torch.bfloat16):
        assert same_up_to_rounding(x.to(dtype), x)
        assert same_up_to_rounding(x.to(dtype), x.to(torch.bfloat16))
    nudged = x.to(torch.bfloat16).float() * (1 + 4 * torch.finfo(torch.bfloat16).eps)
    assert not same_up_to_rounding(nudged, x.to(torch.bfloat16))


def test_fc_bias_against_a_bias_free_config_is_ignored_and_reported(tmp_path, target_dir, target):
    d = make_drafter(tmp_path / "d", target_dir, "eagle1", bias=False)
    w = weights_of(d)
    w["fc.bias"] = torch.zeros(64)
    rewrite(d, w)
    drafter, report = load_drafter(d, target.embed, target.lm_head)
    assert drafter.fc.bias is None
    assert report.ignored == ["fc.bias (config says bias: false)"]


def test_bin_checkpoints_load_with_weights_only_and_refuse_pickled_objects(tmp_path, target_dir, target):
    d = make_drafter(tmp_path / "d", target_dir, "eagle1")
    weights = weights_of(d)
    (d / "model.safetensors").unlink()
    torch.save(weights, d / "pytorch_model.bin")
    drafter, _ = load_drafter(d, target.embed, target.lm_head)
    assert torch.equal(drafter.fc.weight, weights["fc.weight"])

    class Payload:
        def __reduce__(self):
            return (print, ("code ran while loading",))

    torch.save({"fc.weight": weights["fc.weight"], "evil": Payload()}, d / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError):
        load_drafter(d, target.embed, target.lm_head)


def test_drafter_for_another_vocabulary_is_refused(tmp_path, target_dir):
    other = make_target(tmp_path / "other", vocab_size=80)
    d = make_drafter(tmp_path / "d", other, "eagle1")
    with pytest.raises(Exception, match="vocab"):
        Engine.from_pretrained(target_dir, d, allow_manifest_mismatch=True)
