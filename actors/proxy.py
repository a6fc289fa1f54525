"""The coordinator's side of the worker RPCs: a request's remote sessions with the local sessions' methods.

`RemoteRequest` implements `eyas.rounds.Drafting` and `Verifying`, so the coordinator runs the engine's own `start`,
`round_steps` and publish transaction against remote workers. A round is one Round call to the request's draft
worker, which sends the tree on to its target worker and answers with the verification (docs/wire.md, "Rounds"); the
publish stays an explicit, versioned message: the coordinator's word on a round rides on the next Round call. A
round's call is yielded as a `RemoteCall`, which the coordinator's round driver sends with other requests' calls in
one Batch call (`actors.driver`); run alone, a call is a Batch of one. Every reply is checked on receipt, and every
call's time is split into RPC, serialization, queueing and compute.
"""

from __future__ import annotations

import asyncio
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
from eyas.request import RequestState
from eyas.rounds import Proposal, Verification
from eyas.treerows import check_fit
from eyas.rpc import call_metadata, field_of
from eyas.sampling import SamplingParams
from eyas.steps import Forward, Steps, run_alone, without_forwards
from eyas.tree import FlattenedTree, TreePolicy
from eyas.v1 import round_pb2 as pb
from eyas.v1 import tensor_pb2 as tpb

from .errors import STATUS_CODES
from .server import CHANNEL_OPTIONS, PHASES, parse_timing
from .streams import BatchStream, StreamEnded, status_code

LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


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

    def charge_target(self, server: dict[str, float], before: float = 0.0) -> None:
        """Move the phases of the target behind a Round out of its transport (`charge` counted the whole wait); the
        first `before` seconds of them ran before the Round was sent (its tree went ahead), outside its wait."""
        server = dict(server)
        for phase in ("decode", "queue", "batch", "compute", "encode"):  # the order they ran in
            taken = min(before, server[phase])
            server[phase] -= taken
            before -= taken
        self.serialize += server["decode"] + server["encode"]
        self.queue += server["queue"]
        self.batch += server["batch"]
        self.compute += server["compute"]
        self.rpc -= sum(server.values())


@dataclass
class RemoteCall:
    """A round's call on a worker, as its operation yields it (`eyas.steps.Forward` with the worker's client as
    runner): built, sent and parsed by whoever drives the round, alone or in one Batch call with other requests'
    calls (`actors.driver.RoundDriver`). `behind`: the worker a refusal naming field `target` comes from (the target
    behind a Round); `forwards`, once it is answered, the model forwards the worker ran for it (rows, batch-mates'
    among them, and seconds of each)."""

    method: str
    build: Callable[[], Message]
    reply_type: type[Message]
    parse: Callable
    timing: CallTiming
    behind: "WorkerClient | None" = None
    forwards: list[tuple[int, float]] = field(default_factory=list)


def refusal(worker: "WorkerClient", code: grpc.StatusCode, field: str, details: str) -> Exception:
    """The exception a status from `worker` means: the worker lost, the session lost, or a refusal naming `field`."""
    if code in LOST_CODES:
        return WorkerLost(worker, f"{code.name}: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return SessionLost(worker, details)
    return RemoteError(worker, code, field, details)


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
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stream: tuple[BatchStream, asyncio.AbstractEventLoop] | None = None  # opened on the coordinator's loop
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
            self._close_channels()

    def _close_channels(self) -> None:
        self._channel.close()
        if self._stream is not None:
            stream, loop = self._stream
            asyncio.run_coroutine_threadsafe(stream.close(), loop)

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
        behind: "WorkerClient | None" = None,
    ):
        """Build, serialize, send and parse one call, charging each part to `timing`; `behind` as in `RemoteCall`."""
        t0 = time.perf_counter()
        data = build().SerializeToString()
        t1 = time.perf_counter()
        try:
            raw, call = self._invoke(method, data, with_call=True)
        except grpc.RpcError as error:
            raise self._translate(error, behind) from None
        t2 = time.perf_counter()
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
        batch, builds = self._batch(calls)
        t1 = time.perf_counter()
        try:
            raw = self._invoke("Batch", batch.SerializeToString())
            reply = pb.CallBatchReply.FromString(raw)
        except grpc.RpcError as error:
            return self._fail(calls, builds, self._translate(error), time.perf_counter() - t1)
        except DecodeError as exc:
            return self._fail(calls, builds, wire.WireError("results", f"not a CallBatchReply: {exc}"), time.perf_counter() - t1)
        return self._outcomes(calls, builds, reply, time.perf_counter() - t1)

    async def run_each_async(self, calls: list[RemoteCall]) -> list:
        """`run_each` on the running event loop, over the worker's `Stream` (`actors.streams`): no thread waits on the
        wire, and no call is set up anew."""
        batch, builds = self._batch(calls)
        t1 = time.perf_counter()
        self._enter()
        try:
            if self._stream is None:  # opened on the loop it serves
                self._stream = BatchStream(self.address, self.service, self._metadata), asyncio.get_running_loop()
            reply = await self._stream[0].call(batch, self.timeout)
        except StreamEnded as ended:
            return self._fail(calls, builds, refusal(self, ended.code, ended.field, ended.details), time.perf_counter() - t1)
        finally:
            self._leave()
        return self._outcomes(calls, builds, reply, time.perf_counter() - t1)

    @staticmethod
    def _batch(calls: list[RemoteCall]) -> tuple[pb.CallBatch, list[float]]:
        """The calls as one CallBatch, and the seconds each took to build."""
        t0 = time.perf_counter()
        data, built = [], []
        for call in calls:
            data.append(call.build().SerializeToString())
            built.append(time.perf_counter())
        builds = [b - a for a, b in zip([t0, *built[:-1]], built)]
        return pb.CallBatch(method=calls[0].method, calls=data), builds

    def _outcomes(self, calls: list[RemoteCall], builds: list[float], reply: pb.CallBatchReply, wall: float) -> list:
        """Each call's parsed reply or exception from a CallBatchReply, charging each call's time."""
        results = reply.results
        if len(results) != len(calls):
            return self._fail(calls, builds, wire.WireError("results", f"{len(results)} results for {len(calls)} calls"), wall)
        outcomes = []
        for call, build, result in zip(calls, builds, results):
            t3 = time.perf_counter()
            server = dict.fromkeys(PHASES, 0.0)
            try:
                server = check_phases(result.seconds, "results.seconds")
                if result.code:
                    code = STATUS_CODES.get(result.code, grpc.StatusCode.UNKNOWN)
                    raise refusal(self.blamed(result.field, call.behind), code, result.field, result.details)
                forwards = check_forwards(result.forwards, "results.forwards")
                outcomes.append(call.parse(decode(call.reply_type, result.reply, "results.reply")))
                call.forwards = forwards
            except Exception as exc:
                outcomes.append(exc)
            call.timing.charge(server, build + time.perf_counter() - t3, wall)
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

    def _translate(self, error: grpc.RpcError, behind: "WorkerClient | None" = None) -> Exception:
        field = field_of(error.trailing_metadata())
        return refusal(self.blamed(field, behind), status_code(error), field, error.details())

    def blamed(self, field: str, behind: "WorkerClient | None") -> "WorkerClient":
        """The worker a refusal naming `field` comes from: the one `behind` this one when the field is the target's."""
        return behind if behind is not None and field.split(".")[0] == "target" else self

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

    def releasing(self, ref: tpb.RequestRef) -> Callable[[], None]:
        """Send a Release of a request's session now; the returned function waits for its answer. A session or worker
        already gone is fine."""
        try:
            self._enter()
        except WorkerLost:  # removed from its pool: its sessions go with it
            return lambda: None
        try:
            sent = self._stub("Release").future(pb.Release(ref=ref).SerializeToString(), timeout=self.timeout, metadata=self._metadata)
        except BaseException:
            self._leave()
            raise

        def wait() -> None:
            try:
                pb.Released.FromString(sent.result())
            except grpc.RpcError as error:
                refused = self._translate(error)
                if not isinstance(refused, (WorkerLost, SessionLost)):
                    raise refused from None
            finally:
                self._leave()

        return wait

    def close(self) -> None:
        """Refuse new calls; the channel closes once the calls in flight have returned."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            idle = self._in_flight == 0
        if idle:
            self._close_channels()


class RemoteRequest:
    """One request's sessions on its draft and its target worker: `eyas.rounds.Drafting` and `Verifying` at once, so
    the coordinator runs the engine's own `start`, `round_steps` and publish over them (pass it as both).

    A round is one Round call to the draft worker, which drafts the tree, has the target verify it and answers with
    both (`propose_steps`; `verify_steps` then returns that verification). The publish (`commit` and `reseed`) becomes
    the coordinator's word (`pb.Publish`) on the next Round call, which each worker applies first. `exchange` holds
    the last round's Verify request and reply bytes as they crossed the wire, for traces.
    """

    def __init__(
        self,
        draft: WorkerClient,
        target: WorkerClient,
        request_id: str,
        manifest_id: str,
        timing: CallTiming,
        vocab_size: int,
        feature_width: int,
        request: RequestState,
        with_features: bool = False,
        send_ahead: bool = False,
    ):
        """`request`: its sampling options and how many tokens it may still take; `with_features`: each round's
        verification comes back with its accepted rows' features (for a trace); `send_ahead`: every round drafts with
        the same policy, so a Round may promise the next one (`RoundRequest.next_round_id`)."""
        self.draft, self.target = draft, target
        self.request_id, self.manifest_id = request_id, manifest_id
        self.timing = timing
        self.vocab_size, self.feature_width = vocab_size, feature_width
        self.request = request
        self.params, self.sampling = request.sampling, wire.sampling_to_proto(request.sampling)
        self.with_features = with_features
        self.send_ahead = send_ahead
        self._next_round_id = ""  # promised by the last Round: the next one's tree is on its way to the target
        self._prefilled: list[int] = []  # the tokens the target prefills at the start
        self._accepted_rows: tuple[int, ...] = ()  # the target's side of the publish, until the draft's completes it
        self._publish: pb.Publish | None = None  # the word the next Round carries
        self._verified: tuple[FlattenedTree, Verification] | None = None  # the last round's, for `verify_steps`
        self.round_id = ""  # the round last verified, which the word on it names
        self.exchange: tuple[bytes, bytes] | None = None
        self.draft_forwards: list[tuple[int, float]] = []  # the last round's forwards on each worker (rows, seconds)
        self.target_forwards: list[tuple[int, float]] = []
        self.off_worker = 0.0  # the last Round's seconds outside the workers' compute (`CallTiming.off_worker`)
        self.sent_ahead_s = 0.0  # the last Round's tree had been on its way this long when the Round arrived

    def ref(self, version: int) -> tpb.RequestRef:
        return wire.ref(self.request_id, version, self.manifest_id)

    def check_ref(self, reply_ref: tpb.RequestRef, version: int, field: str = "ref") -> None:
        if reply_ref != self.ref(version):
            raise wire.WireError(field, f"the reply names {reply_ref.request_id!r} at version {reply_ref.version}")

    # -- start ---------------------------------------------------------------------------------
    def prefill_steps(self, version: int, tokens: list[int]) -> Steps[None]:
        """The target's prefill, asked of the draft worker by `start_steps` (its features never come here)."""
        return without_forwards(self._prefill, tokens)

    def _prefill(self, tokens: list[int]) -> None:
        self._prefilled = list(tokens)

    def start_steps(self, version: int, features: None, tokens: list[int]) -> Steps[None]:
        """`start` as an operation of the request's start: one Start call, in which the draft worker has the target
        prefill and seeds the drafter from the features."""
        return without_forwards(self.start, version, tokens)

    def start(self, version: int, tokens: list[int]) -> None:
        def build():
            return pb.DraftStart(ref=self.ref(version), tokens=tokens, target=self.target.address, prefill=self._prefilled)

        self.draft.call("Start", build, pb.Ack, lambda reply: self.check_ref(reply.ref, version), self.timing, behind=self.target)

    # -- a round -------------------------------------------------------------------------------
    def propose(self, version: int, root_token: int, policy: TreePolicy) -> Proposal:
        """`propose_steps` run alone."""
        return run_alone(self.propose_steps(version, root_token, policy))

    def propose_steps(self, version: int, root_token: int, policy: TreePolicy) -> Steps[Proposal]:
        """The Round call as an operation of the round: it yields the call, which its driver sends (the forwards run
        on the workers), and returns the proposal; its verification waits for `verify_steps`."""
        round_id = self._next_round_id or secrets.token_hex(16)
        word = self._publish
        # a round commits at most depth + 1 tokens: with more left, the next round follows unless a stop ends it
        goes_on = self.request.stop.max_new_tokens - len(self.request.output) > policy.depth + 1
        next_round_id = self._next_round_id = secrets.token_hex(16) if goes_on and self.send_ahead else ""

        def build() -> pb.RoundRequest:
            ask = pb.DraftRequest(
                ref=self.ref(version), root_token=root_token, policy=wire.policy_to_proto(policy), with_records=policy in EXPLORATIONS
            )
            return pb.RoundRequest(
                draft=ask, publish=word, sampling=self.sampling, round_id=round_id, target=self.target.address,
                with_features=self.with_features, draft_next=goes_on, next_round_id=next_round_id,
            )

        def parse(reply: pb.RoundReply) -> Proposal:
            self.check_ref(reply.ref, version)
            sent = decode(pb.VerifyRequest, reply.verify_request, "verify_request")
            commit = None if word is None else pb.Commit(ref=word.ref, accepted_rows=word.accepted_rows, round_id=word.round_id)
            if (sent.ref, sent.round_id, sent.sampling) != (self.ref(version), round_id, self.sampling) or (
                sent.commit if sent.HasField("commit") else None
            ) != commit:
                raise wire.WireError("verify_request", "the tree went to the target with another request, round, sampling or commit")
            proposal = wire.proposal_from_proto(reply.proposal, sent.tree)
            # What only the coordinator knows; the target worker validated the tree's structure, once, on receipt.
            tree = proposal.tree
            check_fit(tree.num_rows, int(tree.tokens[0]) if tree.num_rows else None, budget=policy.budget, root_token=root_token)
            answer = decode(pb.Verification, reply.verification, "verification")
            self.check_ref(answer.ref, version, "verification.ref")
            self.check_ref(answer.decision.ref, version, "verification.decision.ref")
            if answer.round_id != round_id:
                raise wire.WireError("verification.round_id", "the verification names another round than the call")
            verification = wire.verification_from_proto(answer, self.feature_width, self.with_features)
            wire.validate_verification(verification, tree, self.vocab_size)
            if not 0 <= reply.sent_ahead_s < float("inf"):
                raise wire.WireError("sent_ahead_s", f"{reply.sent_ahead_s} is not a nonnegative number of seconds")
            self.timing.charge_target(check_phases(reply.target_seconds, "target_seconds"), reply.sent_ahead_s)
            self.sent_ahead_s = reply.sent_ahead_s
            self.target_forwards = check_forwards(reply.target_forwards, "target_forwards")
            self._verified = (tree, verification)
            self.exchange = (reply.verify_request, reply.verification)
            return proposal

        call = RemoteCall("Round", build, pb.RoundReply, parse, self.timing, behind=self.target)
        before = self.timing.off_worker()
        proposal = yield Forward(self.draft, call)  # its timing is charged before the round resumes
        self.off_worker = self.timing.off_worker() - before
        self.draft_forwards = call.forwards
        self._publish = None
        self.round_id = round_id
        return proposal

    def verify_steps(self, tree: FlattenedTree, version: int, params: SamplingParams) -> Steps[Verification]:
        """The verification the round's call brought back with `tree` (the target verified it there)."""
        return without_forwards(self.verified, tree, version, params)

    def verified(self, tree: FlattenedTree, version: int, params: SamplingParams) -> Verification:
        if self._verified is None or self._verified[0] is not tree or params != self.params:
            raise ValueError("verify: the round's call verified another tree, or with other sampling options")
        verification, self._verified = self._verified[1], None
        return verification

    def commit(self, version: int, accepted_rows: tuple[int, ...]) -> None:
        """The target's side of the publish, completed by `reseed` into the word the next Round carries."""
        self._accepted_rows = tuple(accepted_rows)

    def reseed(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        """The draft's side of the publish: the word on this round (the draft worker holds its features)."""
        self._publish = pb.Publish(ref=self.ref(version), round_id=self.round_id, accepted_rows=self._accepted_rows, tokens=tokens)

    def release(self, *sides: str) -> None:
        """Drop the sessions on the "draft" and/or "target" worker, the Releases sent at once; a session or worker
        already gone is fine."""
        waits, errors = [], []
        for side in sides:
            try:
                waits.append(getattr(self, side).releasing(self.ref(0)))
            except Exception as exc:
                errors.append(exc)
        for wait in waits:
            try:
                wait()
            except Exception as exc:  # every Release sent is awaited before the first failure is raised
                errors.append(exc)
        if errors:
            raise errors[0]


def decode(message: type[Message], data: bytes, field: str) -> Message:
    """Bytes that must be a `message`, or a WireError naming `field`."""
    try:
        return message.FromString(data)
    except DecodeError as exc:
        raise wire.WireError(field, f"not a {message.__name__}: {exc}") from None


def check_phases(seconds, field: str) -> dict[str, float]:
    """A worker's reported phase seconds, one per phase, each a duration."""
    if len(seconds) != len(PHASES) or not all(0.0 <= s < float("inf") for s in seconds):
        raise wire.WireError(field, f"{len(seconds)} phases, not {len(PHASES)} durations")
    return dict(zip(PHASES, seconds))


def check_forwards(forwards, field: str) -> list[tuple[int, float]]:
    """A worker's reported forwards: each of some rows, taking a duration."""
    if any(f.rows == 0 or not 0.0 <= f.seconds < float("inf") for f in forwards):
        raise wire.WireError(field, "a forward of no rows or of a time that is not a duration")
    return [(f.rows, f.seconds) for f in forwards]
