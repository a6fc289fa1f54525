"""Stop rules: EOS, stop strings and max_new_tokens end the output exactly, even inside a multi-token round."""

import pytest
import torch
from tests.helpers.oracle import OracleDrafter
from tests.helpers.tiny import add_tokenizer, make_drafter, make_target
from transformers import AutoModelForCausalLM

from eyas import Engine
from eyas.drafters import drafter_config
from eyas.tree import TreePolicy

PROMPT = [5, 17, 33, 8, 9, 41, 77, 12]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("stops")
    target = make_target(root / "t")
    add_tokenizer(target)
    hf = AutoModelForCausalLM.from_pretrained(target)
    ids = torch.tensor([PROMPT])
    reference = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)[0, 8:].tolist()
    engine = Engine.from_pretrained(target, make_drafter(root / "d", target))
    engine.drafter = OracleDrafter(drafter_config("eagle1", engine.target.config), PROMPT + reference)
    engine.tree = TreePolicy.from_dict({"width": 2, "depth": 6, "budget": 12})
    return engine, reference


def first_new_token_index(reference):
    """An index whose token did not occur earlier, so the first stop is unambiguous."""
    return next(i for i in range(5, len(reference)) if reference[i] not in reference[:i] + PROMPT)


def test_eos_ends_the_output_inclusively(setup):
    engine, reference = setup
    i = first_new_token_index(reference)
    engine.target.generation_config.eos_token_id = reference[i]
    try:
        gen = engine.generate(PROMPT, max_new_tokens=40)
        assert gen.token_ids == reference[: i + 1] and gen.finish_reason == "eos"
        assert engine.generate(PROMPT, max_new_tokens=40, stop_at_eos=False).token_ids == reference
    finally:
        engine.target.generation_config.eos_token_id = None


def test_stop_string_ends_the_output_at_the_token_completing_it(setup):
    engine, reference = setup
    i = first_new_token_index(reference)
    stop = engine.target.tokenizer.decode(reference[i - 1 : i + 1])
    gen = engine.generate(PROMPT, max_new_tokens=40, stop=[stop])
    assert gen.token_ids == reference[: i + 1] and gen.finish_reason == "stop"
    assert gen.text.endswith(stop)


def test_text_prompts_use_the_targets_tokenizer(setup):
    engine, reference = setup
    text = engine.target.tokenizer.decode(PROMPT)
    gen = engine.generate(text, max_new_tokens=10)
    assert gen.prompt_ids == PROMPT and gen.token_ids == reference[:10]
    assert gen.text == engine.target.tokenizer.decode(reference[:10])
