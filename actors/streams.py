"""Batch calls over one long-lived gRPC stream per worker (docs/wire.md, "Streams").

A round's calls go to a worker many times a second; a unary call pays a call's set-up on both ends each time, a
message on an open stream does not. `BatchStream` keeps one `Stream` call open to a worker from the event loop of the
process that calls it (the coordinator's, a draft worker's), numbers each CallBatch it sends and hands each
CallBatchReply, by number, to the caller waiting for it. When the stream ends, every call in flight fails with its
status and the next call opens a new stream.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import grpc

from eyas.rpc import FIELD_KEY, field_of
from eyas.v1 import round_pb2 as pb

from .server import CHANNEL_OPTIONS


BROKEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)  # what gRPC's core may end a broken connection's call with


def status_code(error: grpc.RpcError) -> grpc.StatusCode:
    """A failed call's status code as the worker meant it: an INTERNAL or UNKNOWN that carries no `eyas-field`
    trailer was set by gRPC's core, not by a worker (every worker refusal carries one), so the connection broke and
    the worker is lost: UNAVAILABLE."""
    code = error.code()
    if code in BROKEN and not any(key == FIELD_KEY for key, _ in error.trailing_metadata() or ()):
        return grpc.StatusCode.UNAVAILABLE
    return code


class StreamEnded(Exception):
    """The stream to a worker ended before a call's reply: its gRPC status, the field the worker named, details."""

    def __init__(self, code: grpc.StatusCode, field: str, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.field = field
        self.details = details


class BatchStream:
    """One worker's `Stream` rpc, kept open by the event loop that first uses it."""

    def __init__(self, address: str, service: str, metadata: tuple[tuple[str, str], ...]):
        self.address = address
        self._method = f"/{service}/Stream"
        self._metadata = metadata
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._writing: asyncio.Lock | None = None  # one write in flight at a time, as gRPC requires

    async def call(self, batch: pb.CallBatch, timeout: float, written: Callable[[], None] | None = None) -> pb.CallBatchReply:
        """Send `batch` (its id set here) and return its reply; `StreamEnded` when the stream ends first, and
        DEADLINE_EXCEEDED after `timeout` seconds (the worker may still answer; the answer is dropped). `written` runs
        once the batch is on its way."""
        stream = self._call or self._open()
        batch.id = next(self._ids)
        answer = self._waiting[batch.id] = asyncio.get_running_loop().create_future()
        try:
            async with self._writing:
                await stream.write(batch.SerializeToString())
            if written is not None:
                written()
            return await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            raise StreamEnded(grpc.StatusCode.DEADLINE_EXCEEDED, "", f"no reply from {self.address} within {timeout:g}s") from None
        except grpc.RpcError as exc:  # the write failed: the stream is over
            raise StreamEnded(status_code(exc), "", exc.details() or "") from None
        finally:
            self._waiting.pop(batch.id, None)

    def _open(self) -> grpc.aio.StreamStreamCall:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._writing = asyncio.Lock()
        self._call = self._channel.stream_stream(self._method)(metadata=self._metadata)
        asyncio.get_running_loop().create_task(self._read(self._call))
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        """Hand each reply to its caller until the stream ends; then fail every call still waiting on it."""
        ended = StreamEnded(grpc.StatusCode.UNAVAILABLE, "", f"the stream to {self.address} ended")
        try:
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    break
                reply = pb.CallBatchReply.FromString(raw)
                answer = self._waiting.get(reply.id)
                if answer is not None and not answer.done():
                    answer.set_result(reply)
        except grpc.RpcError as exc:
            ended = StreamEnded(status_code(exc), field_of(exc.trailing_metadata()), exc.details() or "")
        except Exception as exc:  # a reply that is no CallBatchReply: the stream cannot be trusted further
            ended = StreamEnded(grpc.StatusCode.INTERNAL, "results", f"the worker at {self.address} answered no CallBatchReply: {exc}")
            call.cancel()
        if self._call is call:
            self._call = None
        for answer in list(self._waiting.values()):
            if not answer.done():
                answer.set_exception(ended)

    async def close(self) -> None:
        """End the stream and its channel; calls in flight fail."""
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._call = None, None
