"""Trainer contracts: ownership and dtype, exact resume, skipped steps, data formats, bad input, caches."""

import json
import random

import pytest
import torch
from tests.helpers.tiny import add_tokenizer, make_target, write_word_text

from eyas import Engine
from eyas.train.data import DataError, read_documents
from eyas.train.features import StaleFeatureCache
from eyas.train.recipe import Recipe, RecipeError
from eyas.train.trainer import Trainer

CHAT_TEMPLATE = "{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w4' }} {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    target = make_target(root / "target")
    add_tokenizer(target)
    write_word_text(root / "data.jsonl", docs=40, lengths=(5, 60))
    return root, target


def recipe(world, kind="eagle1", **overrides):
    root, target = world
    base = dict(
        recipe=kind,
        target=str(target),
        data=[str(root / "data.jsonl")],
        output=str(root / f"out-{kind}-{random.random()}"),
        seq_len=32,
        batch_size=4,
        max_steps=6,
        warmup_steps=2,
        eval_every=100,
        save_every=100,
        log_every=1,
        eval_batches=2,
    )
    if kind == "eagle3":
        base["draft_vocab_size"] = 64
    return Recipe(**{**base, **overrides})


@pytest.mark.parametrize("kind", ["eagle1", "hass", "eagle3"])
def test_only_the_drafter_owns_gradients(world, kind):
    trainer = Trainer(recipe(world, kind, max_steps=1))
    record = trainer.train_step()
    assert record["loss"] > 0
    assert all(not p.requires_grad and p.grad is None for p in trainer.target.runtime.tensors())
    assert all(p.grad is not None for p in trainer.drafter.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())


@pytest.mark.parametrize("kind", ["eagle1", "hass", "eagle3"])
def test_resume_continues_exactly_as_an_uninterrupted_run(world, kind):
    straight = Trainer(recipe(world, kind))
    losses = [straight.train_step()["loss"] for _ in range(6)]
    first = Trainer(recipe(world, kind))
    for _ in range(3):
        first.train_step()
    checkpoint = first.save(first.output / "mid")
    resumed = Trainer(recipe(world, kind), resume_from=checkpoint)
    assert resumed.step == 3
    assert [resumed.train_step()["loss"] for _ in range(3)] == pytest.approx(losses[3:], rel=1e-6, abs=1e-7)


def test_a_batch_without_supervised_rows_skips_the_step_and_weight_decay(world, tmp_path):
    root, target = world
    data = tmp_path / "mixed.jsonl"
    conversation = {"conversations": [{"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": "w20 w21"}]}
    unsupervised = {"conversations": [{"role": "user", "content": " ".join(["w30"] * 30)}]}
    data.write_text(json.dumps(conversation) + "\n" + json.dumps(unsupervised) + "\n")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "chat-target")
    import shutil

    for f in target.iterdir():
        if not (tmp_path / "chat-target" / f.name).exists():
            shutil.copy(f, tmp_path / "chat-target" / f.name)
    trainer = Trainer(recipe(world, data=[str(data)], target=str(tmp_path / "chat-target"), batch_size=1, weight_decay=0.5, max_steps=4))
    skipped = 0
    for _ in range(4):
        before = [p.detach().clone() for p in trainer.drafter.parameters()]
        record = trainer.train_step()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.drafter.parameters()))
        assert unchanged == bool(record.get("skipped"))
        skipped += bool(record.get("skipped"))
    assert skipped >= 1 and trainer.skipped == skipped


def test_conversations_supervise_assistant_turns_only(world):
    _, target = world
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = CHAT_TEMPLATE
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "chat.jsonl"
        path.write_text(json.dumps({"conversations": [{"from": "human", "value": "w10 w11"}, {"from": "gpt", "value": "w20"}]}))
        (doc,) = read_documents([str(path)], tokenizer)
    assert doc.tokens == [3, 10, 11, 4, 20]
    assert doc.supervise == [False, False, False, True, True]


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not JSON"),
        ('{"title": "no text here"}', 'expected {"text"'),
    ],
)
def test_bad_data_lines_are_named(world, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "w5 w6"}\n' + content + "\n")
    with pytest.raises(DataError, match=f"bad.jsonl:2: {message}"):
        Trainer(recipe(world, data=[str(path)]))


def test_empty_dataset_after_masking_is_refused_before_training(world, tmp_path):
    root, target = world
    chat = tmp_path / "chat-target"
    import shutil

    shutil.copytree(target, chat)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat)
    path = tmp_path / "users.jsonl"
    path.write_text(json.dumps({"conversations": [{"role": "user", "content": "w10 w11"}]}) + "\n")
    with pytest.raises(DataError, match="no supervised tokens"):
        Trainer(recipe(world, data=[str(path)], target=str(chat)))


def test_recipe_errors_come_before_any_training(world, tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe key 'learning_rate'"):
        Recipe.from_dict({"recipe": "eagle1", "target": "t", "data": ["d"], "output": "o", "learning_rate": 1.0})
    with pytest.raises(RecipeError, match="recipe: must be one of"):
        Recipe.from_dict({"recipe": "medusa", "target": "t", "data": ["d"], "output": "o"})
    with pytest.raises(RecipeError, match="missing recipe key 'output'"):
        Recipe.from_dict({"recipe": "eagle1", "target": "t", "data": ["d"]})
    checkpoint = Trainer(recipe(world, "eagle1")).save(tmp_path / "e1")
    with pytest.raises(RecipeError, match="the checkpoint's recipe is 'eagle1'"):
        Trainer(recipe(world, "hass"), resume_from=checkpoint)


def test_mismatched_tokenizer_and_target_are_refused(world, tmp_path):
    root, _ = world
    small = make_target(tmp_path / "small", vocab_size=50)
    add_tokenizer(small)  # 96 words for a 50-entry vocabulary
    with pytest.raises(DataError, match="tokenizer and target do not match"):
        Trainer(recipe(world, target=str(small)))


def test_trained_checkpoint_serves_in_the_engine_exactly(world):
    root, target = world
    trainer = Trainer(recipe(world, "eagle3", max_steps=3, eval_every=2))
    final = trainer.fit(progress=False)
    log = [json.loads(line) for line in (trainer.output / "log.jsonl").read_text().splitlines()]
    assert any("eval" in r and "top1/6" in r["eval"] for r in log)
    assert (trainer.output / "training.png").stat().st_size > 0
    engine = Engine.from_pretrained(target, final)
    assert engine.manifest.drafter_abi == "eagle3/1"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target)
    prompt = torch.tensor([[5, 6, 7, 8]])
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)[0, 4:]
    assert engine.generate(prompt[0].tolist(), max_new_tokens=24).token_ids == expected.tolist()


def test_feature_cache_is_reused_and_refused_when_stale(world, tmp_path):
    root, target = world
    cache = tmp_path / "cache"
    online = Trainer(recipe(world, "eagle1"))
    cached = Trainer(recipe(world, "eagle1", features=str(cache)))
    assert (cache / "cache.json").exists()
    a, b = online.train_step()["loss"], cached.train_step()["loss"]
    assert b == pytest.approx(a, rel=1e-2)  # bf16 features
    other = make_target(tmp_path / "other", seed=9)
    add_tokenizer(other)
    with pytest.raises(StaleFeatureCache, match="target.weight_digest"):
        Trainer(recipe(world, "eagle1", target=str(other), features=str(cache)))
    with pytest.raises(StaleFeatureCache, match="feature address"):
        Trainer(recipe(world, "eagle3", features=str(cache)))


def test_bundled_recipes_are_valid():
    from pathlib import Path

    from eyas.train.objectives import Objective

    for path in sorted(Path(__file__).parents[1].glob("configs/train/*.yaml")):
        recipe = Recipe.from_yaml(path)
        objective = Objective.preset(recipe.recipe, **recipe.objective)
        assert objective.kind == recipe.recipe and path.stem.split("-")[-1] == recipe.recipe  # eagle3, moe-eagle3


def test_bf16_autocast_trains_with_float32_weights_and_losses(world):
    trainer = Trainer(recipe(world, "eagle3", bf16=True, max_steps=2))
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    reference = Trainer(recipe(world, "eagle3", max_steps=2))
    assert losses[0] == pytest.approx(reference.train_step()["loss"], rel=0.05)
    assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())
