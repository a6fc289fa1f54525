"""The draft worker: drafter weights (plus only the target's embedding and LM head) and draft KV per request.

Serves Start (seed a session from a prefill), Round (apply the coordinator's word on the last round, draft the next
EAGLE-2 tree, send it on to the request's target worker and answer with its verification) and Reseed. Sessions are
`eyas.proposer.DraftSession`s: the worker adds receipt checks in front of them so that a rejected message changes no
state.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import torch
from google.protobuf.message import DecodeError

from eyas import wire
from eyas.autotree import measure_draft
from eyas.drafters import load_drafter
from eyas.emulation import EmulatedDevice, SyntheticDrafter, emulated_manifest, load_profile
from eyas.errors import VersionError
from eyas.manifest import fingerprint_target
from eyas.pairing import load_embedding_and_head, plan_drafter, target_num_layers
from eyas.runtime.device import resolve_draft_dtype, resolve_dtype, stored_dtype
from eyas.proposer import DraftModel, DraftSession
from eyas.runtime.batch import Operation
from eyas.steps import Steps
from eyas.rpc import call_metadata, field_of
from eyas.tree import FlattenedTree, TreeError, TreePolicy
from eyas.v1 import round_pb2 as pb
from eyas.v1 import tensor_pb2 as tpb

from .errors import STATUS_CODES, ServiceError
from .limits import MAX_ID_BYTES, MAX_ROUND_ID_BYTES
from .server import CHANNEL_OPTIONS, Clock
from .streams import BatchStream, StreamEnded
from .worker import Served, Worker

PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def target_field(field: str) -> str:
    """The field a refusal by the target behind this worker names, as this worker's own refusal names it."""
    return f"target.{field}" if field else "target"


@dataclass
class Drafted:
    """A Round's tree, drafted and on its way to the target: the bytes sent, and what the reply will carry."""

    ref: tpb.RequestRef
    target: str
    tree: FlattenedTree
    verify_request: bytes
    proposal: pb.Proposal
    with_features: bool  # the reply's verification keeps its accepted rows' features
    policy: TreePolicy
    next: Future | None  # with `draft_next`: settles once the request's next call may run (`draft_next`)


@dataclass(frozen=True)
class Relayed:
    """A verification this worker relayed: what the coordinator's word on its round may publish."""

    round_id: str
    version: int
    accepted_rows: tuple[int, ...]
    tokens: tuple[int, ...]  # the accepted tokens, then the frontier token
    features: torch.Tensor  # [len(accepted_rows), F]


class DraftWorker(Worker):
    """Ray actor: one drafter, a DraftSession per request, served over gRPC (service eyas.v1.DraftWorker)."""

    role = "draft"
    service = "DraftWorker"
    batched = ("Round",)

    def __init__(self, spec):
        super().__init__(spec)
        self.relayed: dict[str, Relayed] = {}  # request id -> the last verification relayed for it
        self._targets: dict[str, grpc.aio.Channel] = {}  # target address -> a channel to it (prefills)
        self._streams: dict[str, BatchStream] = {}  # target address -> the stream its Verify batches go on
        self._credential = call_metadata(spec.token)
        self._next: dict[str, Future] = {}  # request id -> its last Round's `Drafted.next`, until `followup` takes it

    def forget(self, request_id: str) -> None:
        self.relayed.pop(request_id, None)

    def load(self) -> None:
        spec = self.spec
        if spec.emulate:
            profile = load_profile(spec.emulate)
            self.manifest = emulated_manifest(profile)
            self.drafter = SyntheticDrafter(profile.law, profile.draft, EmulatedDevice())
            self.vocab_size, self.feature_width, self.max_positions = profile.law.vocab, profile.feature_width, profile.max_positions
        else:
            self._load_drafter()
        self.model = DraftModel(self.drafter, spec.kv_slots, self.max_positions, spec.draft_ahead, self._draft_ahead)
        if spec.draft_ahead:  # how many trees drafting ahead grows together first follows this device's step costs
            self.model.ahead_curve = self.measure()

    def _load_drafter(self) -> None:
        """The drafter checkpoint, bound to the target's embedding and LM head (only those of the target are read)."""
        spec = self.spec
        plan = plan_drafter(spec.drafter, target_num_layers(spec.target), spec.feature_layers)
        config = json.loads(Path(spec.target, "config.json").read_text())
        self.manifest = plan.manifest(fingerprint_target(spec.target, config), spec.allow_manifest_mismatch)
        dtype = resolve_draft_dtype(spec.draft_dtype, resolve_dtype(spec.dtype, self.device, stored_dtype(spec.target)), self.device)
        embed, lm_head = load_embedding_and_head(spec.target)
        embed, lm_head = embed.to(self.device, dtype), lm_head.to(self.device, dtype)  # bound by reference: cast here
        drafter, _ = load_drafter(spec.drafter, embed, lm_head)
        self.drafter = drafter.to(device=self.device, dtype=dtype)
        self.vocab_size = int(embed.weight.shape[0])
        self.feature_width = self.manifest.feature.width(int(embed.weight.shape[1]))
        self.max_positions = int((config.get("text_config") or config).get("max_position_embeddings", 0))

    def _draft_ahead(self, steps: Steps[None], priority: Callable[[], str]) -> Future:
        """A session's drafting ahead runs on the compute thread in the steps no call waits for, while it is a guess
        (`Lockstep`: it never widens a batch that requests wait on); once the verification it guesses at is relayed,
        it finishes the decided outcome's tree (which the request's next call waits for: `followup`) or ends."""
        settled: Future = Future()

        def ended(submitted: "Future[Operation]") -> None:
            op = submitted.result()
            if op.error is not None:
                settled.set_exception(op.error)
            else:
                settled.set_result(None)

        self.scheduler.submit(steps, priority).add_done_callback(ended)
        return settled

    def followup(self, request_id: str) -> Future | None:
        """A Round with `draft_next`: its `Drafted.next`; else the session's drafting ahead."""
        then = self._next.pop(request_id, None)
        if then is not None:
            return then
        session = self.sessions.get(request_id)
        return None if session is None else session.ahead_job

    def draft_next(self, drafted: Drafted, relayed: Relayed | None) -> None:
        """Once the session's drafting ahead has ended: when the round's verification (`relayed`) decided an outcome no
        tree was drafted ahead for, draft that outcome's tree now (`DraftSession.draft_decided`), so that the next
        Round finds it rather than drafting after the coordinator's word; then settle `drafted.next`. A draft that
        fails changes nothing the next Round does not redo (and the Round reports the failure)."""
        then, request_id = drafted.next, drafted.ref.request_id
        session = self.sessions.get(request_id)

        def start(_=None) -> None:
            try:
                gone = self.sessions.get(request_id) is not session
                if relayed is None or gone or session.has_ahead(relayed.version, relayed.tokens, drafted.policy):
                    then.set_result(None)
                    return
                steps = session.draft_decided(relayed.version, relayed.features, list(relayed.tokens), drafted.policy)
                self.scheduler.submit(steps).add_done_callback(lambda _: then.set_result(None))
            except BaseException:  # the request's next call must not wait for ever
                if not then.done():
                    then.set_result(None)
                raise

        if then is None:
            return
        if session is None or session.ahead_job is None:
            start()
        else:
            session.ahead_job.add_done_callback(start)

    def interrupt(self, request_id: str) -> None:
        """The request's next call means its round was decided: its drafting ahead stops at the next drafter step."""
        session = self.sessions.get(request_id)
        if session is not None:
            session.interrupt_ahead()

    def endpoints(self) -> dict:
        return {"Start": (pb.DraftStart, self.start_session), "Round": (pb.RoundRequest, self.round), "Reseed": (pb.Reseed, self.reseed)}

    def measure(self) -> tuple[list[int], list[float]]:
        return measure_draft(self.model)

    def session_kv_bytes(self, session: DraftSession) -> int:
        pending = session.pending_features
        return session.kv_bytes() + (pending.numel() * pending.element_size() if pending is not None else 0)

    def _features(self, msg: pb.Reseed | pb.DraftStart, field: str) -> tuple[torch.Tensor, list[int]]:
        # a reseed carries the accepted tokens and the frontier token: at most the tree depth plus one
        limit = self.spec.tree_limit.depth + 1 if isinstance(msg, pb.Reseed) else None
        tokens = self.check_tokens(msg.tokens, f"{field}tokens", limit)
        if isinstance(msg, pb.Reseed) and not tokens:
            raise wire.WireError(f"{field}tokens", "a reseed carries at least the frontier token")
        return wire.features_from_proto(msg.features, f"{field}features", len(tokens), self.feature_width), tokens

    def start_session(self, msg: pb.DraftStart, clock: Clock) -> Steps[pb.Ack]:
        """Seed a new session from the target's features of the committed tokens (the drafter's prefill)."""
        self.new_session(msg.ref)
        features, tokens = self._features(msg, "")
        clock.lap("decode")
        session = DraftSession(self.model)
        try:
            yield from session.start_steps(msg.ref.version, features, tokens)
        except BaseException:
            session.close()
            raise
        self.sessions[msg.ref.request_id] = session
        clock.lap("compute")
        return pb.Ack(ref=msg.ref)

    def round(self, msg: pb.RoundRequest, clock: Clock) -> Steps[Drafted]:
        """Apply the coordinator's word on the previous round (a reseed from the verification this worker relayed),
        then draft the tree that builds on msg.draft.ref.version; `relay` sends it on to the target."""
        ask = msg.draft
        session = self.session(ask.ref)
        if ask.HasField("assumed"):
            raise ServiceError(grpc.StatusCode.UNIMPLEMENTED, "draft.assumed", "this worker does not draft ahead for an assumed outcome")
        if not ask.HasField("policy"):
            raise wire.WireError("draft.policy", "is missing")
        policy = wire.policy_from_proto(ask.policy, "draft.policy")
        self.check_policy(policy, "draft.policy.")
        root = self.check_tokens([ask.root_token], "draft.root_token")[0]
        if not msg.round_id or len(msg.round_id.encode()) > MAX_ROUND_ID_BYTES:
            raise wire.WireError("round_id", f"must be 1 to {MAX_ROUND_ID_BYTES} bytes")
        if not msg.target or len(msg.target) > MAX_ID_BYTES:
            raise wire.WireError("target", f"must name the request's target worker in 1 to {MAX_ID_BYTES} bytes")
        wire.sampling_from_proto(msg.sampling)  # refused here, before anything changes
        expected, reseed, commit = session.version, None, None
        if msg.HasField("publish"):
            reseed, commit = self._published(ask.ref, msg.publish, root)
            expected = msg.publish.ref.version + 1
        if ask.ref.version != expected:
            raise VersionError("draft cache", expected, ask.ref.version)
        clock.lap("decode")
        if reseed is not None:
            session.reseed(*reseed)
        proposal = yield from session.propose_steps(ask.ref.version, root, policy)
        clock.lap("compute")
        verify = pb.VerifyRequest(
            ref=ask.ref, tree=wire.proposed_tree_to_proto(proposal, ask.ref), sampling=msg.sampling, round_id=msg.round_id, commit=commit
        )
        proposed = wire.proposal_to_proto(proposal, ask.ref, ask.with_records)
        drafted = Drafted(
            ask.ref, msg.target, proposal.tree, verify.SerializeToString(), proposed, msg.with_features, policy,
            Future() if msg.draft_next else None,
        )
        if drafted.next is not None:
            self._next[ask.ref.request_id] = drafted.next
        clock.lap("encode")
        return drafted

    def _published(self, ref: tpb.RequestRef, word: pb.Publish, root: int) -> tuple[tuple, pb.Commit]:
        """The reseed and the target's commit that the coordinator's word names: the accepted rows, tokens and features
        of the verification this worker relayed for that round."""
        self.same_request(ref, word.ref, "publish.ref")
        relayed = self.relayed.get(ref.request_id)
        if relayed is None or relayed.round_id != word.round_id or relayed.version != word.ref.version:
            raise ServiceError(PRECONDITION, "publish.round_id", "names no round whose verification this worker relayed for the request")
        if tuple(word.accepted_rows) != relayed.accepted_rows or tuple(word.tokens) != relayed.tokens:
            raise wire.WireError("publish.tokens", "the word differs from the verification this worker relayed")
        if word.tokens[-1] != root:
            raise TreeError("draft.root_token", f"{root} is not the frontier token {word.tokens[-1]} of the published round")
        commit = pb.Commit(ref=word.ref, accepted_rows=word.accepted_rows, round_id=word.round_id)
        return (word.ref.version, relayed.features, list(word.tokens)), commit

    async def gather(self, method: str, calls: list[tuple[pb.DraftStart, Served]]) -> None:
        """A Start naming the request's target has it prefill the committed tokens; the features seed the drafter."""
        if method == "Start":
            await asyncio.gather(*(self._prefill_at(msg, call) for msg, call in calls if msg.target))

    async def _prefill_at(self, msg: pb.DraftStart, call: Served) -> None:
        if len(msg.target) > MAX_ID_BYTES:
            call.fail(wire.WireError("target", f"must name the request's target worker in 1 to {MAX_ID_BYTES} bytes"))
            return
        if msg.HasField("features") or len(msg.prefill) != len(msg.tokens) or list(msg.prefill[1:]) != list(msg.tokens[:-1]):
            call.fail(wire.WireError("prefill", "with a target, a Start carries no features and prefills the tokens before each of `tokens`"))
            return
        try:
            raw = await self._target(msg.target, "Prefill")(
                pb.Prefill(ref=msg.ref, tokens=msg.prefill).SerializeToString(), timeout=self.spec.rpc_timeout_s, metadata=self._credential
            )
            reply = pb.PrefillReply.FromString(raw)
            if reply.ref != msg.ref:
                raise wire.WireError("ref", "the target's prefill names another request or version")
        except grpc.RpcError as exc:
            call.fail(ServiceError(exc.code(), target_field(field_of(exc.trailing_metadata())), f"the target worker at {msg.target}: {exc.details()}"))
            return
        except (DecodeError, wire.WireError) as exc:
            call.fail(ServiceError(grpc.StatusCode.INTERNAL, "target", f"the target worker at {msg.target} answered no prefill: {exc}"))
            return
        call.clock.skip()  # the wait on the target
        msg.features.CopyFrom(reply.features)

    async def relay(self, method: str, served: list[Served]) -> None:
        """Send each drafted tree on to its target worker (one Batch per target) and answer each Round with the
        verification, after checking it against the tree as a receipt."""
        if method != "Round":
            return
        targets: dict[str, list[Served]] = {}
        for call in served:
            if call.error is None:
                targets.setdefault(call.reply.target, []).append(call)
        ends = await asyncio.gather(*(self._verify_at(address, calls) for address, calls in targets.items()), return_exceptions=True)
        for end in ends:  # every target's calls are settled before an unexpected error goes on
            if isinstance(end, BaseException):
                raise end

    async def _verify_at(self, address: str, calls: list[Served]) -> None:
        drafted = [call.reply for call in calls]
        decided: dict[int, Relayed] = {}  # call index -> the verification relayed for it
        try:
            await self._relay_to(address, calls, decided)
        finally:  # the next tree waits for the reply to leave: drafting it would hold this process's GIL meanwhile
            for i, (call, round_drafted) in enumerate(zip(calls, drafted)):
                call.then = partial(self.draft_next, round_drafted, decided.get(i))

    async def _relay_to(self, address: str, calls: list[Served], decided: dict[int, "Relayed"]) -> None:
        batch = pb.CallBatch(method="Verify", calls=[call.reply.verify_request for call in calls])
        if address not in self._streams:
            self._streams[address] = BatchStream(address, pb.DESCRIPTOR.services_by_name["TargetWorker"].full_name, self._credential)
        try:
            results = (await self._streams[address].call(batch, self.spec.rpc_timeout_s)).results
        except StreamEnded as ended:
            for call in calls:
                call.fail(ServiceError(ended.code, target_field(ended.field), f"the target worker at {address}: {ended.details}"))
            return
        if len(results) != len(calls):
            for call in calls:
                call.fail(ServiceError(grpc.StatusCode.INTERNAL, "target.results", f"{len(results)} results for {len(calls)} calls from {address}"))
            return
        for i, (call, result) in enumerate(zip(calls, results)):
            call.clock.skip()  # the wait on the target: its own phases come back in the reply
            if result.code:
                call.fail(ServiceError(STATUS_CODES.get(result.code, grpc.StatusCode.UNKNOWN), target_field(result.field), result.details))
                continue
            drafted: Drafted = call.reply
            try:
                relayed, answer = self._receive(drafted, result.reply)
                self.relayed[drafted.ref.request_id] = decided[i] = relayed
            except (DecodeError, wire.WireError, TreeError) as exc:
                field = getattr(exc, "field", "message")
                call.fail(ServiceError(grpc.StatusCode.INTERNAL, f"target.{field}", f"the target's verification fails its receipt check: {exc}"))
                continue
            session = self.sessions.get(drafted.ref.request_id)
            if session is not None:  # drafting ahead stops guessing: this is the outcome the next round builds on
                session.decide_ahead(relayed.tokens[:-1], relayed.tokens[-1])
            call.clock.lap("decode")
            call.reply = pb.RoundReply(
                ref=drafted.ref, proposal=drafted.proposal, verify_request=drafted.verify_request, verification=answer,
                target_seconds=result.seconds, target_forwards=result.forwards,
            )

    def _receive(self, drafted: Drafted, data: bytes) -> tuple[Relayed, bytes]:
        """A target's verification of `drafted`, checked against its tree: what the coordinator's word may publish, and
        the verification to answer with (its accepted rows' features left out unless asked for: only this worker
        reads them, and they are most of its bytes)."""
        msg = pb.Verification.FromString(data)
        if msg.ref != drafted.ref or msg.decision.ref != drafted.ref:
            raise wire.WireError("ref", "the verification names another request or version than the tree")
        verification = wire.verification_from_proto(msg, self.feature_width)
        wire.validate_verification(verification, drafted.tree, self.vocab_size)
        decision = verification.decision
        tokens = (*decision.accepted_tokens, decision.frontier_token)
        relayed = Relayed(msg.round_id, drafted.ref.version, tuple(decision.accepted_rows), tokens, verification.features)
        if drafted.with_features:
            return relayed, data
        msg.decision.ClearField("accepted_features")
        return relayed, msg.SerializeToString()

    def _target(self, address: str, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        """`method` of the target worker at `address`, over a channel kept for it."""
        if address not in self._targets:
            self._targets[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self._targets[address].unary_unary(f"/{pb.DESCRIPTOR.services_by_name['TargetWorker'].full_name}/{method}")

    def reseed(self, msg: pb.Reseed, clock: Clock) -> pb.Ack:
        """The draft side of a publish, sent on its own."""
        session = self.session(msg.ref)
        features, tokens = self._features(msg, "")
        clock.lap("decode")
        session.reseed(msg.ref.version, features, tokens)
        clock.lap("compute")
        return pb.Ack(ref=msg.ref)
