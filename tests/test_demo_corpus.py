"""Demo corpus, tokenizer and LM-training recipe, on tiny inputs."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyas.train.corpus import HELDOUT_MODULES, Corpus, collect, heldout_prompts
from eyas.demo.drafters import build_demo, latest_checkpoint, training_summary
import eyas.demo.lm as lm
from eyas.demo.lm import CHECKPOINT_FILE, train_lm
from eyas.demo.tokenizer import EOT, PAD, train_tokenizer
from eyas.train.trainer import STATE_FILE

TRICKY = "def f(x):\n\treturn 'héllo ✓ 日本'  \r\n\n    \x0c  # trailing   \n\n"


@pytest.fixture(scope="module")
def corpus():
    return collect()


@pytest.fixture(scope="module")
def tiny(corpus, tmp_path_factory):
    """A five-document corpus, two held-out documents and a vocab-300 tokenizer trained on the former."""
    small = sorted(corpus.train, key=lambda d: len(d.text))[200:205]
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([d.text for d in small], vocab_size=300, out_dir=out)
    return Corpus(corpus.root, small, corpus.heldout[:2]), out


def test_heldout_split_is_fixed_and_disjoint(corpus):
    train, heldout = {d.path for d in corpus.train}, corpus.heldout_modules
    assert heldout == [p for p in HELDOUT_MODULES if p in heldout] and len(heldout) >= 35
    assert not train & set(heldout)
    assert not any(part in {"test", "tests", "idle_test", "site-packages"} for p in train for part in p.split("/")[:-1])
    again = collect()
    assert again.heldout_modules == heldout and [d.path for d in again.train] == [d.path for d in corpus.train]


def test_tokenizer_round_trips_and_has_special_tokens(tiny):
    corpus, tok_dir = tiny
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    assert len(tok) == 300
    assert tok.bos_token == tok.eos_token == EOT and tok.pad_token == PAD and tok.pad_token_id != tok.eos_token_id
    for text in [d.text for d in corpus.train + corpus.heldout] + [TRICKY]:
        assert tok.decode(tok.encode(text)) == text


def test_heldout_prompts_are_deterministic(corpus, tiny):
    tok = AutoTokenizer.from_pretrained(tiny[1], local_files_only=True)
    a, b = heldout_prompts(tok, 12, max_tokens=100, corpus=corpus), heldout_prompts(tok, 12, max_tokens=100)
    assert a == b and len(a) == 12 and len({p.id for p in a}) == 12
    assert all(p.id.split(":")[0] in corpus.heldout_modules and len(tok.encode(p.text)) <= 100 for p in a)
    assert len({p.id.split(":")[0] for p in a}) >= 6  # round-robin over modules
    assert all(p.text.rstrip() == p.text and "def " in p.text for p in a)


def test_train_lm_two_steps_saves_loadable_model(tiny, tmp_path):
    corpus, tok_dir = tiny
    cfg = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)
    report = train_lm(tmp_path, tok_dir, cfg, steps=2, corpus=corpus, seq_len=32, batch_size=2, eval_tokens=256)
    saved = json.loads((tmp_path / "train_report.json").read_text())
    assert saved["steps"] == 2 and math.isfinite(saved["final_train_loss"]) and math.isfinite(saved["heldout_loss"])
    assert saved == json.loads(json.dumps(report))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert model.config.hidden_size == 32 and model.config.vocab_size == len(tok) == 300
    assert model.generation_config.pad_token_id == tok.pad_token_id


TINY_LLAMA = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)
TINY_MOE = {**TINY_LLAMA, "architecture": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def _train(tiny, out, work, config=TINY_LLAMA, **kw):
    corpus, tok_dir = tiny
    return train_lm(out, tok_dir, config, steps=6, corpus=corpus, seq_len=32, batch_size=2, eval_tokens=256,
                    curve_every=2, curve_eval_tokens=64, checkpoint_every=2, work_dir=work, **kw)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_MOE], ids=["llama", "mixtral"])
def test_interrupted_training_resumes_to_the_same_model(tiny, tmp_path, monkeypatch, config):
    straight = _train(tiny, tmp_path / "a", tmp_path / "wa", config)
    calls, real = [], lm.next_token_loss

    def interrupt_at_fifth_step(model, batch):
        if model.training:
            calls.append(1)
            if len(calls) == 5:
                raise KeyboardInterrupt
        return real(model, batch)

    monkeypatch.setattr(lm, "next_token_loss", interrupt_at_fifth_step)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny, tmp_path / "b", tmp_path / "wb", config)
    assert torch.load(tmp_path / "wb" / CHECKPOINT_FILE, weights_only=False)["step"] == 4
    monkeypatch.setattr(lm, "next_token_loss", real)
    resumed = _train(tiny, tmp_path / "b", tmp_path / "wb", config)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["curve"] == straight["curve"] and [c["step"] for c in straight["curve"]] == [2, 4, 6]
    assert resumed["heldout_loss"] == straight["heldout_loss"]


def test_resume_refuses_a_checkpoint_of_other_settings(tiny, tmp_path):
    _train(tiny, tmp_path / "a", tmp_path / "w")
    with pytest.raises(ValueError, match="its lr differs"):
        _train(tiny, tmp_path / "a", tmp_path / "w", lr=1e-4)


def test_demo_build_resumes_drafters_from_their_newest_checkpoint_and_refuses_unknown_stages(tmp_path):
    for step in (100, 300, 200):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / STATE_FILE).write_bytes(b"")
    (tmp_path / "checkpoint-400").mkdir()  # cut off while it was being written: no trainer state
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-300"
    assert latest_checkpoint(tmp_path / "none") is None
    with pytest.raises(ValueError, match="unknown demo stage 'eagle2'"):
        build_demo(tmp_path, tmp_path, stages=("target", "eagle2"))


def test_training_summary_adds_the_processor_time_of_every_run(tmp_path):
    records = [{"step": 1, "cpu_s": 60.0}, {"step": 2, "cpu_s": 120.0}, {"step": 2, "eval": {"top1/0": 0.5}},
               {"step": 3, "cpu_s": 30.0}, {"step": 4, "cpu_s": 90.0}]  # resumed after step 2
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert training_summary(tmp_path, 7.0) == ("4 steps, 7.0 minutes (3.5 minutes of processor time); "
                                               "held-out top-1 agreement by rollout step {'top1/0': 0.5}")
