"""Data-parallel training on a local Ray instance matches one worker on the same global batch."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file
from tests.helpers.tiny import add_tokenizer, make_target

from eyas.train.distributed import fit_distributed
from eyas.train.recipe import Recipe
from eyas.train.trainer import Trainer

pytestmark = pytest.mark.slow  # Ray Train workers


@pytest.mark.parametrize("kind", ["hass", "eagle3"])
def test_two_workers_match_one_on_the_same_global_batch(ray_session, tmp_path, kind):
    target = make_target(tmp_path / "target")
    add_tokenizer(target)
    rng = random.Random(1)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": " ".join(f"w{rng.randint(5, 95)}" for _ in range(rng.randint(5, 50)))}) + "\n" for _ in range(30))
    )
    common = dict(
        recipe=kind,
        target=str(target),
        data=[str(data)],
        seq_len=32,
        batch_size=4,
        max_steps=3,
        warmup_steps=1,
        weight_decay=0.1,
        eval_every=100,
        save_every=100,
        eval_batches=1,
        draft_vocab_size=64 if kind == "eagle3" else None,
    )
    single = Trainer(Recipe(**common, output=str(tmp_path / "one"))).fit(progress=False)
    double = fit_distributed(Recipe(**common, output=str(tmp_path / "two"), workers=2), progress=False)
    a, b = load_file(str(single / "model.safetensors")), load_file(str(double / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-4), key
    moved = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert any(not torch.equal(moved[k], torch.zeros_like(moved[k])) for k in moved)
