"""The in-process engine: one target, one drafter, EAGLE-2 trees, exact verification, no Ray, no gRPC.

It is the reference path the distributed service is tested against.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .autotree import TreeTuner, measure_costs
from .drafters import Drafter, load_drafter
from .errors import RequestError
from .manifest import Manifest
from .pairing import plan_drafter, target_num_layers
from .proposer import DraftSession
from .request import RequestState, StopRules, make_sampling
from .rounds import RoundRecord, run_round, start
from .stats import GenerationStats
from .target import TargetModel, TargetSession
from .trace.record import RequestRecorder
from .trace.store import TraceWriter
from .tree import TreeError, TreePolicy


@dataclass
class Generation:
    """The new tokens of one request, their text (when a tokenizer is known) and statistics."""

    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)


def tokenize_prompt(prompt: str | Sequence[int], tokenizer, vocab_size: int) -> list[int]:
    """A prompt string (through `tokenizer`) or a list of token ids, checked against the vocabulary.

    Shared by the engine and the service's coordinator, which holds the tokenizer but no model.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("prompt", "a text prompt needs the target's tokenizer; pass token ids instead")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise RequestError("prompt", "the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def eos_token_ids(generation_config, tokenizer) -> frozenset[int]:
    """End-of-sequence ids from a generation config, else from the tokenizer; empty when neither names one."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def tree_setting(tree: TreePolicy | dict | str | None) -> TreePolicy | str:
    """"auto" (hardware-aware, see eyas.autotree) or a fixed policy from a mapping; None is the default policy."""
    if isinstance(tree, str):
        if tree != "auto":
            raise TreeError("tree", f'a tree setting is "auto" or a mapping of top_k, depth, budget, got {tree!r}')
        return tree
    return TreePolicy.from_dict(tree)


class Engine:
    """EAGLE speculative decoding of one target with one drafter, in one process.

    `tree` is "auto" (hardware-aware, the default) or a fixed policy (a TreePolicy or a mapping; None: TreePolicy()).
    """

    def __init__(
        self, target: TargetModel, drafter: Drafter, manifest: Manifest, tree: TreePolicy | dict | str | None = "auto"
    ):
        self.target = target
        self.drafter = drafter
        self.manifest = manifest
        self.tree = tree_setting(tree)
        self._ids = itertools.count()
        self._tuner: TreeTuner | None = None

    @property
    def tuner(self) -> TreeTuner:
        """The `tree: auto` tuner; the machine's costs are measured on first use."""
        if self._tuner is None:
            self._tuner = TreeTuner(measure_costs(self.target, self.drafter))
        return self._tuner

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path,
        drafter: str | Path,
        tree: TreePolicy | dict | str | None = "auto",
        feature_layers: tuple[int, ...] | None = None,
        allow_manifest_mismatch: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> "Engine":
        """Load a target directory and a drafter directory, checking the drafter's manifest against the target."""
        plan = plan_drafter(drafter, target_num_layers(target), feature_layers)
        target_model = TargetModel.from_pretrained(target, plan.address, dtype=dtype)
        manifest = plan.manifest(target_model.fingerprint, allow_manifest_mismatch)
        drafter_model, _ = load_drafter(drafter, target_model.embed, target_model.lm_head)
        return cls(target_model, drafter_model.to(dtype), manifest, tree)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt string (through the target's tokenizer) or a list of token ids, checked against the vocabulary."""
        return tokenize_prompt(prompt, self.target.tokenizer, self.target.vocab_size)

    def eos_token_ids(self) -> frozenset[int]:
        """The target's end-of-sequence ids from its generation config (or tokenizer)."""
        return eos_token_ids(getattr(self.target.model, "generation_config", None), self.target.tokenizer)

    def new_request(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Sequence[str] = (),
        stop_at_eos: bool = True,
        request_id: str | None = None,
    ) -> RequestState:
        """Validate a request and build its committed state; nothing runs yet."""
        sampling = make_sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        rules = StopRules(max_new_tokens, self.eos_token_ids() if stop_at_eos else frozenset(), tuple(stop))
        decode = self.target.tokenizer.decode if self.target.tokenizer is not None else None
        return RequestState(
            request_id or f"req-{next(self._ids)}", self.tokenize(prompt), sampling, rules, decode=decode
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Sequence[str] = (),
        stop_at_eos: bool = True,
        tree: TreePolicy | dict | str | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        trace: str | Path | TraceWriter | None = None,
    ) -> Generation:
        """Generate up to `max_new_tokens` tokens; greedy when temperature is 0, else exact sampling.

        `trace` (a file path or an open writer) appends this request's rounds to a trace.
        """
        request = self.new_request(prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, stop_at_eos)
        setting = tree_setting(tree) if tree is not None else self.tree
        auto = setting == "auto"
        policy = self.tuner.policy() if auto else setting
        target, draft = TargetSession(self.target), DraftSession(self.drafter)
        writer = TraceWriter(trace) if isinstance(trace, (str, Path)) else trace
        recorder = None
        if writer is not None:
            recorder = RequestRecorder(writer.write, request, policy, self.manifest.id, self.manifest.to_dict(), "local")
        stats = GenerationStats()
        try:
            started = time.perf_counter()
            start(request, draft, target)
            stats.add_prefill(time.perf_counter() - started)
            while not request.done:
                record = run_round(request, draft, target, self.tuner.policy() if auto else policy)
                if auto:
                    self.tuner.observe(record)
                stats.add_round(record)
                if recorder is not None:
                    recorder.local_round(record)
                if on_round is not None:
                    on_round(record)
            if recorder is not None:
                recorder.end(request)
        finally:
            if writer is not trace:
                writer.close()
        text = self.target.tokenizer.decode(request.output) if self.target.tokenizer is not None else None
        return Generation(request.output, text, request.finish_reason, stats, request.prompt_ids)
