"""Replaying a trace: rebuild each request from its prompt and re-verify every recorded tree against the target.

Each recorded tree is verified by the engine's own `TargetSession` on top of the committed prefix,
sampling with the request's recorded options (the seed keys the noise of every position), and published with the engine's transaction; with a drafter, the drafter
also proposes each round again and its tree is compared with the recorded one. The first difference
per request is reported (request, round, node, expected and actual token and probability), next to
the model-free invariant checks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from eyas.drafters import Drafter
from eyas.errors import RequestError
from eyas.proposer import DraftModel, DraftSession
from eyas.publish import publish
from eyas.request import RequestState, StopRules, make_sampling
from eyas.rounds import start
from eyas.steps import Steps, without_forwards
from eyas.target import TargetModel, TargetSession
from eyas.trace.compare import Difference, Label, decision_difference, tree_difference
from eyas.trace.invariants import Violation, check_trace
from eyas.trace.messages import decode_round
from eyas.trace.store import Trace, TracedRequest
from eyas.tree import TreePolicy, validate_tree
from eyas.wire import WireError, tree_from_proto

TOLERANCE = 1e-6  # largest probability difference still called identical; bit-for-bit is reported separately


@dataclass(frozen=True)
class Divergence:
    request: str
    round: int | None
    difference: Difference
    offset: int = -1

    def __str__(self) -> str:
        where = f"request {self.request}" + (f", round {self.round}" if self.round is not None else "")
        return f"{where}, {self.difference}"


@dataclass
class ReplayReport:
    """Rounds re-verified, the first divergence of each request, broken invariants, the largest probability gap."""

    requests: int = 0
    rounds: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    largest_gap: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.divergences and not self.violations

    @property
    def bit_exact(self) -> bool:
        return self.identical and self.largest_gap == 0.0

    def lines(self) -> list[str]:
        """The report in words: notes, violations, divergences, then the verdict."""
        out = [f"note: {n}" for n in self.notes]
        out += [f"invariant broken: {v}" for v in self.violations]
        out += [f"divergence: {d}" for d in self.divergences]
        what = f"{self.requests} requests, {self.rounds} rounds re-verified"
        if self.identical:
            how = "bit for bit" if self.bit_exact else f"probabilities within {self.largest_gap:.2g}"
            out.append(f"identical: {what} ({how})")
        elif self.divergences:
            out.append(f"first divergence: {self.divergences[0]}  [{what}]")
        else:
            out.append(f"invariants broken: {len(self.violations)}  [{what}]")
        return out


class _Unseeded:
    """The draft side when only the target replays: the publish transaction has nothing to reseed."""

    def start_steps(self, version: int, features: torch.Tensor, tokens: list[int]) -> Steps[None]:
        return without_forwards(lambda: None)

    def reseed(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        pass


def rebuild_request(request: TracedRequest, decode: Callable[[list[int]], str] | None = None) -> RequestState:
    """The committed state a traced request began with; raises RequestError naming what the record lacks."""
    begin = request.start
    if begin is None:
        raise RequestError("request", "the trace has no request record for these rounds")
    try:
        stop = StopRules(
            begin.stop["max_new_tokens"], frozenset(begin.stop["eos_token_ids"]), tuple(begin.stop["stop_strings"])
        )
        return RequestState(begin.request, list(begin.prompt_ids), make_sampling(**begin.sampling), stop, decode=decode)
    except (KeyError, TypeError) as exc:
        raise RequestError("request", f"the request record is incomplete ({exc!r})") from None


def replay_request(
    request: TracedRequest,
    target: TargetModel,
    drafter: Drafter | None,
    report: ReplayReport,
    tolerance: float = TOLERANCE,
    label: Label = str,
    on_round: Callable[[], object] = lambda: None,
) -> Divergence | None:
    """Re-verify one request's rounds in order (`on_round` after each); the first divergence stops it."""
    decode = target.tokenizer.decode if target.tokenizer is not None else None
    try:
        state = rebuild_request(request, decode)
    except RequestError as exc:
        return Divergence(request.key, None, Difference("request", None, "a request record", str(exc)))
    session = TargetSession(target)
    draft = DraftSession(DraftModel(drafter, 1, target.max_seq_len)) if drafter is not None else _Unseeded()
    start(state, draft, session)
    for rnd in request.rounds:

        def diverged(difference: Difference) -> Divergence:
            return Divergence(request.key, rnd.round, difference, rnd.offset)

        if rnd.version != state.version:
            return diverged(Difference("version", None, f"version {state.version}", f"version {rnd.version} recorded"))
        try:
            _, recorded, tree_msg, _ = decode_round(rnd)
            tree = tree_from_proto(tree_msg)
        except WireError as exc:
            return diverged(Difference("messages", None, "decodable messages", str(exc)))
        if drafter is not None:
            try:
                proposal = draft.propose(state.version, state.root_token, TreePolicy.from_dict(rnd.policy))
            except ValueError as exc:
                return diverged(Difference("redraft", None, "a proposal under the recorded policy", str(exc)))
            difference, gap = tree_difference(tree.rows(), proposal.tree.rows(), tolerance, label)
            report.largest_gap = max(report.largest_gap, gap)
            if difference is not None:
                return diverged(difference)
        try:
            validate_tree(tree, vocab_size=target.vocab_size, prefix_len=session.committed)
            verification = session.verify(tree, state.version, state.sampling)
        except ValueError as exc:
            return diverged(Difference("tree", None, "a tree that fits the committed prefix", str(exc)))
        difference, gap = decision_difference(tree.rows(), recorded, verification.decision, tolerance, label)
        report.largest_gap = max(report.largest_gap, gap)
        if difference is not None:
            return diverged(difference)
        emitted = publish(state, verification.decision, verification.features, session, draft)
        if emitted != rnd.emitted:
            return diverged(Difference("emitted tokens", None, str(rnd.emitted), str(emitted)))
        report.rounds += 1
        on_round()
    return None


def replay_trace(
    trace: Trace,
    target: TargetModel,
    drafter: Drafter | None = None,
    tolerance: float = TOLERANCE,
    label: Label = str,
    progress: bool = False,
) -> ReplayReport:
    """Check every invariant, then replay every request (redrafting when a drafter is given); `progress` shows a bar of
    rounds replayed on stderr."""
    requests = trace.requests
    report = ReplayReport(requests=len(requests), violations=check_trace(requests))
    report.notes += [f"{trace.path}: {p}" for p in trace.problems]
    report.notes += manifest_notes(requests, target)
    if drafter is not None and drafter.dtype != target.runtime.dtype:
        names = [str(dtype).removeprefix("torch.") for dtype in (drafter.dtype, target.runtime.dtype)]
        report.notes.append(
            f"the drafter runs in {names[0]} beside a {names[1]} target: it rounds the target's features, whose last bits "
            "differ between a batched and a lone forward, so a tree drafted beside batch-mates may be redrafted otherwise "
            "where candidates nearly tie; a float32 drafter (models.draft_dtype, --draft-dtype) on both sides redrafts it as recorded"
        )
    with tqdm(total=sum(len(r.rounds) for r in requests), unit="round", file=sys.stderr, disable=not progress, desc="eyas replay") as bar:
        for request in requests:
            divergence = replay_request(request, target, drafter, report, tolerance, label, lambda: bar.update(1))
            if divergence is not None:
                report.divergences.append(divergence)
    return report


def manifest_notes(requests: list[TracedRequest], target: TargetModel) -> list[str]:
    """Where the replay target differs from the target each request's manifest names (when it names one)."""
    notes = []
    if target.fingerprint is None:
        return notes
    actual = asdict(target.fingerprint)
    for request in requests:
        manifest = request.start.manifest if request.start is not None else None
        recorded = manifest.get("target") if isinstance(manifest, dict) else None
        if not isinstance(recorded, dict):
            continue
        differing = sorted(k for k in actual if recorded.get(k) != actual[k])
        if differing:
            notes.append(f"request {request.key} was recorded on another target (differs in {', '.join(differing)})")
    return notes
