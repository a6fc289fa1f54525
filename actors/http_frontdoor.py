"""The OpenAI-compatible HTTP front door: /v1/completions, /v1/chat/completions, /v1/models, /health (docs/http.md).

Starlette on uvicorn, served on the coordinator's event loop beside the gRPC front door. A request takes
the gRPC one's path: `Coordinator.admit` in a thread (it validates and tokenizes), then the chunks its
rounds emit, through a queue, into one JSON response or a stream of server-sent events, one event per
committed round. A body over `service.max_request_bytes` is refused before it is read whole. A client
that goes away cancels its requests, which frees their caches at the next round boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .frontdoor import Requests, emitter
from .http_api import ApiError, Generation, Reply, ServedModel, parse_request, render_chat
from .job import Chunk, Job
from .metrics import ServiceMetrics
from .server import HTTP_PORT, check_binding, listening_socket

CLIENT_CLOSED = 499  # the status counted for a request whose client went away first (nginx's convention)
DONE = "data: [DONE]\n\n"
_GONE = object()  # queued when the client disconnects


class ClientGone(Exception):
    """The client closed its connection before its response was ready."""


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process it runs in (a Ray actor) owns its signals."""

    def capture_signals(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _Run:
    """One HTTP request in the coordinator: its jobs (one per choice), the queue their chunks arrive on, its reply."""

    def __init__(self, gen: Generation, model: ServedModel):
        self.gen = gen
        self.reply = Reply(gen, model)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jobs: list[Job] = []

    async def next(self) -> tuple[int, Chunk]:
        """The next (choice, chunk); a choice's failure raises its ApiError, a client gone raises ClientGone."""
        item = await self.queue.get()
        if item is _GONE:
            raise ClientGone
        index, chunk = item
        if isinstance(chunk, Exception):
            raise ApiError.of(chunk, self.gen.param)
        return index, chunk

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled.set()


class HttpFrontDoor:
    """Serves the OpenAI API for the coordinator running in the same process."""

    def __init__(self, coordinator: Requests, metrics: ServiceMetrics, token: str | None, max_request_bytes: int):
        self.coordinator = coordinator
        self.metrics = metrics
        self.token = token
        self.max_request_bytes = max_request_bytes
        self.model: ServedModel | None = None
        self._socket = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    def bind(self, host: str, port: int) -> int:
        """Take host:port (a busy port is refused at once); requests are answered only after `start`."""
        check_binding(host, self.token)
        self._socket = listening_socket(host, port, *HTTP_PORT)
        return self._socket.getsockname()[1]

    async def start(self, model: ServedModel) -> None:
        """Serve `model` on the bound socket, as a task of the running event loop."""
        self.model = model
        config = uvicorn.Config(
            self._app(), http="httptools", lifespan="off", log_config=None, log_level="warning", access_log=False,
            proxy_headers=False, server_header=False, timeout_graceful_shutdown=2,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
        elif self._socket is not None:
            self._socket.close()

    def _app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self._endpoint("completions", partial(self._generate, kind="completion")), methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint("chat_completions", partial(self._generate, kind="chat")), methods=["POST"]),
            Route("/v1/models", self._endpoint("models", self._models), methods=["GET"]),
            Route("/health", self._endpoint("health", self._health, auth=False), methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._no_route})

    def _endpoint(self, name: str, handler: Callable[[Request], Awaitable[Response]], auth: bool = True) -> Callable:
        """`handler` behind the token check, its failures as OpenAI error objects, counted by endpoint and status."""

        async def handle(request: Request) -> Response:
            try:
                if auth:
                    self._authorize(request)
                response = await handler(request)
            except ClientGone:
                response = Response(status_code=CLIENT_CLOSED)
            except Exception as exc:
                response = _error(ApiError.of(exc))
            self.metrics.http_requests.labels(name, str(response.status_code)).inc()
            return response

        return handle

    async def _no_route(self, request: Request, exc: HTTPException) -> Response:
        self.metrics.http_requests.labels("other", str(exc.status_code)).inc()
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            return _error(ApiError(405, f"{where}: method not allowed", None, "UNIMPLEMENTED"))
        return _error(ApiError(404, f"{where}: no such endpoint (see docs/http.md)", None, "NOT_FOUND"))

    def _authorize(self, request: Request) -> None:
        """With a shared token configured, every call must carry it as its Bearer key, as every gRPC call must."""
        if self.token is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.token.encode()):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <the service's network.token>", None, "UNAUTHENTICATED")

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model.card()]})

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _json(self, request: Request) -> dict:
        """The body as a JSON object; one over service.max_request_bytes is refused (413) before it is read whole."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise _too_large(int(declared), self.max_request_bytes)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_request_bytes:
                raise _too_large(size, self.max_request_bytes)
            parts.append(part)
        try:
            body = json.loads(b"".join(parts))
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    async def _generate(self, request: Request, kind: str) -> Response:
        gen = parse_request(kind, await self._json(request))
        if gen.model is not None and gen.model != self.model.name:
            raise ApiError(404, f"model: {gen.model!r} is not served here (GET /v1/models lists {self.model.name!r})", "model", "NOT_FOUND")
        run = _Run(gen, self.model)
        try:
            run.jobs = await asyncio.to_thread(self._admit, gen, run.reply.id, emitter(asyncio.get_running_loop(), run.queue))
        except Exception as exc:
            raise ApiError.of(exc, gen.param) from None
        run.reply.prompt_tokens = len(run.jobs[0].state.prompt_ids)
        watcher = asyncio.create_task(_watch(request, run.queue))
        streaming = False
        try:
            first = await run.next()  # a failure before the first round (no worker left) still gets its status code
            if gen.stream:
                streaming = True
                return StreamingResponse(self._events(run, first), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            run.reply.chunk(*first)
            while not run.reply.done:
                run.reply.chunk(*await run.next())
            return JSONResponse(run.reply.body())
        finally:
            watcher.cancel()
            if not streaming:
                run.cancel()

    def _admit(self, gen: Generation, reply_id: str, emit: Callable[[object], None]) -> list[Job]:
        """Admit one coordinator request per choice; later choices reuse the first one's prompt tokens."""
        prompt = render_chat(self.model.tokenizer, gen.prompt) if gen.kind == "chat" else gen.prompt
        jobs: list[Job] = []
        try:
            for i in range(gen.n):
                jobs.append(self.coordinator.admit(prompt, partial(_tagged, emit, i), request_id=f"{reply_id}-{i}", **gen.options(i)))
                prompt = jobs[0].state.prompt_ids
        except BaseException:
            for job in jobs:
                job.cancelled.set()
            raise
        return jobs

    async def _events(self, run: _Run, first: tuple[int, Chunk]) -> AsyncIterator[str]:
        """The stream: a chunk per committed round of each choice, its finish, the usage when asked, then [DONE]; a
        failure is an error object in the stream. Closed early (the client went away), it cancels every choice."""
        try:
            if run.reply.chat:
                for choice in run.reply.choices:
                    yield _event(run.reply.role_chunk(choice.index))
            item = first
            while True:
                yield _event(run.reply.chunk(*item))
                if run.reply.done:
                    break
                item = await run.next()
            if run.gen.include_usage:
                yield _event(run.reply.usage_chunk())
        except ApiError as error:
            yield _event(error.body())
        finally:
            run.cancel()
        yield DONE


def _tagged(emit: Callable[[object], None], index: int, item: object) -> None:
    emit((index, item))


async def _watch(request: Request, queue: asyncio.Queue) -> None:
    """Queue _GONE once the client disconnects (its body is read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(_GONE)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the body's {size} bytes exceed service.max_request_bytes ({limit})", None, "RESOURCE_EXHAUSTED")
