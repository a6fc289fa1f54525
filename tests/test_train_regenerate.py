"""Target-generated training data on a tiny target: prompts kept, continuations the target's own, cached by key."""

import json
from dataclasses import replace

import pytest
import torch
import yaml
from tests.helpers.tiny import add_tokenizer, make_target, write_word_text
from transformers import AutoModelForCausalLM

import eyas.train.regenerate as regenerate
from eyas.client.cli import main
from eyas.train.recipe import Recipe, RecipeError, Regeneration
from eyas.train.trainer import Trainer

SETTINGS = {"prompt_tokens": 4, "temperatures": [0.0, 1.0], "windows": 4, "batch": 2}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("regenerate")
    target = make_target(root / "target")
    add_tokenizer(target)
    write_word_text(root / "data.jsonl", docs=30, lengths=(20, 60), seed=1)
    return root, target


def recipe(world, **overrides) -> Recipe:
    root, target = world
    base = dict(recipe="eagle1", target=str(target), data=[str(root / "data.jsonl")], output=str(root / "runs" / "e1"),
                seq_len=16, batch_size=2, max_steps=1, regenerate=SETTINGS)
    return Recipe(**{**base, **overrides})


def test_windows_are_prompts_and_the_targets_own_continuations(world):
    _, target = world
    plain = Trainer(recipe(world, regenerate=False)).train_data
    data = Trainer(recipe(world)).train_data
    picked = regenerate.spread(plain, SETTINGS["windows"])
    assert len(data) == SETTINGS["windows"] and data.tokens.shape[1] == 16
    assert torch.equal(data.tokens[:, :4], picked.tokens[:, :4])  # each window's first segment is long enough here
    assert not data.supervise[:, :4].any() and data.supervise[:, 4:][data.valid[:, 4:]].all()
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    for i in (0, 2):  # temperature 0.0 windows: the target's greedy continuation
        prompt = data.tokens[i : i + 1, :4]
        greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
        assert data.tokens[i].tolist() == greedy[0].tolist()
    assert not torch.equal(data.tokens[1, 4:], hf.generate(data.tokens[1:2, :4], max_new_tokens=12, do_sample=False)[0, 4:])


def test_regenerated_windows_are_cached_and_keyed_by_the_target(world, tmp_path, monkeypatch):
    root, _ = world
    first = Trainer(recipe(world, regenerate_cache=str(tmp_path))).train_data
    (entry,) = tmp_path.iterdir()

    def refuse(*args, **kwargs):
        raise AssertionError("regenerated again although the cache holds these windows")

    with monkeypatch.context() as patch:
        patch.setattr(regenerate, "generate_windows", refuse)
        again = Trainer(recipe(world, regenerate_cache=str(tmp_path))).train_data
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.supervise, again.supervise)
    other = make_target(tmp_path / "other-target", seed=5)
    add_tokenizer(other)
    Trainer(recipe(world, target=str(other), regenerate_cache=str(tmp_path / "c")))
    Trainer(recipe(world, target=str(other), regenerate_cache=str(tmp_path)))
    assert len([p for p in tmp_path.iterdir() if p.name not in ("other-target", "c")]) == 2  # a new key, the old kept
    assert entry.exists()


def test_an_interrupted_regeneration_resumes_from_the_batches_it_finished(world, tmp_path, monkeypatch):
    _, target = world
    data = regenerate.spread(Trainer(recipe(world, regenerate=False)).train_data, SETTINGS["windows"])
    settings = Regeneration(**SETTINGS)
    fresh = regenerate.generate_windows(target, data, settings, progress=False)
    calls = []
    real = regenerate.Engine.generate_batch

    def once(self, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # stopped during the second batch
        return real(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(regenerate.Engine, "generate_batch", once)
        with pytest.raises(KeyboardInterrupt):
            regenerate.generate_windows(target, data, settings, progress=False, parts=tmp_path)
        assert [p.name for p in tmp_path.iterdir()] == ["batch-00000.json"]
        calls.clear()
        resumed = regenerate.generate_windows(target, data, settings, progress=False, parts=tmp_path)
    assert len(calls) == 1  # only the batch that was not finished
    ones = tmp_path / "ones"
    ones.mkdir()
    regenerate.generate_windows(target, data, replace(settings, batch=1), progress=False, parts=ones)
    regrouped = regenerate.generate_windows(target, data, settings, progress=False, parts=ones)
    for windows in (resumed, regrouped):  # a kept batch of another size is not taken for one of this size
        for field in regenerate.FIELDS:
            assert torch.equal(getattr(windows, field), getattr(fresh, field))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"prompt_tokens": 0}, "regenerate.prompt_tokens: must be a positive integer"),
        ({"prompt_tokens": 16}, r"regenerate.prompt_tokens \(16\) must be below seq_len \(16\)"),
        ({"temperatures": []}, "regenerate.temperatures"),
        ({"temperatures": [-1.0]}, "regenerate.temperatures"),
        ({"windows": 0}, "regenerate.windows"),
        ({"top_p": 0.9}, "unknown regenerate key 'top_p'"),
        ("yes", "regenerate: true, false or a mapping"),
    ],
)
def test_bad_regeneration_settings_are_named_before_anything_runs(world, tmp_path, settings, message):
    with pytest.raises(RecipeError, match=message):
        Trainer(recipe(world, regenerate=settings, regenerate_cache=str(tmp_path / "cache")))
    assert not (tmp_path / "cache").exists()


def test_eyas_train_regenerate_trains_on_regenerated_windows(world, tmp_path, capsys):
    root, target = world
    config = tmp_path / "recipe.yaml"
    base = dict(recipe="eagle1", target=str(target), data=[str(root / "data.jsonl")], output=str(tmp_path / "out"),
                seq_len=40, batch_size=2, max_steps=1, eval_every=5, save_every=5)
    config.write_text(yaml.safe_dump(base))
    assert main(["train", "--config", str(config), "--regenerate"]) == 0
    (entry,) = (tmp_path / "regenerated").iterdir()  # the default cache, beside the output
    assert json.loads((entry / regenerate.META_FILE).read_text())["settings"]["prompt_tokens"] == 32
    config.write_text(yaml.safe_dump({**base, "seq_len": 32}))
    assert main(["train", "--config", str(config), "--regenerate"]) != 0
    assert "regenerate.prompt_tokens (32) must be below seq_len (32)" in capsys.readouterr().err
