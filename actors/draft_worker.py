"""The draft worker: drafter weights (plus only the target's embedding and LM head) and draft KV per request.

Serves Start (seed a session from a prefill), Round (apply the coordinator's word on the last round, draft the next
EAGLE-2 tree, send it on to the request's target worker and answer with its verification) and Reseed. A Round that
promises the next one (`next_round_id`) has that round's tree sent to the target as soon as its own verification is
relayed, or, where its tree went alone, the trees drafted ahead for it offered to the target while it is verified; the
next Round relays the answer (docs/wire.md, "Rounds"). Sessions are `eyas.proposer.DraftSession`s: the worker adds
receipt checks in front of them so that a rejected message changes no state.
"""

from __future__ import annotations

import asyncio
import json
import time
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
from eyas.proposer import DraftModel, DraftSession, Grown, ahead_key
from eyas.rounds import Proposal
from eyas.runtime.batch import Operation
from eyas.steps import Steps
from eyas.rpc import call_metadata, field_of
from eyas.tree import FlattenedTree, TreeError, TreePolicy
from eyas.v1 import round_pb2 as pb
from eyas.v1 import tensor_pb2 as tpb

from .errors import STATUS_CODES, ServiceError
from .limits import MAX_ID_BYTES, MAX_ROUND_ID_BYTES
from .server import CHANNEL_OPTIONS, Clock
from .streams import BatchStream, StreamEnded, status_code
from .worker import Served, Worker

PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def target_field(field: str) -> str:
    """The field a refusal by the target behind this worker names, as this worker's own refusal names it."""
    return f"target.{field}" if field else "target"


def check_promised(msg: pb.RoundRequest, promise: pb.RoundRequest) -> None:
    """A Round whose tree was sent ahead must ask for that tree: a Round that differs names the field it differs in."""
    if not msg.HasField("publish"):
        raise ServiceError(PRECONDITION, "publish", "is missing: the tree sent ahead carries the commit the word names")
    ask, asked = msg.draft, promise.draft
    for field, got, want in (
        ("round_id", msg.round_id, promise.round_id),
        ("draft.ref", ask.ref, asked.ref),
        ("draft.root_token", ask.root_token, asked.root_token),
        ("draft.policy", ask.policy, asked.policy),
        ("draft.with_records", ask.with_records, asked.with_records),
        ("sampling", msg.sampling, promise.sampling),
        ("target", msg.target, promise.target),
        ("with_features", msg.with_features, promise.with_features),
    ):
        if got != want:
            raise ServiceError(PRECONDITION, field, "differs from the Round the last one promised, whose tree went to the target")


@dataclass
class Drafted:
    """A Round's tree, drafted and on its way to the target: the Round (as served, or as promised by the Round before
    it), the bytes sent, and what the reply will carry."""

    request: pb.RoundRequest
    tree: FlattenedTree
    verify_request: bytes
    proposal: pb.Proposal
    policy: TreePolicy
    next: Future | None = None  # with `draft_next`: settles once the request's next call may run (`draft_next`)
    answer: asyncio.Future | None = None  # sent ahead of its Round: the target's CallResult, or the StreamEnded
    sent_at: float | None = None  # sent ahead: when it left (`time.perf_counter`)
    offer: "Offer | None" = None  # the next round's trees, offered to the target after it (`offer_ahead`)

    @property
    def ref(self) -> tpb.RequestRef:
        return self.request.draft.ref

    @property
    def target(self) -> str:
        return self.request.target


@dataclass
class Offer:
    """The trees drafted ahead for the outcomes of a tree being verified, sent after it as the next round's Verify
    `options` (docs/wire.md, "Rounds", step 8): the target verifies the one for the outcome it decides."""

    outcomes: dict[tuple, Grown]  # `ahead_key` -> the tree offered for that outcome
    verify_request: bytes
    written: asyncio.Future  # settles once the Verify is on its way, or lost before
    answer: asyncio.Future  # the target's CallResult, or the StreamEnded that lost it
    sent_at: float | None = None  # when it left (`time.perf_counter`); None: it never did


class Outbox:
    """The next round's trees of one relayed batch: sent to their target as one batch once each call has drafted its
    own or given up, so that they share the target's forwards as the batch before them did. Once they are on their
    way, their sessions' drafting ahead starts (it would hold this process's GIL while they are sent) and then the
    requests' next calls may run (so that a call after the next Round finds the drafting ahead to wait for)."""

    def __init__(self, worker: "DraftWorker", address: str, count: int):
        self.worker, self.address, self.left = worker, address, count
        self.loop = asyncio.get_running_loop()
        self.trees: list[Drafted] = []
        self.sessions: list[DraftSession] = []  # the trees' sessions
        self.thens: list[Future] = []

    def add(self, session: DraftSession, drafted: Drafted | None, then: Future) -> None:
        """One call's tree (None: it sends none), and what settles once it is sent. Safe from any thread."""
        self.loop.call_soon_threadsafe(self._add, session, drafted, then)

    def _add(self, session: DraftSession, drafted: Drafted | None, then: Future) -> None:
        if drafted is not None and self.worker.sessions.get(drafted.ref.request_id) is session:
            drafted.answer = self.loop.create_future()
            self.worker.sent[drafted.ref.request_id] = drafted
            self.trees.append(drafted)
            self.sessions.append(session)
        self.thens.append(then)
        self.left -= 1
        if self.left:
            return
        if len(self.trees) == 1:  # on its way alone: the trees drafted ahead beside it may be offered after it
            self.worker.offerable[self.trees[0].ref.request_id] = self.trees[0]
        if self.trees:
            self.loop.create_task(self.worker.send_ahead(self.address, self.trees, self.sent))
        else:
            self.sent()

    def sent(self) -> None:
        for session in self.sessions:
            session.start_ahead()
        for then in self.thens:
            then.set_result(None)


@dataclass(frozen=True)
class Relayed:
    """A verification this worker relayed: what the coordinator's word on its round may publish."""

    round_id: str
    version: int
    accepted_rows: tuple[int, ...]
    tokens: tuple[int, ...]  # the accepted tokens, then the frontier token
    features: torch.Tensor  # [len(accepted_rows), F]


def promise_after(drafted: Drafted, relayed: Relayed) -> tuple[pb.RoundRequest, pb.Commit]:
    """The Round that `drafted`'s Round promised (`next_round_id`), after the outcome `relayed`, and the commit its
    word must name."""
    asked = drafted.request
    ref = wire.ref(drafted.ref.request_id, relayed.version + 1, drafted.ref.manifest_id)
    ask = pb.DraftRequest(ref=ref, root_token=relayed.tokens[-1], policy=asked.draft.policy, with_records=asked.draft.with_records)
    promise = pb.RoundRequest(
        draft=ask, sampling=asked.sampling, round_id=asked.next_round_id, target=asked.target, with_features=asked.with_features
    )
    return promise, pb.Commit(ref=drafted.ref, accepted_rows=relayed.accepted_rows, round_id=relayed.round_id)


def encoded(msg: pb.RoundRequest, proposal: Proposal, policy: TreePolicy, commit: pb.Commit | None) -> Drafted:
    """The Round's proposed tree, as the Verify that sends it to the target with `commit`."""
    ask = msg.draft
    verify = pb.VerifyRequest(
        ref=ask.ref, tree=wire.proposed_tree_fields(proposal, ask.ref), sampling=msg.sampling, round_id=msg.round_id, commit=commit
    )
    return Drafted(msg, proposal.tree, verify.SerializeToString(), wire.proposal_to_proto(proposal, ask.ref, ask.with_records), policy)


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
        self.sent: dict[str, Drafted] = {}  # request id -> its next round's tree, sent to the target before the Round
        self.offerable: dict[str, Drafted] = {}  # request id -> its tree on its way alone, until relayed (`offer_ahead`)

    def forget(self, request_id: str) -> None:
        self.relayed.pop(request_id, None)
        self.sent.pop(request_id, None)
        self.offerable.pop(request_id, None)

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
            self.loop.call_soon_threadsafe(self.offer_ahead)

        self.scheduler.submit(steps, priority).add_done_callback(ended)
        return settled

    def followup(self, request_id: str) -> Future | None:
        """A Round with `draft_next`: its `Drafted.next`; else the session's drafting ahead."""
        then = self._next.pop(request_id, None)
        if then is not None:
            return then
        session = self.sessions.get(request_id)
        return None if session is None else session.ahead_job

    def draft_next(self, drafted: Drafted, relayed: Relayed | None, outbox: Outbox) -> None:
        """Once the session's drafting ahead has ended, the tree of the outcome the round's verification (`relayed`)
        decided. With the next Round promised (`next_round_id`): that Round's tree (`promised`), sent to the target
        with the outbox. Else, when no tree was drafted ahead for the outcome, that tree drafted now
        (`DraftSession.draft_decided`), so that the next Round finds it rather than drafting after the coordinator's
        word. Then `drafted.next` settles. A draft that fails changes nothing the next Round does not redo (and the
        Round reports the failure)."""
        then, request_id = drafted.next, drafted.ref.request_id
        session = self.sessions.get(request_id)
        ahead = bool(drafted.request.next_round_id)

        def settle(done: "Future[Operation] | None" = None) -> None:
            if ahead:
                outbox.add(session, None if done is None else done.result().result, then)
            else:
                then.set_result(None)

        def start(_=None) -> None:
            gone = self.sessions.get(request_id) is not session
            if relayed is None or gone or not ahead and session.has_ahead(relayed.version, relayed.tokens, drafted.policy):
                return settle()
            if ahead:
                steps = self.promised(session, drafted, relayed)
            else:
                steps = session.draft_decided(relayed.version, relayed.features, list(relayed.tokens), drafted.policy)
            try:
                submitted = self.scheduler.submit(steps)
            except BaseException:  # the request's next call must not wait for ever
                settle()
                raise
            submitted.add_done_callback(settle)

        if then is None:
            return
        if session is None or session.ahead_job is None:
            start()
        else:
            session.ahead_job.add_done_callback(start)

    def interrupt(self, request_id: str, method: str) -> None:
        """The request's next call means its round was decided: its drafting ahead stops at the next drafter step
        (unless the call is the Round whose tree was sent ahead: that drafting guesses at the tree's verification,
        still to come)."""
        session = self.sessions.get(request_id)
        if session is not None and not (method == "Round" and request_id in self.sent):
            session.interrupt_ahead()

    def close_session(self, session: DraftSession) -> None:
        """On the compute thread, which a drafting ahead in flight needs to stop: the slot returns once it has."""
        session.close(wait=False)

    def endpoints(self) -> dict:
        return {"Start": (pb.DraftStart, self.start_session), "Round": (pb.RoundRequest, self.round), "Reseed": (pb.Reseed, self.reseed)}

    def measure(self) -> tuple[list[int], list[float]]:
        return measure_draft(self.model)

    def session_kv_bytes(self, session: DraftSession) -> int:
        return session.kv_bytes() + sum(f.numel() * f.element_size() for f in session.pending_features)

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
        sent = self.sent.get(ask.ref.request_id)
        if sent is not None:
            check_promised(msg, sent.request)
        clock.lap("decode")
        if sent is not None:  # its reseed applied, its tree went to the target once the last outcome was relayed
            drafted = self.sent.pop(ask.ref.request_id)
            drafted.request = msg
        else:
            if reseed is not None:
                session.reseed(*reseed)
            drafted = yield from self._draft(session, msg, policy, commit, clock)
        if msg.draft_next:
            drafted.next = self._next[ask.ref.request_id] = Future()
        return drafted

    def _draft(
        self, session: DraftSession, msg: pb.RoundRequest, policy: TreePolicy, commit: pb.Commit | None, clock: Clock, start_ahead: bool = True
    ) -> Steps[Drafted]:
        """The Round's tree, and the Verify that sends it to the target with `commit`."""
        proposal = yield from session.propose_steps(msg.draft.ref.version, msg.draft.root_token, policy, start_ahead)
        clock.lap("compute")
        drafted = encoded(msg, proposal, policy, commit)
        clock.lap("encode")
        return drafted

    def promised(self, session: DraftSession, drafted: Drafted, relayed: Relayed) -> Steps[Drafted | None]:
        """The Round `drafted`'s Round promised, drafted as `round` would draft it once the word on `relayed` came:
        the reseed that word must name (`_published` refuses any other), then the tree, with the commit it names.
        None when the tree already went, as the verification was relayed (`send_decided`)."""
        promise, commit = promise_after(drafted, relayed)
        session.reseed(relayed.version, relayed.features, list(relayed.tokens))
        sent = self.sent.get(drafted.ref.request_id)
        if sent is None or sent.ref != promise.draft.ref:
            return (yield from self._draft(session, promise, drafted.policy, commit, Clock(), start_ahead=False))
        proposal = yield from session.propose_steps(sent.ref.version, promise.draft.root_token, drafted.policy)
        if proposal.tree is not sent.tree:
            raise RuntimeError(f"request {sent.ref.request_id!r}: the tree sent for version {sent.ref.version} is not the one proposed")
        return None

    async def send_decided(self, drafted: Drafted, relayed: Relayed, alone: bool) -> None:
        """As a Round's verification is relayed, when that Round promised the next and the decided outcome's tree was
        drafted ahead: where it was offered (`offer_ahead`), the target went on to it as it decided; else, for a lone
        Round, send it now, from this event loop, before the reply. The reseed and the tree's bookkeeping follow in
        `promised`; a batch's trees go together instead (`Outbox`)."""
        session = self.sessions.get(drafted.ref.request_id)
        if session is None or drafted.next is None or not drafted.request.next_round_id:
            return
        offer = drafted.offer
        if offer is not None:
            await offer.written  # it may still be on its way
        key = ahead_key(relayed.version + 1, relayed.tokens[:-1], relayed.tokens[-1], drafted.policy)
        grown = session.ahead.get(key)
        taken = grown is not None and offer is not None and offer.sent_at is not None and offer.outcomes.get(key) is grown
        if grown is None or not (alone or taken):
            return
        promise, commit = promise_after(drafted, relayed)
        sent = encoded(promise, grown.proposal, drafted.policy, commit)
        self.sent[drafted.ref.request_id] = self.offerable[drafted.ref.request_id] = sent
        if taken:
            sent.answer, sent.sent_at = offer.answer, offer.sent_at
            return
        loop = asyncio.get_running_loop()
        sent.answer, written = loop.create_future(), loop.create_future()
        sending = asyncio.ensure_future(self.send_ahead(drafted.target, [sent], lambda: written.set_result(None)))
        await asyncio.wait([written, sending], return_when=asyncio.FIRST_COMPLETED)

    def offer_ahead(self) -> None:
        """On the event loop, as a drafting ahead ends: each tree on its way alone, whose Round promised the next, has
        the trees drafted ahead for its outcomes sent after it as the next round's Verify `options`, so that the target
        goes on to the decided outcome's as it decides (docs/wire.md, "Rounds", step 8)."""
        for request_id, drafted in list(self.offerable.items()):
            session = self.sessions.get(request_id)
            if session is None:
                del self.offerable[request_id]
                continue
            if not drafted.request.next_round_id or session.ahead_job is None or not session.ahead_job.done():
                continue  # its Round or the trees are still to come
            del self.offerable[request_id]
            ref = wire.ref(request_id, drafted.ref.version + 1, drafted.ref.manifest_id)
            outcomes, options = {}, []
            for key, grown in session.ahead.items():
                if grown.proposal.assumed is None or key != ahead_key(ref.version, *grown.proposal.assumed, drafted.policy):
                    continue  # the decided outcome's, drafted after its verification
                outcomes[key] = grown
                commit = {"ref": drafted.ref, "accepted_rows": grown.proposal.assumed_rows, "round_id": drafted.request.round_id}
                options.append({"tree": wire.proposed_tree_fields(grown.proposal, ref), "commit": commit})  # built in one go
            if not options:
                continue
            ask = drafted.request
            verify = pb.VerifyRequest(ref=ref, sampling=ask.sampling, round_id=ask.next_round_id, options=options)
            loop = asyncio.get_running_loop()
            offer = drafted.offer = Offer(outcomes, verify.SerializeToString(), loop.create_future(), loop.create_future())
            loop.create_task(self.send_ahead(drafted.target, [offer], lambda offer=offer: offer.written.set_result(None)))

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
            call.fail(ServiceError(status_code(exc), target_field(field_of(exc.trailing_metadata())), f"the target worker at {msg.target}: {exc.details()}"))
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
        finally:  # the next tree waits for the reply to leave (drafting it would hold this process's GIL meanwhile),
            # unless it is on its way already (`send_decided`): then the drafting ahead beside it starts at once
            outbox = Outbox(self, address, sum(d.next is not None and bool(d.request.next_round_id) for d in drafted))
            for i, (call, round_drafted) in enumerate(zip(calls, drafted)):
                then = partial(self.draft_next, round_drafted, decided.get(i), outbox)
                sent = self.sent.get(round_drafted.ref.request_id)
                if i in decided and sent is not None and sent.ref.version == decided[i].version + 1:
                    then()
                else:
                    call.then = then

    async def _relay_to(self, address: str, calls: list[Served], decided: dict[int, "Relayed"]) -> None:
        fresh = [call.reply for call in calls if call.reply.answer is None]
        if len(fresh) == 1:  # on its way alone: the trees drafted ahead beside it may be offered after it
            self.offerable[fresh[0].ref.request_id] = fresh[0]
        answers = dict(zip(map(id, fresh), await self.verify_at(address, fresh))) if fresh else {}
        for i, call in enumerate(calls):
            result = answers[id(call.reply)] if call.reply.answer is None else await call.reply.answer
            if self.offerable.get(call.reply.ref.request_id) is call.reply:
                del self.offerable[call.reply.ref.request_id]  # verified: nothing more to offer after it
            call.clock.skip()  # the wait on the target: its own phases come back in the reply
            if isinstance(result, StreamEnded):
                call.fail(ServiceError(result.code, target_field(result.field), f"the target worker at {address}: {result.details}"))
                continue
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
            await self.send_decided(drafted, relayed, alone=len(calls) == 1)
            call.clock.lap("decode")
            # a tree sent ahead: how long it had been on its way when its Round arrived
            lead = max(0.0, call.clock.started - drafted.sent_at) if drafted.sent_at is not None else 0.0
            call.reply = pb.RoundReply(
                ref=drafted.ref, proposal=drafted.proposal, verify_request=drafted.verify_request, verification=answer,
                target_seconds=result.seconds, target_forwards=result.forwards, sent_ahead_s=lead,
            )

    async def verify_at(
        self, address: str, trees: list[Drafted] | list[Offer], written: Callable[[], None] | None = None
    ) -> list[pb.CallResult | StreamEnded]:
        """The target's answer to each tree, sent as one Verify batch (`written` runs once it is on its way): its
        CallResult, or the StreamEnded that lost it."""
        if address not in self._streams:
            self._streams[address] = BatchStream(address, pb.DESCRIPTOR.services_by_name["TargetWorker"].full_name, self._credential)
        batch = pb.CallBatch(method="Verify", calls=[drafted.verify_request for drafted in trees])
        try:
            results = (await self._streams[address].call(batch, self.spec.rpc_timeout_s, written)).results
        except StreamEnded as ended:
            return [ended] * len(trees)
        if len(results) != len(trees):
            return [StreamEnded(grpc.StatusCode.INTERNAL, "results", f"{len(results)} results for {len(trees)} calls")] * len(trees)
        return list(results)

    async def send_ahead(self, address: str, trees: list[Drafted] | list[Offer], then: Callable[[], None]) -> None:
        """Send trees (or an offer) ahead of their Rounds (`then` runs once they are on their way, or lost); each Round
        relays its answer."""
        ran: list[float] = []  # when `then` ran

        def written() -> None:
            ran.append(time.perf_counter())
            for drafted in trees:
                drafted.sent_at = ran[0]
            then()

        answers: list = [StreamEnded(grpc.StatusCode.INTERNAL, "", "the tree sent ahead was lost on this worker")] * len(trees)
        try:
            answers = await self.verify_at(address, trees, written)
        finally:  # whatever happened, each Round waiting on a tree, and each next call, goes on
            if not ran:
                then()
            for drafted, answer in zip(trees, answers):
                drafted.answer.set_result(answer)

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
        if drafted.request.with_features:
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
