"""The client-facing gRPC front door (service eyas.v1.Eyas): generation streams, batch jobs, status, scaling.

It converts messages and streams; the coordinator owns requests. A client that goes away
cancels its requests, which frees their caches at the next round boundary. Messages arrive as
bytes (at most `service.max_request_bytes`, refused by gRPC before decoding) and are decoded
here, so a malformed one, or one carrying a field its schema does not define, is
INVALID_ARGUMENT; admission (tokenizing included) runs off the event loop, so no request delays
another call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from eyas import wire
from eyas.errors import RequestError, WireError
from eyas.v1 import service_pb2 as spb
from eyas.v1 import service_pb2_grpc as spb_grpc

from .errors import ServiceError, abort, status_of
from .job import DEFAULT_MAX_NEW_TOKENS, Chunk, Job
from .limits import MAX_POOL_SIZE, check_id
from .server import bind_server

_END = object()


def emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[object], None]:
    """A thread-safe way for request threads to hand items to a call's event loop."""

    def emit(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: the server is stopping and nobody is listening

    return emit


class Requests(Protocol):
    """What the front door asks of the coordinator (`eyas.actors.coordinator.Coordinator`) in its process."""

    manifest_id: str

    def admit(self, prompt: str | Sequence[int], emit: Callable[[Chunk | Exception], None], **options: Any) -> Job:
        """Validate a request and queue it; options: request_id, max_new_tokens, sampling, stop, ignore_eos, tree, trace."""

    def cancel(self, request_id: str) -> None: ...

    def status(self) -> dict: ...

    def scale(self, draft: int | None = None, target: int | None = None) -> dict: ...


class FrontDoor(spb_grpc.EyasServicer):
    """Implements eyas.v1.Eyas on top of the coordinator running in the same process."""

    def __init__(self, coordinator: Requests):
        self.coordinator = coordinator
        self._server: grpc.aio.Server | None = None
        self.max_request_bytes = 0

    def bind(self, host: str, port: int, token: str | None, max_request_bytes: int) -> int:
        """Take host:port for eyas.v1.Eyas (a busy port is refused at once); calls are answered only after `start`."""
        handler = self._handler()
        self.max_request_bytes = max_request_bytes
        self._server, bound = bind_server(
            lambda s: s.add_generic_rpc_handlers((handler,)), host, port, token, max_receive_bytes=max_request_bytes
        )
        return bound

    async def start(self) -> None:
        await self._server.start()

    def _handler(self) -> grpc.GenericRpcHandler:
        """Every method on raw request bytes, decoded by `_parse` so that a malformed message is INVALID_ARGUMENT."""

        def unary(request_type: type[Message], method: Callable) -> grpc.RpcMethodHandler:
            async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
                return await method(await _parse(raw, request_type, context), context)

            return grpc.unary_unary_rpc_method_handler(handle, response_serializer=_serialize)

        async def generate(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[spb.TokenChunk]:
            async for chunk in self.Generate(await _parse(raw, spb.GenerateRequest, context), context):
                yield chunk

        methods = {
            "Generate": grpc.unary_stream_rpc_method_handler(generate, response_serializer=_serialize),
            "RunJob": grpc.stream_stream_rpc_method_handler(self.RunJob, response_serializer=_serialize),
            "Cancel": unary(spb.CancelRequest, self.Cancel),
            "Status": unary(spb.StatusRequest, self.Status),
            "Scale": unary(spb.ScaleRequest, self.Scale),
            "Health": unary(spb.HealthRequest, self.Health),
        }
        return grpc.method_handlers_generic_handler(spb.DESCRIPTOR.services_by_name["Eyas"].full_name, methods)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=2.0)

    def _admit(self, msg: spb.GenerateRequest, emit: Callable[[object], None]) -> Job:
        """Check a GenerateRequest and hand it to the coordinator."""
        if msg.manifest_id and msg.manifest_id != self.coordinator.manifest_id:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "manifest_id",
                f"{msg.manifest_id!r} is not the manifest this service runs ({self.coordinator.manifest_id})",
            )
        kind = msg.WhichOneof("prompt")
        if kind is None:
            raise RequestError("prompt", "is missing (set text or token_ids)")
        return self.coordinator.admit(
            msg.text if kind == "text" else list(msg.token_ids.ids),
            emit,
            request_id=msg.request_id,
            max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
            sampling={f.name: value for f, value in msg.sampling.ListFields()},
            stop=list(msg.stop),
            ignore_eos=msg.ignore_eos,
            tree=wire.policy_from_proto(msg.tree) if msg.HasField("tree") else None,
            trace=msg.trace,
        )

    def _chunk(self, chunk: Chunk) -> spb.TokenChunk:
        msg = spb.TokenChunk(
            ref=wire.ref(chunk.request_id, chunk.version, self.coordinator.manifest_id),
            token_ids=chunk.token_ids,
            text=chunk.text,
            finish_reason=chunk.finish_reason,
            trace=chunk.trace,
        )
        if chunk.stats is not None:
            msg.stats.CopyFrom(spb.RequestStats(**chunk.stats))
        return msg

    async def Generate(self, request: spb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[spb.TokenChunk]:
        queue: asyncio.Queue = asyncio.Queue()
        try:
            job = await asyncio.to_thread(self._admit, request, emitter(asyncio.get_running_loop(), queue))
        except Exception as exc:
            await abort(context, exc)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    await abort(context, item)
                finished = bool(item.finish_reason)
                yield self._chunk(item)
        finally:
            if not finished:
                job.cancelled.set()

    async def RunJob(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator[spb.JobResult]:
        """Admit every item as it arrives; stream one result per item as each finishes (errors included).

        A malformed item gets an error result (field "item") and the job goes on; the stream ends after the
        last item's result.
        """
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()
        jobs: list[Job] = []
        items = 0

        async def read() -> None:
            nonlocal items
            try:
                async for raw in request_iterator:
                    items += 1
                    try:
                        item = spb.JobItem.FromString(raw)
                    except DecodeError as exc:
                        failure = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "item", f"item {items} is not a JobItem: {exc}")
                        results.put_nowait(_job_failure("", failure))
                        continue
                    collector = _Collector(item.id, self.coordinator.manifest_id, emitter(loop, results))
                    try:
                        wire.check_known(item)
                        check_id(item.id, "id")
                        jobs.append(await asyncio.to_thread(self._admit, item.request, collector.add))
                    except Exception as exc:
                        results.put_nowait(collector.failure(exc))
            finally:
                results.put_nowait(_END)

        reader = asyncio.create_task(read())
        sent, total = 0, None
        try:
            while total is None or sent < total:
                result = await results.get()
                if result is _END:
                    total = items
                    continue
                sent += 1
                yield result
            await reader
        finally:
            reader.cancel()
            for job in jobs:
                job.cancelled.set()

    async def Cancel(self, request: spb.CancelRequest, context: grpc.aio.ServicerContext) -> spb.CancelReply:
        try:
            check_id(request.ref.request_id, "ref.request_id")
            if request.ref.manifest_id and request.ref.manifest_id != self.coordinator.manifest_id:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "manifest_id", "is not this service's manifest")
            self.coordinator.cancel(request.ref.request_id)
        except Exception as exc:
            await abort(context, exc)
        return spb.CancelReply(ref=request.ref)

    async def Status(self, request: spb.StatusRequest, context: grpc.aio.ServicerContext) -> spb.StatusReply:
        return spb.StatusReply(**await asyncio.to_thread(self.coordinator.status))

    async def Scale(self, request: spb.ScaleRequest, context: grpc.aio.ServicerContext) -> spb.StatusReply:
        sizes = {name: getattr(request, name) if request.HasField(name) else None for name in ("draft", "target")}
        try:
            for name, size in sizes.items():
                if size is not None and size > MAX_POOL_SIZE:
                    raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, name, f"pool size {size} exceeds the limit of {MAX_POOL_SIZE}")
            status = await asyncio.to_thread(self.coordinator.scale, **sizes)
        except Exception as exc:
            await abort(context, exc)
        return spb.StatusReply(**status)

    async def Health(self, request: spb.HealthRequest, context: grpc.aio.ServicerContext) -> spb.HealthReply:
        return spb.HealthReply(status="SERVING", manifest_id=self.coordinator.manifest_id, max_request_bytes=self.max_request_bytes)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def _parse(raw: bytes, request_type: type[Message], context: grpc.aio.ServicerContext) -> Message:
    """Decode a request, or end the call with INVALID_ARGUMENT naming the message (or a field it does not define)."""
    try:
        msg = request_type.FromString(raw)
    except DecodeError as exc:
        await abort(context, ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "message", f"not a {request_type.__name__}: {exc}"))
    try:
        wire.check_known(msg)
    except WireError as exc:
        await abort(context, exc)
    return msg


class _Collector:
    """Gathers one job item's chunks into its JobResult."""

    def __init__(self, item_id: str, manifest_id: str, emit: Callable[[object], None]):
        self.item_id = item_id
        self.manifest_id = manifest_id
        self.emit = emit
        self.tokens: list[int] = []
        self.text: list[str] = []

    def add(self, item: Chunk | Exception) -> None:
        if isinstance(item, Exception):
            self.emit(self.failure(item))
            return
        self.tokens += item.token_ids
        self.text.append(item.text)
        if item.finish_reason:
            self.emit(
                spb.JobResult(
                    id=self.item_id,
                    ref=wire.ref(item.request_id, item.version, self.manifest_id),
                    token_ids=self.tokens,
                    text="".join(self.text),
                    finish_reason=item.finish_reason,
                    stats=spb.RequestStats(**item.stats),
                )
            )

    def failure(self, exc: Exception) -> spb.JobResult:
        return _job_failure(self.item_id, exc)


def _job_failure(item_id: str, exc: Exception) -> spb.JobResult:
    """The error result of one job item."""
    code, field, details = status_of(exc)
    return spb.JobResult(id=item_id, error=spb.JobError(code=code.name, field=field, message=details))
