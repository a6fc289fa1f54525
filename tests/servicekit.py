"""Shared setup of the service tests: tiny models on disk, service configs, references, waiting on conditions."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from tiny import add_tokenizer, make_drafter, make_target
from transformers import AutoModelForCausalLM

from eyas import Engine
from eyas.cluster.config import ServiceConfig

TREE = {"top_k": 4, "depth": 4, "budget": 12}
EOS = 2  # the tiny tokenizer's end-of-sequence token


def build_models(root: Path, kind: str = "eagle1") -> tuple[Path, Path]:
    """A tiny Llama target with a word-level tokenizer and a random drafter of `kind`."""
    target = make_target(root / "target")
    add_tokenizer(target)
    return target, make_drafter(root / kind, target, kind)


def service_config(target: Path, drafter: Path, draft: int = 1, targets: int = 1, **sections) -> ServiceConfig:
    """A config for the tiny models with the given pool sizes; `sections` override whole YAML sections."""
    data = {
        "models": {"target": str(target), "drafter": str(drafter)},
        "tree": TREE,
        "pools": {"draft": {"replicas": draft}, "target": {"replicas": targets}},
        "service": {"ready_timeout_s": 120, "rpc_timeout_s": 60},
    }
    data.update(sections)
    return ServiceConfig.from_dict(data)


def hf_greedy(model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Hugging Face greedy continuations, cut after the first EOS (where eyas stops)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = []
    for prompt, n in zip(prompts, lengths):
        ids = torch.tensor([prompt])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()
        out.append(tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens)
    return out


def engine_outputs(engine: Engine, prompts: list[list[int]], lengths: list[int], **options) -> list[list[int]]:
    return [engine.generate(p, max_new_tokens=n, **options).token_ids for p, n in zip(prompts, lengths)]


def wait_until(condition: Callable[[], object], timeout: float, what: str, poll: float = 0.1) -> object:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)
