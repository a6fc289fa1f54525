"""The coordinator's side of the worker RPCs: remote sessions with the local sessions' methods.

`RemoteDraft` and `RemoteTarget` implement `eyas.rounds.Drafting` / `Verifying`, so the coordinator
runs the engine's own `start`, `run_round` and publish transaction against remote workers. The
publish steps stay explicit, versioned messages: the reseed rides on the next Draft call and the commit on the
next Verify call, so a round costs two calls, not three. A round's Draft and Verify calls are yielded as
`RemoteCall`s, which the coordinator's round driver sends with other requests' calls in one Batch call
(`actors.driver`); run alone, a call is a Batch of one. Every reply is checked on receipt, and every call's
time is split into RPC, serialization, queueing and compute.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from eyas import wire
from eyas.autotree import EXPLORATIONS
from eyas.rounds import Proposal, Verification
from eyas.treerows import check_fit
from eyas.rpc import call_metadata, field_of
from eyas.sampling import SamplingParams
from eyas.steps import Forward, Steps, run_alone, without_forwards
from eyas.tree import FlattenedTree, TreePolicy
from eyas.v1 import round_pb2 as pb
from eyas.v1 import tensor_pb2 as tpb

from .server import PHASES, parse_timing

LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class WorkerLost(Exception):
    """A worker stopped answering (its process died or its connection broke)."""

    def __init__(self, worker: "WorkerClient", detail: str):
        super().__init__(f"{worker.role} worker {worker.worker_id} at {worker.address} is lost: {detail}")
        self.worker = worker


class SessionLost(Exception):
    """A worker answers but no longer holds the request's session."""

    def __init__(self, worker: "WorkerClient", detail: str):
        super().__init__(f"{worker.role} worker {worker.worker_id} lost the session: {detail}")
        self.worker = worker


class RemoteError(Exception):
    """A worker refused a call; carries its status code and the field it named."""

    def __init__(self, worker: "WorkerClient", code: grpc.StatusCode, field: str, details: str):
        super().__init__(f"{worker.role} worker {worker.worker_id}: {code.name}: {details}")
        self.code = code
        self.field = field
        self.details = details


@dataclass
class CallTiming:
    """Seconds of remote calls, split: wire transport, (de)serialization and receipt checks on both ends,
    waiting on the worker's threads (its compute thread to take the call, its event loop to take the finished call
    back), waiting for each of its forwards to start (behind batch-mates' steps), and compute."""

    rpc: float = 0.0
    serialize: float = 0.0
    queue: float = 0.0
    batch: float = 0.0
    compute: float = 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0.0)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def off_worker(self) -> float:
        """Seconds spent outside the workers' compute: on the wire, (de)serializing, queued and waiting for batch-mates."""
        return self.rpc + self.serialize + self.queue + self.batch

    def charge(self, server: dict[str, float], serialize: float, wire: float) -> None:
        """Add one call: the worker's phases, the caller's own (de)serialization, and the wall time on the wire
        (what the worker's phases leave of it is transport)."""
        self.serialize += serialize + server["decode"] + server["encode"]
        self.queue += server["queue"]
        self.batch += server["batch"]
        self.compute += server["compute"]
        self.rpc += wire - sum(server.values())


@dataclass
class RemoteCall:
    """A round's call on a worker, as its operation yields it (`eyas.steps.Forward` with the worker's client as
    runner): built, sent and parsed by whoever drives the round, alone or in one Batch call with other requests'
    calls (`actors.driver.RoundDriver`). `keep` gets the request and reply bytes exactly as they crossed the wire;
    `forwards`, once it is answered, the model forwards the worker ran for it (rows, batch-mates' among them, and
    seconds of each)."""

    method: str
    build: Callable[[], Message]
    reply_type: type[Message]
    parse: Callable
    timing: CallTiming
    keep: Callable[[bytes, bytes], None] | None = None
    forwards: list[tuple[int, float]] = field(default_factory=list)


class WorkerClient:
    """A channel to one worker's gRPC server, shared by every request routed to it.

    `close` never cuts a call in flight: the channel closes when its last call returns, and a call
    started after `close` fails as a lost worker (so its request is rebuilt elsewhere).
    """

    def __init__(self, role: str, worker_id: str, address: str, token: str | None, timeout: float):
        self.role = role
        self.worker_id = worker_id
        self.address = address
        self.timeout = timeout
        self.service = pb.DESCRIPTOR.services_by_name["DraftWorker" if role == "draft" else "TargetWorker"].full_name
        self._metadata = call_metadata(token)
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
        )
        self._methods: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._guard = threading.Lock()
        self._in_flight = 0
        self._closed = False

    def _enter(self) -> None:
        with self._guard:
            if self._closed:
                raise WorkerLost(self, "the worker was removed from its pool")
            self._in_flight += 1

    def _leave(self) -> None:
        with self._guard:
            self._in_flight -= 1
            last = self._closed and self._in_flight == 0
        if last:
            self._channel.close()

    def _invoke(self, method: str, data: bytes, with_call: bool = False):
        """One unary call on the shared channel, which stays open until the call returns."""
        self._enter()
        try:
            stub = self._stub(method)
            if with_call:
                return stub.with_call(data, timeout=self.timeout, metadata=self._metadata)
            return stub(data, timeout=self.timeout, metadata=self._metadata)
        finally:
            self._leave()

    def call(
        self,
        method: str,
        build: Callable[[], Message],
        reply_type: type[Message],
        parse: Callable,
        timing: CallTiming,
        keep: Callable[[bytes, bytes], None] | None = None,
    ):
        """Build, serialize, send and parse one call, charging each part to `timing`; `keep` gets the request
        and reply bytes exactly as they crossed the wire."""
        t0 = time.perf_counter()
        data = build().SerializeToString()
        t1 = time.perf_counter()
        try:
            raw, call = self._invoke(method, data, with_call=True)
        except grpc.RpcError as error:
            raise self._translate(error) from None
        t2 = time.perf_counter()
        if keep is not None:
            keep(data, raw)
        value = parse(reply_type.FromString(raw))
        timing.charge(parse_timing(call), (t1 - t0) + (time.perf_counter() - t2), t2 - t1)
        return value

    def rows(self, call: RemoteCall) -> int:
        """`eyas.steps.Runner`: a call counts as one."""
        return 1

    def run(self, calls: list[RemoteCall]) -> list:
        """`eyas.steps.Runner`: the calls' parsed replies, from one Batch call; the first refusal raises."""
        outcomes = self.run_each(calls)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    def run_each(self, calls: list[RemoteCall]) -> list:
        """Send calls of one rpc (each for a different request) as one Batch call: per call, its parsed reply, or
        the exception it ended with (its own refusal, a reply that failed its receipt checks, or the worker lost)."""
        method = calls[0].method
        t0 = time.perf_counter()
        data, built = [], []
        for call in calls:
            data.append(call.build().SerializeToString())
            built.append(time.perf_counter())
        batch = pb.CallBatch(method=method, calls=data).SerializeToString()
        t1 = time.perf_counter()
        builds = [b - a for a, b in zip([t0, *built[:-1]], built)]
        try:
            raw = self._invoke("Batch", batch)
        except grpc.RpcError as error:
            return self._fail(calls, builds, self._translate(error), time.perf_counter() - t1)
        t2 = time.perf_counter()
        try:
            results = pb.CallBatchReply.FromString(raw).results
        except DecodeError as exc:
            return self._fail(calls, builds, wire.WireError("results", f"not a CallBatchReply: {exc}"), t2 - t1)
        if len(results) != len(calls):
            return self._fail(calls, builds, wire.WireError("results", f"{len(results)} results for {len(calls)} calls"), t2 - t1)
        outcomes = []
        for call, sent, build, result in zip(calls, data, builds, results):
            t3 = time.perf_counter()
            server = dict.fromkeys(PHASES, 0.0)
            try:
                if len(result.seconds) != len(PHASES):
                    raise wire.WireError("results.seconds", f"{len(result.seconds)} phases, not {len(PHASES)}")
                server = dict(zip(PHASES, result.seconds))
                if result.code:
                    code = STATUS_CODES.get(result.code, grpc.StatusCode.UNKNOWN)
                    raise self._refusal(code, result.field, result.details)
                if any(f.rows == 0 or not 0.0 <= f.seconds < float("inf") for f in result.forwards):
                    raise wire.WireError("results.forwards", "a forward of no rows or of a time that is not a duration")
                if call.keep is not None:
                    call.keep(sent, result.reply)
                outcomes.append(call.parse(call.reply_type.FromString(result.reply)))
                call.forwards = [(f.rows, f.seconds) for f in result.forwards]
            except Exception as exc:
                outcomes.append(exc)
            call.timing.charge(server, build + time.perf_counter() - t3, t2 - t1)
        return outcomes

    @staticmethod
    def _fail(calls: list[RemoteCall], builds: list[float], error: Exception, wall: float) -> list:
        """Every call of a batch ends with `error` (the worker lost, or its reply unreadable)."""
        for call, build in zip(calls, builds):
            call.timing.charge(dict.fromkeys(PHASES, 0.0), build, wall)
        return [error] * len(calls)

    def _stub(self, method: str) -> grpc.UnaryUnaryMultiCallable:
        if method not in self._methods:
            self._methods[method] = self._channel.unary_unary(f"/{self.service}/{method}")
        return self._methods[method]

    def _translate(self, error: grpc.RpcError) -> Exception:
        return self._refusal(error.code(), field_of(error.trailing_metadata()), error.details())

    def _refusal(self, code: grpc.StatusCode, field: str, details: str) -> Exception:
        """The exception a call's status means: the worker lost, the session lost, or a refusal naming `field`."""
        if code in LOST_CODES:
            return WorkerLost(self, f"{code.name}: {details}")
        if code == grpc.StatusCode.NOT_FOUND:
            return SessionLost(self, details)
        return RemoteError(self, code, field, details)

    def health(self, timeout: float = 5.0) -> pb.WorkerHealth:
        """The worker's counts; raises grpc.RpcError when it does not answer, WorkerLost after `close`."""
        self._enter()
        try:
            raw = self._stub("Health")(pb.WorkerHealthRequest().SerializeToString(), timeout=timeout, metadata=self._metadata)
        finally:
            self._leave()
        return pb.WorkerHealth.FromString(raw)

    def costs(self) -> tuple[list[int], list[float]]:
        """The worker's forward seconds by rows (`eyas.autotree.measure_verify` / `measure_draft` on its device)."""
        curve = self.call("Costs", pb.CostsRequest, pb.CostCurve, lambda reply: reply, CallTiming())
        if not curve.rows or len(curve.rows) != len(curve.seconds) or list(curve.rows) != sorted(set(curve.rows)):
            raise wire.WireError("costs", f"{len(curve.rows)} row counts (increasing) for {len(curve.seconds)} times")
        return list(curve.rows), list(curve.seconds)

    def release(self, ref: tpb.RequestRef) -> None:
        """Drop a request's session; a session or worker already gone is fine."""
        try:
            self.call("Release", lambda: pb.Release(ref=ref), pb.Released, lambda r: r, CallTiming())
        except (WorkerLost, SessionLost):
            pass

    def close(self) -> None:
        """Refuse new calls; the channel closes once the calls in flight have returned."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            idle = self._in_flight == 0
        if idle:
            self._channel.close()


class RemoteSession:
    """One request's session on one worker: its reference and where its call time goes."""

    def __init__(self, client: WorkerClient, request_id: str, manifest_id: str, timing: CallTiming):
        self.client = client
        self.request_id = request_id
        self.manifest_id = manifest_id
        self.timing = timing
        self.forwards: list[tuple[int, float]] = []  # the last round call's forwards on the worker (rows, seconds)

    def ref(self, version: int) -> tpb.RequestRef:
        return wire.ref(self.request_id, version, self.manifest_id)

    def check_ref(self, reply_ref: tpb.RequestRef, version: int) -> None:
        if reply_ref != self.ref(version):
            raise wire.WireError("ref", f"the reply names {reply_ref.request_id!r} at version {reply_ref.version}")

    def release(self) -> None:
        self.client.release(self.ref(0))


class RemoteDraft(RemoteSession):
    """`eyas.rounds.Drafting` over gRPC; a reseed rides on the next Draft call."""

    def __init__(self, client: WorkerClient, request_id: str, manifest_id: str, timing: CallTiming, vocab_size: int):
        super().__init__(client, request_id, manifest_id, timing)
        self.vocab_size = vocab_size
        self._reseed: tuple[int, torch.Tensor, list[int]] | None = None
        self.off_worker = 0.0  # the last Draft call's seconds outside the worker's compute (`CallTiming.off_worker`)

    def start_steps(self, version: int, features: torch.Tensor, tokens: list[int]) -> Steps[None]:
        """`start` as an operation of the request's start (the drafter's prefill runs on the worker)."""
        return without_forwards(self.start, version, features, tokens)

    def start(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        def build():
            return pb.DraftStart(ref=self.ref(version), features=wire.tensor_to_proto(features), tokens=tokens)

        self.client.call("Start", build, pb.Ack, lambda reply: self.check_ref(reply.ref, version), self.timing)

    def reseed(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        self._reseed = (version, features, list(tokens))

    def propose(self, version: int, root_token: int, policy: TreePolicy) -> Proposal:
        """`propose_steps` run alone."""
        return run_alone(self.propose_steps(version, root_token, policy))

    def propose_steps(self, version: int, root_token: int, policy: TreePolicy) -> Steps[Proposal]:
        """The Draft call as an operation of the round: it yields the call, which its driver sends (the forwards
        run on the worker)."""

        def build():
            msg = pb.DraftRequest(
                ref=self.ref(version), root_token=root_token, policy=wire.policy_to_proto(policy), with_records=policy in EXPLORATIONS
            )
            if self._reseed is not None:
                v, features, tokens = self._reseed
                msg.reseed.CopyFrom(pb.Reseed(ref=self.ref(v), features=wire.tensor_to_proto(features), tokens=tokens))
            return msg

        def parse(reply: pb.Proposal) -> Proposal:
            self.check_ref(reply.ref, version)
            proposal = wire.proposal_from_proto(reply)
            # What only the coordinator knows; the target worker validates the tree's structure once, on receipt.
            check_fit(proposal.tree.num_rows, int(proposal.tree.tokens[0]) if proposal.tree.num_rows else None,
                      budget=policy.budget, root_token=root_token)
            return proposal

        call = RemoteCall("Draft", build, pb.Proposal, parse, self.timing)
        before = self.timing.off_worker()
        proposal = yield Forward(self.client, call)  # its timing is charged before the round resumes
        self.off_worker = self.timing.off_worker() - before
        self.forwards = call.forwards
        self._reseed = None
        return proposal


class RemoteTarget(RemoteSession):
    """`eyas.rounds.Verifying` over gRPC; a commit rides on the next Verify call (the worker applies it first).

    With `keep_wire`, `exchange` holds the last Verify request and reply bytes, for traces.
    """

    def __init__(
        self,
        client: WorkerClient,
        request_id: str,
        manifest_id: str,
        timing: CallTiming,
        vocab_size: int,
        feature_width: int,
        keep_wire: bool = False,
    ):
        super().__init__(client, request_id, manifest_id, timing)
        self.vocab_size = vocab_size
        self.feature_width = feature_width
        self._commit: pb.Commit | None = None
        self.round_id = ""  # the round of the tree last verified, which its commit names
        self.keep_wire = keep_wire
        self.exchange: tuple[bytes, bytes] | None = None

    def prefill_steps(self, version: int, tokens: list[int]) -> Steps[torch.Tensor]:
        """`prefill` as an operation (the forward runs on the worker)."""
        return without_forwards(self.prefill, version, tokens)

    def prefill(self, version: int, tokens: list[int]) -> torch.Tensor:
        def parse(reply: pb.PrefillReply) -> torch.Tensor:
            self.check_ref(reply.ref, version)
            return wire.features_from_proto(reply.features, "features", len(tokens), self.feature_width)

        return self.client.call("Prefill", lambda: pb.Prefill(ref=self.ref(version), tokens=tokens), pb.PrefillReply, parse, self.timing)

    def commit(self, version: int, accepted_rows: tuple[int, ...]) -> None:
        """The target side of the publish, carried by the next Verify call: one call per round, not two (a lone
        Commit call costs both ends more CPU than the worker's move of the accepted rows)."""
        self._commit = pb.Commit(ref=self.ref(version), accepted_rows=accepted_rows, round_id=self.round_id)

    def verify(self, tree: FlattenedTree, version: int, params: SamplingParams) -> Verification:
        """`verify_steps` run alone."""
        return run_alone(self.verify_steps(tree, version, params))

    def verify_steps(self, tree: FlattenedTree, version: int, params: SamplingParams) -> Steps[Verification]:
        """The Verify call as an operation of the round: it yields the call, which its driver sends (the forward
        runs on the worker)."""
        round_id = secrets.token_hex(16)

        def build():
            request = self.ref(version)
            tree_msg = wire.tree_to_proto(tree, request)
            msg = pb.VerifyRequest(ref=request, tree=tree_msg, sampling=wire.sampling_to_proto(params), round_id=round_id)
            if self._commit is not None:
                msg.commit.CopyFrom(self._commit)
            return msg

        def parse(reply: pb.Verification) -> Verification:
            self.check_ref(reply.ref, version)
            self.check_ref(reply.decision.ref, version)
            if reply.round_id != round_id:
                raise wire.WireError("round_id", "the reply names another round than the call")
            verification = wire.verification_from_proto(reply, self.feature_width)
            wire.validate_verification(verification, tree, self.vocab_size)
            return verification

        keep = self._keep if self.keep_wire else None
        call = RemoteCall("Verify", build, pb.Verification, parse, self.timing, keep)
        verification = yield Forward(self.client, call)
        self.forwards = call.forwards
        self._commit = None
        self.round_id = round_id
        return verification

    def _keep(self, request: bytes, reply: bytes) -> None:
        self.exchange = (request, reply)
