"""The in-process engine: one target, one drafter, EAGLE-2 trees, exact verification, no Ray, no gRPC.

It is the reference path the distributed service is tested against.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .autotree import TreeTuner, measure_costs
from .drafters import Drafter, load_drafter
from .emulation import EmulatedDevice, Profile, SyntheticDrafter, TimedTarget, emulated_manifest, load_profile
from .errors import RequestError
from .manifest import Manifest
from .pairing import plan_drafter, target_num_layers
from .plain import PLAIN_POLICY, NoDraft
from .proposer import DraftModel, DraftSession
from .request import RequestState, StopRules, eos_token_ids, make_sampling, prompt_within, tokenize_prompt
from .rounds import RoundRecord, round_steps, start_steps
from .runtime.batch import Lockstep, Operation, results
from .runtime.device import prepare, resolve_device, resolve_draft_dtype, resolve_dtype, stored_dtype
from .runtime.kv import TREE_HEADROOM
from .stats import GenerationStats
from .steps import Steps
from .stored_tree import default_tree
from .target import DEFAULT_KV_SLOTS, TargetModel, TargetSession
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


def tree_setting(tree: TreePolicy | dict | str | None) -> TreePolicy | str:
    """"auto" (tree auto, eyas.autotree) or a fixed policy from a mapping; None is TreePolicy().

    A fixed policy must fit the scratch rows a KV slot keeps past a request's tokens.
    """
    if isinstance(tree, str):
        if tree != "auto":
            raise TreeError("tree", f'a tree setting is "auto" or a mapping of width, depth, budget, got {tree!r}')
        return tree
    policy = TreePolicy.from_dict(tree)
    if policy.budget + 1 > TREE_HEADROOM:
        raise TreeError("tree.budget", f"{policy.budget} candidate rows exceed the {TREE_HEADROOM - 1} a KV slot keeps for a tree")
    if policy.width * max(policy.depth - 1, 0) > TREE_HEADROOM:
        raise TreeError("tree.depth", f"width x (depth - 1) = {policy.width * (policy.depth - 1)} drafter rows exceed {TREE_HEADROOM}")
    return policy


class Engine:
    """EAGLE speculative decoding of one target with one drafter, in one process.

    `tree` is a fixed policy (a TreePolicy or a mapping; None: TreePolicy()) or "auto" (tree auto, eyas.autotree).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        manifest: Manifest,
        tree: TreePolicy | dict | str | None = None,
        draft_ahead: int = 0,
        graphs: bool | None = None,
    ):
        """`draft_ahead`: trees drafted ahead, during each verification, for its likeliest outcomes (0: off);
        `graphs`: the drafter's passes as CUDA graphs (None: on CUDA; see DraftModel)."""
        prepare(target.runtime.device)
        prepare(drafter.device)
        self.target = target
        self.draft_ahead = draft_ahead
        self.graphs = graphs
        self.drafter = drafter
        self.manifest = manifest
        self.tree = tree_setting(tree)
        self._ids = itertools.count()
        self._tuner: TreeTuner | None = None
        self._tuner_lock = threading.Lock()

    @property
    def drafter(self) -> Drafter:
        return self.draft.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter) -> None:
        """Serve with another drafter (same target): its draft KV pool is sized like the target's."""
        self.draft = DraftModel(
            drafter, self.target.pool.slots, self.target.max_seq_len, self.draft_ahead, graphs=self.graphs, target_head=self.target.head
        )

    @property
    def tuner(self) -> TreeTuner:
        """The `tree: auto` tuner; the machine's costs are measured on first use."""
        with self._tuner_lock:
            if self._tuner is None:
                self._tuner = TreeTuner(measure_costs(self.target, self.draft))
            return self._tuner

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path,
        drafter: str | Path,
        tree: TreePolicy | dict | str | None = None,
        feature_layers: tuple[int, ...] | None = None,
        allow_manifest_mismatch: bool = False,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
        kv_slots: int = DEFAULT_KV_SLOTS,
        max_seq_len: int | None = None,
        draft_ahead: int = 0,
        graphs: bool | None = None,
        draft_dtype: torch.dtype | str | None = None,
    ) -> "Engine":
        """Load a target directory and a drafter directory onto `device` (cpu, cuda, cuda:N), checking the manifest.

        tree None: the tree stored beside the drafter for this target (eyas.stored_tree), else TreePolicy().

        dtype None: float32 on CPU; on CUDA the checkpoint's half dtype, else bfloat16 (see resolve_dtype).
        draft_dtype None: the target's, but bfloat16 beside a float32 target on a CPU with bf16 products (the drafter
        only proposes: see resolve_draft_dtype). The KV pool holds `kv_slots` requests of up to
        `max_seq_len` tokens (default: the target's maximum positions). `graphs`: run the forwards of rounds as CUDA
        graphs (None: on CUDA, where the target is dense; runtime/graphs.py).
        """
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device, stored_dtype(target))
        plan = plan_drafter(drafter, target_num_layers(target), feature_layers)
        target_model = TargetModel.from_pretrained(
            target, plan.address, dtype=dtype, device=device, kv_slots=kv_slots, max_seq_len=max_seq_len, graphs=graphs
        )
        manifest = plan.manifest(target_model.fingerprint, allow_manifest_mismatch)
        draft_dtype = resolve_draft_dtype(draft_dtype, dtype, device)
        # bound by reference: a drafter in another dtype binds copies in its own
        embed, lm_head = target_model.embed.to(dtype=draft_dtype), target_model.lm_head.to(dtype=draft_dtype)
        drafter_model, _ = load_drafter(drafter, embed, lm_head)
        if tree is None:
            tree = default_tree(drafter, target_model.fingerprint.weight_digest, tree_setting)
        return cls(target_model, drafter_model.to(device=device, dtype=draft_dtype), manifest, tree, draft_ahead, graphs)

    @classmethod
    def emulated(
        cls,
        profile: Profile | str,
        tree: TreePolicy | dict | str | None = "auto",
        kv_slots: int = DEFAULT_KV_SLOTS,
        max_seq_len: int | None = None,
        draft_ahead: int = 0,
    ) -> "Engine":
        """The timed models of an emulated deployment (`eyas.emulation`, a profile or its name), in one process: the
        target's forwards and the drafter's steps take turns on one device. Token-id prompts only (no tokenizer); for
        benchmarks and capacity planning, never for exactness."""
        profile = profile if isinstance(profile, Profile) else load_profile(profile)
        device = EmulatedDevice()
        target = TimedTarget(profile, device, kv_slots, max_seq_len)
        drafter = SyntheticDrafter(profile.law, profile.draft, device)
        return cls(target, drafter, emulated_manifest(profile), tree, draft_ahead, graphs=False)

    def sessions(self, request: RequestState, wait: bool = False) -> tuple[TargetSession, DraftSession]:
        """A target and a draft session for `request`, each holding a KV slot (waiting for one when `wait`)."""
        target = TargetSession(self.target, wait=wait)
        try:
            return target, DraftSession(self.draft, wait=wait)
        except BaseException:
            target.close()
            raise

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt string (through the target's tokenizer) or a list of token ids, checked against the vocabulary."""
        return tokenize_prompt(prompt, self.target.tokenizer, self.target.vocab_size)

    def eos_token_ids(self) -> frozenset[int]:
        """The target's end-of-sequence ids from its generation config (or tokenizer)."""
        return eos_token_ids(self.target.generation_config, self.target.tokenizer)

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
        capacity = self.target.max_seq_len
        where = f"the KV capacity of {capacity} positions per request"
        prompt_ids = prompt_within(prompt, self.target.tokenizer, self.target.vocab_size, max_new_tokens, capacity, where)
        return RequestState(request_id or f"req-{next(self._ids)}", prompt_ids, sampling, rules, decode=decode)

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
        speculate: bool = True,
    ) -> Generation:
        """Generate up to `max_new_tokens` tokens; greedy when temperature is 0, else exact sampling.

        `speculate=False` decodes plainly, one target forward per token without the drafter; the output is
        the same (a seed fixes the sampled text). `trace` (a file path or an open writer) appends this
        request's rounds to a trace.
        """
        request = self.new_request(prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, stop_at_eos)
        writer = TraceWriter(trace) if isinstance(trace, (str, Path)) else trace
        try:
            return self._run([request], tree, on_round, writer, speculate=speculate)[0]
        finally:
            if writer is not trace:
                writer.close()

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int | Sequence[int] = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | Sequence[int] = 0,
        stop: Sequence[str] = (),
        stop_at_eos: bool = True,
        tree: TreePolicy | dict | str | None = None,
        speculate: bool = True,
    ) -> list[Generation]:
        """Generate for every prompt at once: the requests step in lockstep, so each phase of every round (drafting
        level by level, verification, reseeding) is one batched forward for all of them.

        `max_new_tokens` and `seed` may be given per request. A request's output does not depend on
        its batch-mates. Requests beyond the KV pool's free slots start as slots free. `speculate=False`
        decodes every request plainly, as `generate` does, one batched target forward per token.
        """
        count = len(prompts)
        limits = [max_new_tokens] * count if isinstance(max_new_tokens, int) else list(max_new_tokens)
        seeds = [seed] * count if isinstance(seed, int) else list(seed)
        if len(limits) != count or len(seeds) != count:
            raise RequestError("prompts", f"{count} prompts need as many max_new_tokens and seeds")
        requests = [
            self.new_request(p, m, temperature, top_p, top_k, s, stop, stop_at_eos)
            for p, m, s in zip(prompts, limits, seeds)
        ]
        return self._run(requests, tree, None, None, speculate=speculate, wait=True)

    def _run(
        self,
        requests: list[RequestState],
        tree: TreePolicy | dict | str | None,
        on_round: Callable[[RoundRecord], None] | None,
        writer: TraceWriter | None,
        speculate: bool = True,
        wait: bool = False,
    ) -> list[Generation]:
        """Run `requests` to their ends in lockstep on this thread: at each step the forwards they wait on run as one
        batch per model. A request starts when both KV pools have a free slot for it (the first one also waits for a
        slot when `wait`, else it is refused with KVCapacityError); the first error is raised once all have ended."""
        lockstep = Lockstep(observer=self._observe_forward)
        pending = deque(requests)
        ops: list[Operation] = []
        active = 0

        def finish(op: Operation) -> None:
            nonlocal active
            active -= 1

        def concurrency() -> int:
            return active

        while pending or lockstep.waiting:
            while pending and (not active or self._free_slots(speculate)):
                active += 1
                steps = self._steps(pending.popleft(), tree, on_round, writer, speculate, wait, concurrency)
                ops.append(lockstep.add(steps, finish))
            if lockstep.waiting:
                lockstep.step()
        return results(ops)

    def _free_slots(self, speculate: bool) -> int:
        """Requests that can start now without waiting for a KV slot."""
        free = self.target.pool.free_slots
        return min(free, self.draft.pool.free_slots) if speculate else free

    def _steps(
        self,
        request: RequestState,
        tree: TreePolicy | dict | str | None,
        on_round: Callable[[RoundRecord], None] | None,
        writer: TraceWriter | None,
        speculate: bool,
        wait: bool,
        concurrency: Callable[[], int],
    ) -> Steps[Generation]:
        """One request from its prefill to its end, as an operation; `concurrency()` counts the requests stepping
        together (tree auto chooses per concurrency)."""
        setting = tree_setting(tree) if tree is not None else self.tree
        auto = speculate and setting == "auto"
        policy = PLAIN_POLICY if not speculate else self.tuner.current if auto else setting  # what the trace's header names
        recorder = None
        if writer is not None:
            recorder = RequestRecorder(writer.write, request, policy, self.manifest.id, self.manifest.to_dict(), "local")
        stats = GenerationStats()
        if speculate:
            target, draft = self.sessions(request, wait=wait)
        else:
            target, draft = TargetSession(self.target, wait=wait), NoDraft()
        try:
            started = time.perf_counter()
            yield from start_steps(request, draft, target)
            stats.add_prefill(time.perf_counter() - started)
            while not request.done:
                concurrent = concurrency()
                record = yield from round_steps(request, draft, target, self._policy(concurrent) if auto else policy)
                if auto:
                    with self._tuner_lock:
                        self._tuner.observe(record, concurrent)
                stats.add_round(record)
                if recorder is not None:
                    recorder.local_round(record)
                if on_round is not None:
                    on_round(record)
            if recorder is not None:
                recorder.end(request)
        finally:
            target.close()
            draft.close()
        text = self.target.tokenizer.decode(request.output) if self.target.tokenizer is not None else None
        return Generation(request.output, text, request.finish_reason, stats, request.prompt_ids)

    def _observe_forward(self, runner: object, rows: int, seconds: float, calls: int) -> None:
        """A batched forward of `rows` rows of `calls` calls took `seconds`: tree auto's costs follow what forwards
        cost in rounds."""
        kind = "verify" if runner is self.target else "draft" if runner is self.draft else None
        if kind is not None and self._tuner is not None:
            with self._tuner_lock:
                self._tuner.costs.observe(kind, rows, seconds, calls)

    def _policy(self, concurrent: int) -> TreePolicy:
        tuner = self.tuner
        with self._tuner_lock:
            return tuner.policy(concurrent)
