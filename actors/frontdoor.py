"""The client-facing gRPC front door (service eyas.v1.Eyas): generation streams, batch jobs, status, scaling.

It converts messages and streams; the coordinator owns requests. A client that goes away
cancels its requests, which frees their caches at the next round boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from eyas import wire
from eyas.errors import RequestError
from eyas.v1 import service_pb2 as spb
from eyas.v1 import service_pb2_grpc as spb_grpc

from .coordinator import DEFAULT_MAX_NEW_TOKENS, Chunk, Coordinator, Job
from .errors import ServiceError, abort, status_of
from .server import start_server

_END = object()


def _emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[object], None]:
    """A thread-safe way for request threads to hand items to a call's event loop."""

    def emit(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: the server is stopping and nobody is listening

    return emit


class FrontDoor(spb_grpc.EyasServicer):
    """Implements eyas.v1.Eyas on top of a `Coordinator` running in the same process."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self._server: grpc.aio.Server | None = None

    async def start(self, host: str, port: int, token: str | None) -> int:
        self._server, bound = await start_server(lambda s: spb_grpc.add_EyasServicer_to_server(self, s), host, port, token)
        return bound

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
            job = self._admit(request, _emitter(asyncio.get_running_loop(), queue))
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
        """Admit every item as it arrives; stream one result per item as each finishes (errors included)."""
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()
        jobs: list[Job] = []
        items = 0

        async def read() -> None:
            nonlocal items
            async for item in request_iterator:
                items += 1
                collector = _Collector(item.id, self.coordinator.manifest_id, _emitter(loop, results))
                try:
                    jobs.append(self._admit(item.request, collector.add))
                except Exception as exc:
                    results.put_nowait(collector.failure(exc))
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
            status = await asyncio.to_thread(self.coordinator.scale, **sizes)
        except Exception as exc:
            await abort(context, exc)
        return spb.StatusReply(**status)

    async def Health(self, request: spb.HealthRequest, context: grpc.aio.ServicerContext) -> spb.HealthReply:
        return spb.HealthReply(status="SERVING", manifest_id=self.coordinator.manifest_id)


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
        code, field, details = status_of(exc)
        return spb.JobResult(id=self.item_id, error=spb.JobError(code=code.name, field=field, message=details))
