"""A seed fixes the sampled text (docs/sampling.md): identical token for token between plain sampling,
speculation on three fixed trees and `tree: auto`, a batch of 8 requests with different seeds, and a
reference loop written directly on the Hugging Face model (full forward per token, Hugging Face's own
logits warpers, the position's noise).
"""

import pytest
import torch
from tests.helpers.tiny import make_drafter, make_target
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eyas import Engine
from eyas.keyed import position_noise

VOCAB = 32
PROMPTS = [[5, 17, 3, 8, 9], [7], [11, 22, 30, 4, 19, 6, 25]]
LENGTH = 40
TREES = [{"width": 1, "depth": 4, "budget": 4}, {"width": 3, "depth": 3, "budget": 9}, {"width": 6, "depth": 5, "budget": 24}]
OPTIONS = [
    {"temperature": 0.7, "seed": 1},
    {"temperature": 1.0, "seed": 2},
    {"temperature": 0.7, "seed": 3, "top_k": 8, "top_p": 0.9},
    {"temperature": 1.0, "seed": 4, "top_p": 0.8},
]
SLOW = pytest.mark.slow  # every tree, tree auto's measurements among them, on each of 4 prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A small-vocabulary target with peaked distributions (so drafts are often accepted) and its drafter."""
    root = tmp_path_factory.mktemp("seeded")
    target = make_target(root / "t", vocab_size=VOCAB, init_std=0.25, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    drafter = make_drafter(root / "d", target, "eagle1")
    return target, drafter


@pytest.fixture(scope="module")
def engine(models):
    return Engine.from_pretrained(*models)


@torch.no_grad()
def reference_sample(model, prompt: list[int], n: int, temperature: float, seed: int, top_k: int = 0, top_p: float = 1.0):
    """Plain sampling on the Hugging Face model: the token at position t maximises log p_t + G(seed, t)."""
    ids = list(prompt)
    for _ in range(n):
        scores = TemperatureLogitsWarper(temperature)(None, model(torch.tensor([ids])).logits[:, -1].double())  # [1, V]
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        log_probs = torch.log_softmax(scores[0], dim=-1)
        ids.append(int(torch.argmax(log_probs + position_noise(seed, len(ids), VOCAB))))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "options", [pytest.param(o, marks=SLOW if o["seed"] < 3 else ()) for o in OPTIONS], ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items())
)
def test_sampled_text_is_the_same_with_or_without_speculation_on_any_tree(models, engine, options):
    model = AutoModelForCausalLM.from_pretrained(models[0])
    accepted = []
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=LENGTH, stop_at_eos=False, speculate=False, **options)
        assert plain.stats.rounds == LENGTH  # one target forward per token
        assert plain.token_ids == reference_sample(model, prompt, LENGTH, **options)
        for tree in [*TREES, "auto"]:
            spec = engine.generate(prompt, max_new_tokens=LENGTH, stop_at_eos=False, tree=tree, **options)
            assert spec.token_ids == plain.token_ids, f"tree {tree}"
            accepted.append(spec.stats.tokens - spec.stats.rounds)
    assert sum(accepted) >= 2 * len(accepted)  # the trees' drafts were really accepted, two per request or more


@pytest.mark.parametrize("options", [OPTIONS[1], OPTIONS[2]], ids=["t1.0", "t0.7-topk-topp"])
def test_each_request_of_a_batch_of_8_keeps_the_text_of_plain_sampling(engine, options):
    prompts = [*PROMPTS, [1, 2, 3], [30], [9, 9, 9, 9], [12, 24], [4, 8, 15, 16, 23]]
    seeds = [options["seed"] + 10 * i for i in range(len(prompts))]
    shared = {k: v for k, v in options.items() if k != "seed"}
    batch = engine.generate_batch(prompts, max_new_tokens=LENGTH, seed=seeds, stop_at_eos=False, tree=TREES[1], **shared)
    for prompt, seed, got in zip(prompts, seeds, batch):
        plain = engine.generate(prompt, max_new_tokens=LENGTH, seed=seed, stop_at_eos=False, speculate=False, **shared)
        assert got.token_ids == plain.token_ids


def test_greedy_is_unchanged_by_the_plain_path(engine):
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=LENGTH, stop_at_eos=False, speculate=False)
        assert engine.generate(prompt, max_new_tokens=LENGTH, stop_at_eos=False, tree=TREES[2]).token_ids == plain.token_ids


def test_a_different_seed_gives_a_different_text(engine):
    texts = {tuple(engine.generate(PROMPTS[0], max_new_tokens=LENGTH, temperature=1.0, seed=s).token_ids) for s in range(4)}
    assert len(texts) == 4
