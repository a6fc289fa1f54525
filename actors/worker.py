"""What draft and target workers share: their spec, the per-request session table, the gRPC endpoint loop.

A worker is a Ray actor running a grpc.aio server; trees, decisions and features travel over that
server as protobuf, never through Ray's object store. Every call is decoded on the server's event
loop, then runs as an operation on the worker's one compute thread (`eyas.runtime.batch.Scheduler`):
the calls of one request run one at a time in arrival order, and the forwards of the calls of
different requests that are in flight together run as one batch per model (continuous batching,
docs/runtime.md). Each call reports its decode / queue / batch (waiting for batch-mates) / compute /
encode seconds in its trailer.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import GeneratorType
from typing import Any

import grpc
import ray
import torch
from google.protobuf.message import DecodeError, Message
from transformers.utils import logging as hf_logging

from eyas.manifest import Manifest
from eyas.runtime.batch import Scheduler
from eyas.runtime.device import freeze_startup_objects, prepare
from eyas.steps import Steps
from eyas.tree import TreeError, TreePolicy
from eyas.v1 import round_pb2 as pb
from eyas.v1 import tensor_pb2 as tpb

from .errors import ServiceError, abort, status_of
from .limits import MAX_ID_BYTES
from .server import PHASES, Clock, advertised_address, start_server

@dataclass(frozen=True)
class WorkerSpec:
    """What a worker loads and how it serves; built by `eyas.cluster` from the service config."""

    target: str
    drafter: str
    tree_limit: TreePolicy
    dtype: str = "auto"
    draft_dtype: str = "auto"  # a draft worker's drafter (eyas.runtime.device.resolve_draft_dtype)
    feature_layers: tuple[int, ...] | None = None
    allow_manifest_mismatch: bool = False
    host: str = "127.0.0.1"
    token: str | None = None  # the service's own worker credential: every call must carry it, even on loopback
    threads: int = 1
    draft_ahead: int = 0  # trees a draft worker pre-builds per request during each verification
    max_concurrency: int = 64  # calls a worker runs (and batches) at once; later ones wait in arrival order
    kv_slots: int = 16  # sessions one worker's KV pool holds at once
    tensor_parallel: int = 1  # ranks of a target group (docs/groups.md)
    emulate: str | None = None  # a cost profile: timed models stand in for the target and the drafter (eyas.emulation)
    rpc_timeout_s: float = 120.0  # a call to another worker (a Round's Verify) slower than this fails as lost


@dataclass(frozen=True)
class WorkerInfo:
    """What a started worker tells the coordinator (over Ray, once): where it listens and what it serves."""

    role: str
    address: str
    manifest_id: str
    node_id: str
    pid: int
    vocab_size: int
    feature_width: int
    max_positions: int
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class Served:
    """One call's outcome on this worker: its reply (a message, or what `Worker.relay` finishes into one) or its error,
    its clock, the forwards it took part in as (rows, seconds), and, once encoded, its reply's bytes."""

    reply: Any = None
    error: BaseException | None = None
    clock: Clock = field(default_factory=Clock)
    forwards: list[tuple[int, float]] = field(default_factory=list)
    data: bytes | None = None
    then: Callable[[], None] | None = None  # work to start once the reply is on its way (whatever it says)

    def fail(self, error: BaseException) -> None:
        self.reply, self.error = None, error


class WorkerStartError(RuntimeError):
    """A worker could not load its models; the message names the original error."""


def rss_bytes() -> int:
    """Resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def start_then(served: list[Served]) -> None:
    """Start the work each call left for once its reply is on its way."""
    for call in served:
        if call.then is not None:
            call.then()


def request_key(msg: Message) -> str:
    """The request a call is for: its `ref`'s id (a Round's inside its `draft`), "" for a call that names none."""
    ref = getattr(msg, "ref", None) or getattr(getattr(msg, "draft", None), "ref", None)
    return ref.request_id if ref is not None else ""


def assigned_device() -> torch.device:
    """The device Ray assigned this actor: its GPUs are the only ones it sees (CUDA_VISIBLE_DEVICES set by Ray),
    so the first is cuda:0; cpu when it reserved none."""
    return torch.device("cuda", 0) if ray.get_gpu_ids() else torch.device("cpu")


class Worker:
    """Base of `DraftWorker` and `TargetWorker`: subclasses load models and define `endpoints`."""

    role = ""
    service = ""
    batched: tuple[str, ...] = ()  # the endpoints a `Batch` call may carry (those of a round)
    follower: type | None = None  # the actor class of ranks 1..N-1 when the worker leads a group

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.sessions: dict = {}
        self.manifest: Manifest | None = None
        self.vocab_size = 0
        self.feature_width = 0
        self.max_positions = 0
        self.calls = 0
        self.busy_seconds = 0.0
        self.scheduler = Scheduler(f"eyas-{self.role}", spec.max_concurrency)  # the compute thread
        self._tails: dict[str, asyncio.Future] = {}  # per request: the last call, which the next one waits for
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop serving the calls, once started
        self._server: grpc.aio.Server | None = None
        self.device = assigned_device()

    # -- subclass contract --------------------------------------------------------------------
    def load(self) -> None:
        """Load models and set manifest, vocab_size, feature_width and max_positions."""
        raise NotImplementedError

    def endpoints(self) -> dict[str, tuple[type[Message], Callable[[Message, Clock], Message | Steps[Message]]]]:
        """Round endpoints by rpc name: (request type, function of (message, clock) -> reply, or an operation
        returning the reply when the call runs forwards)."""
        raise NotImplementedError

    def session_kv_bytes(self, session) -> int:
        """Cache bytes one session holds."""
        raise NotImplementedError

    def info_extra(self) -> dict:
        """Role-specific fields of `WorkerInfo`."""
        return {}

    def measure(self) -> tuple[list[int], list[float]]:
        """Seconds of this worker's forward by rows, on its device (`eyas.autotree`)."""
        raise NotImplementedError

    def costs(self, msg: pb.CostsRequest, clock: Clock) -> pb.CostCurve:
        """Measure this worker's forwards by rows on the compute thread: how `tree: auto` prices a tree here."""
        clock.lap("decode")
        rows, seconds = self.measure()
        clock.lap("compute")
        return pb.CostCurve(rows=rows, seconds=seconds)

    def forget(self, request_id: str) -> None:
        """Drop role-specific bookkeeping of a released session."""

    def health_extra(self) -> dict:
        """This role's own counts in its health (`WorkerHealth`)."""
        return {}

    def followup(self, request_id: str) -> Future | None:
        """Work a finished call left running for its request on the compute thread (the request's next call waits
        for it), or None."""
        return None

    def interrupt(self, request_id: str, method: str) -> None:
        """A call of `method` for `request_id` has arrived: cut short the follow-up work its previous call left running
        (on the event loop, before the call waits for that work)."""

    def close_session(self, session) -> None:
        """Free a released session's caches (on the compute thread)."""
        session.close()

    async def gather(self, method: str, calls: list[tuple[Message, Served]]) -> None:
        """Fetch what decoded calls of `method` need from another worker before they run (on the event loop): a draft
        worker's Start has the request's target prefill its prompt. A call that cannot have it fails (`Served.fail`)."""

    async def relay(self, method: str, served: list[Served]) -> None:
        """Finish the served calls of `method` that need another worker (on the event loop, before they are
        encoded): a draft worker's Rounds go on to their targets."""

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, port: int = 0) -> WorkerInfo:
        """Load the models, then serve on the configured host; returns where the worker listens.

        A worker takes calls only from its own service: it refuses to start without the service's credential.
        """
        if not self.spec.token:
            raise WorkerStartError("token: a worker needs its service's credential (WorkerSpec.token)")
        self.loop = asyncio.get_running_loop()
        torch.set_num_threads(self.spec.threads)
        prepare(self.device)
        hf_logging.disable_progress_bar()
        try:
            await asyncio.to_thread(self.load)
        except Exception as exc:  # engine errors take several arguments; a plain one crosses Ray intact
            raise WorkerStartError(f"{type(exc).__name__}: {exc}") from None
        freeze_startup_objects()  # the models too
        endpoints = {**self.endpoints(), "Release": (pb.Release, self.release), "Costs": (pb.CostsRequest, self.costs)}
        methods = {name: self._unary(name, *endpoint) for name, endpoint in endpoints.items()}
        round_endpoints = {name: endpoints[name] for name in self.batched}
        methods["Batch"] = self._batch(round_endpoints)
        methods["Stream"] = self._stream(round_endpoints)
        methods["Health"] = grpc.unary_unary_rpc_method_handler(self._health)
        full_name = pb.DESCRIPTOR.services_by_name[self.service].full_name
        handler = grpc.method_handlers_generic_handler(full_name, methods)
        self._server, bound = await start_server(
            lambda server: server.add_generic_rpc_handlers((handler,)), self.spec.host, port, self.spec.token
        )
        return WorkerInfo(
            role=self.role,
            address=advertised_address(self.spec.host, bound),
            manifest_id=self.manifest.id,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            vocab_size=self.vocab_size,
            feature_width=self.feature_width,
            max_positions=self.max_positions,
            **self.info_extra(),
        )

    # -- serving ------------------------------------------------------------------------------
    def _unary(self, method: str, request_type: type[Message], fn: Callable[[Message, Clock], Message]) -> grpc.RpcMethodHandler:
        """A raw-bytes handler of one call: parse, run `fn` on the compute thread, serialize; timing in the trailer."""

        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            [call] = await self._serve(method, request_type, fn, [raw])
            start_then([call])
            if call.error is not None:
                await abort(context, call.error)
            context.set_trailing_metadata(call.clock.trailer())
            return call.data

        return grpc.unary_unary_rpc_method_handler(handle)

    def _batch(self, endpoints: dict[str, tuple[type[Message], Callable]]) -> grpc.RpcMethodHandler:
        """The `Batch` handler: several calls of one round endpoint, each served as `_unary` serves it alone and
        answered with its own status, their operations submitted together so that their forwards share batches."""

        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                reply, served = await self._reply(endpoints, self._parse(endpoints, raw))
                data = reply.SerializeToString()
                start_then(served)
                return data
            except Exception as exc:
                await abort(context, exc)

        return grpc.unary_unary_rpc_method_handler(handle)

    def _stream(self, endpoints: dict[str, tuple[type[Message], Callable]]) -> grpc.RpcMethodHandler:
        """The `Stream` handler: Batch calls over one long-lived stream, each served as it arrives (beside the ones in
        flight) and answered, in whatever order they end, with its id. A message that is not a batch of a round
        endpoint ends the stream with its refusal."""

        async def handle(requests, context: grpc.aio.ServicerContext) -> None:
            writing, answers = asyncio.Lock(), set()

            async def answer(batch: pb.CallBatch) -> None:
                reply, served = await self._reply(endpoints, batch)
                try:
                    async with writing:
                        await context.write(reply.SerializeToString())
                finally:
                    start_then(served)

            try:
                async for raw in requests:
                    task = asyncio.ensure_future(answer(self._parse(endpoints, raw)))  # a bad message ends the stream here
                    answers.add(task)
                    task.add_done_callback(answers.discard)
                await asyncio.gather(*answers)
            except Exception as exc:
                await abort(context, exc)

        return grpc.stream_stream_rpc_method_handler(handle)

    @staticmethod
    def _parse(endpoints: dict[str, tuple[type[Message], Callable]], raw: bytes) -> pb.CallBatch:
        """`raw` as a CallBatch of one of `endpoints`, else the refusal naming `message` or `method`."""
        try:
            batch = pb.CallBatch.FromString(raw)
        except DecodeError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "message", f"not a CallBatch: {exc}")
        if batch.method not in endpoints:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "method", f"{batch.method!r} is not one of {sorted(endpoints)}")
        return batch

    async def _reply(
        self, endpoints: dict[str, tuple[type[Message], Callable]], batch: pb.CallBatch
    ) -> tuple[pb.CallBatchReply, list[Served]]:
        """A CallBatch's reply, each call's own result (status, reply, phase seconds, forwards), and the calls."""
        served = await self._serve(batch.method, *endpoints[batch.method], list(batch.calls))
        reply = pb.CallBatchReply(id=batch.id)
        for call in served:
            timing = {
                "seconds": [call.clock.seconds[p] for p in PHASES],
                "forwards": [{"rows": rows, "seconds": s} for rows, s in call.forwards],
            }
            if call.error is None:
                reply.results.add(code=0, reply=call.data, **timing)  # built in place: the replies' bytes copied once
            else:
                code, field, details = status_of(call.error)
                reply.results.add(code=code.value[0], field=field, details=details, **timing)
        return reply, served

    async def _serve(self, method: str, request_type: type[Message], fn: Callable, raws: list[bytes]) -> list[Served]:
        """Serve calls of `method` (`_serve_calls`), finish those that need another worker (`relay`), and encode
        each reply."""
        served = await self._serve_calls(method, request_type, fn, raws)
        try:
            await self.relay(method, served)
            for call in served:
                if call.error is None:
                    call.data = call.reply.SerializeToString()
                    call.clock.lap("encode")
        except BaseException:
            start_then(served)  # no reply will leave
            raise
        return served

    async def _serve_calls(self, method: str, request_type: type[Message], fn: Callable, raws: list[bytes]) -> list[Served]:
        """Decode each call and run it on the compute thread after the calls of its request that arrived before it (and
        the work they left running there).

        The calls are submitted together, so that their forwards run as one batch per model. A request named
        twice in one batch has its second call refused (it would wait for the first, submitted with it).
        """
        loop = asyncio.get_running_loop()
        served = [Served() for _ in raws]
        admitted: list[tuple[int, str, Message]] = []  # (call, its request id, its message)
        keys: set[str] = set()
        for i, raw in enumerate(raws):
            try:
                try:
                    request = request_type.FromString(raw)
                except DecodeError as exc:
                    raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "message", f"not a {request_type.__name__}: {exc}")
                key = request_key(request)
                if key in keys:  # an empty id too: the second call would wait for the first, submitted with it
                    raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id", f"{key!r} has two calls in one batch")
            except ServiceError as exc:
                served[i].error = exc
                continue
            keys.add(key)
            served[i].clock.lap("decode")
            admitted.append((i, key, request))
        await self.gather(method, [(request, served[i]) for i, _, request in admitted])
        admitted = [(i, key, request) for i, key, request in admitted if served[i].error is None]
        turns = []  # per admitted call: the call it waits for, and its own end
        for _, key, _ in admitted:
            if key:
                self.interrupt(key, method)
            turns.append((self._tails.get(key), loop.create_future()))
            self._tails[key] = turns[-1][1]

        def settle(key: str, done: asyncio.Future) -> None:
            done.set_result(None)
            if self._tails.get(key) is done:
                del self._tails[key]

        def finish(ended: asyncio.Future, followups: list[Future | None]) -> None:
            """On the event loop, once every operation has ended: the calls' turns end (after their follow-up work)."""
            ended.set_result(None)
            for (_, key, _), (_, done), after in zip(admitted, turns, followups):
                if after is None:
                    settle(key, done)
                else:
                    after.add_done_callback(lambda _, key=key, done=done: loop.call_soon_threadsafe(settle, key, done))

        try:
            await asyncio.gather(*(asyncio.shield(previous) for previous, _ in turns if previous is not None))
        except BaseException:
            for (_, key, _), (_, done) in zip(admitted, turns):
                settle(key, done)
            raise
        if not admitted:
            return served
        submitted = self.scheduler.submit_many([self._steps(fn, request, served[i].clock) for i, _, request in admitted])
        ended = loop.create_future()
        left, counting = [len(submitted)], threading.Lock()

        def on_end(_) -> None:  # on the compute thread (or here, for an operation that ended before this was added)
            with counting:
                left[0] -= 1
                last = not left[0]
            if last:  # one hand-off to the event loop for the whole batch
                followups = [self.followup(key) if key else None for _, key, _ in admitted]
                loop.call_soon_threadsafe(finish, ended, followups)

        for future in submitted:
            future.add_done_callback(on_end)
        await ended
        ops = [future.result() for future in submitted]
        for (i, _, _), op in zip(admitted, ops):
            call = served[i]
            call.clock.lap("queue")  # since its operation ended: its batch-mates' ends, then this loop taking it up
            call.clock.move("compute", "batch", op.waited)
            call.forwards = op.forwards
            self.calls += 1
            self.busy_seconds += call.clock.seconds["compute"]
            if op.error is not None:
                call.error = op.error
            else:
                call.reply = op.result
        return served

    @staticmethod
    def _steps(fn: Callable, request: Message, clock: Clock) -> Steps[Message]:
        """A call as an operation of the compute thread: its receipt checks, its forwards (if any) and its reply."""
        clock.lap("queue")
        reply = fn(request, clock)
        if isinstance(reply, GeneratorType):
            reply = yield from reply
        return reply

    async def _health(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        sessions = dict(self.sessions)
        return pb.WorkerHealth(
            role=self.role,
            manifest_id=self.manifest.id,
            sessions=len(sessions),
            kv_bytes=sum(self.session_kv_bytes(s) for s in sessions.values()),
            rss_bytes=rss_bytes(),
            calls=self.calls,
            busy_seconds=self.busy_seconds,
            forwards=self.scheduler.lockstep.batches,
            forward_calls=self.scheduler.lockstep.calls,
            forward_seconds=self.scheduler.lockstep.seconds,
            **self.health_extra(),
        ).SerializeToString()

    def release(self, msg: pb.Release, clock: Clock) -> pb.Released:
        """Drop a request's session at any version and free its cache."""
        session = self.session(msg.ref)
        clock.lap("decode")
        freed = self.session_kv_bytes(session)
        del self.sessions[msg.ref.request_id]
        self.forget(msg.ref.request_id)
        self.close_session(session)
        clock.lap("compute")
        return pb.Released(ref=msg.ref, freed_kv_bytes=freed)

    # -- receipt checks -------------------------------------------------------------------------
    def check_ref(self, ref: tpb.RequestRef) -> None:
        """Every message names a request id, a nonnegative version and this worker's manifest id."""
        if not ref.request_id:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id", "is empty")
        if len(ref.request_id.encode()) > MAX_ID_BYTES:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id", f"is longer than {MAX_ID_BYTES} bytes")
        if ref.version < 0:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "version", f"{ref.version} is negative")
        if ref.manifest_id != self.manifest.id:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "manifest_id",
                f"{ref.manifest_id!r} is not the manifest this {self.role} worker serves ({self.manifest.id})",
            )

    def session(self, ref: tpb.RequestRef):
        """The session `ref` names, or NOT_FOUND."""
        self.check_ref(ref)
        session = self.sessions.get(ref.request_id)
        if session is None:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND, "request_id", f"no session for request {ref.request_id!r} on this {self.role} worker"
            )
        return session

    def new_session(self, ref: tpb.RequestRef) -> None:
        """Refuse to open a session for a request that already has one here."""
        self.check_ref(ref)
        if ref.request_id in self.sessions:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS, "request_id", f"request {ref.request_id!r} already has a session here"
            )

    def check_tokens(self, tokens: Sequence[int], field: str, limit: int | None = None) -> list[int]:
        """Token ids in the vocabulary, at most `limit` of them (the model's positions when None)."""
        limit = self.max_positions if limit is None else limit
        if limit and len(tokens) > limit:
            raise TreeError(field, f"{len(tokens)} tokens exceed the limit of {limit}")
        tokens = [int(t) for t in tokens]
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise TreeError(field, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return tokens

    def check_policy(self, policy: TreePolicy, field: str = "") -> None:
        """No tree knob may exceed the service's configured tree policy; `field` prefixes the knob named."""
        limit = self.spec.tree_limit
        for knob in ("width", "depth", "budget"):
            if getattr(policy, knob) > getattr(limit, knob):
                raise TreeError(f"{field}{knob}", f"{getattr(policy, knob)} exceeds the service limit {getattr(limit, knob)}")

    def same_request(self, outer: tpb.RequestRef, inner: tpb.RequestRef, field: str) -> None:
        """A carried message must name the same request and manifest as the call carrying it."""
        if inner.request_id != outer.request_id or inner.manifest_id != outer.manifest_id:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, field, "names another request or manifest than the call carrying it"
            )
