"""Manifest contract (docs/manifest.md): a drafter runs only on the target fingerprint and feature address it was built for."""

import json
import shutil

import pytest
from tests.helpers.tiny import add_tokenizer, make_drafter, make_target

from eyas import Engine, FeatureAddress, Manifest, ManifestMismatch


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("manifest")
    target = make_target(root / "target")
    add_tokenizer(target)
    return root, target, make_drafter(root / "e1", target, "eagle1"), make_drafter(root / "e3", target, "eagle3")


def test_matching_pair_loads_and_records_the_address(pair):
    _, target, e1, e3 = pair
    assert Engine.from_pretrained(target, e1).manifest.feature == FeatureAddress.eagle1()
    manifest = Engine.from_pretrained(target, e3).manifest
    assert manifest.feature == FeatureAddress("layer_inputs", (2, 2, 1))  # 4 layers: 2, N//2, N-3
    assert manifest.drafter_abi == "eagle3/1" and manifest.overrides == ()
    assert Manifest.load(e3).id == manifest.id


def test_other_weights_are_refused_naming_the_weight_digest(pair, tmp_path):
    _, target, e1, _ = pair
    other = make_target(tmp_path / "other", seed=5)
    add_tokenizer(other)
    with pytest.raises(ManifestMismatch) as err:
        Engine.from_pretrained(other, e1)
    assert err.value.field == "target.weight_digest"


def test_other_tokenizer_is_refused_naming_the_tokenizer_digest(pair, tmp_path):
    _, target, e1, _ = pair
    other = tmp_path / "retok"
    shutil.copytree(target, other)
    add_tokenizer(other, shift=1)
    with pytest.raises(ManifestMismatch) as err:
        Engine.from_pretrained(other, e1)
    assert err.value.field == "target.tokenizer_digest"


def test_other_config_is_refused_naming_the_config_digest(pair, tmp_path):
    _, target, e1, _ = pair
    other = tmp_path / "reconf"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ManifestMismatch) as err:
        Engine.from_pretrained(other, e1)
    assert err.value.field == "target.config_digest"


def test_other_feature_address_is_refused_then_overridden_on_request(pair):
    _, target, _, e3 = pair
    with pytest.raises(ManifestMismatch) as err:
        Engine.from_pretrained(target, e3, feature_layers=(1, 2, 3))
    assert err.value.field == "feature"
    with pytest.warns(UserWarning, match="override feature"):
        engine = Engine.from_pretrained(target, e3, feature_layers=(1, 2, 3), allow_manifest_mismatch=True)
    assert engine.manifest.feature.layers == (1, 2, 3)
    assert any(note.startswith("override feature") for note in engine.manifest.overrides)


def test_drafter_without_manifest_runs_with_the_gap_recorded(pair, tmp_path):
    _, target, e1, _ = pair
    bare = tmp_path / "bare"
    shutil.copytree(e1, bare)
    (bare / "eyas_manifest.json").unlink()
    with pytest.warns(UserWarning, match="no stored manifest"):
        engine = Engine.from_pretrained(target, bare)
    assert engine.manifest.overrides == ("no manifest stored with the drafter",)


def test_manifest_round_trips_through_json(pair):
    _, _, _, e3 = pair
    manifest = Manifest.load(e3)
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest
