"""The wire's floor: a bare gRPC stream round trip between two processes on this machine, no eyas code on either
side. `eyas bench service` reads a round's overhead against it (docs/cli.md)."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

import grpc

METHOD = "/eyas.bench.Floor/Echo"

# The other process: a stream that answers every message with `reply_bytes` bytes; prints its port, then serves.
ECHO = """
import asyncio, sys
import grpc

async def main(reply_bytes):
    server = grpc.aio.server()
    async def echo(requests, context):
        reply = bytes(reply_bytes)
        async for _ in requests:
            yield reply
    handler = grpc.method_handlers_generic_handler("eyas.bench.Floor", {"Echo": grpc.stream_stream_rpc_method_handler(echo)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main(int(sys.argv[1])))
"""


async def _trips(port: int, request_bytes: int, trips: int) -> list[float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD)()
        message, seconds = bytes(request_bytes), []
        for _ in range(trips):
            started = time.perf_counter()
            await call.write(message)
            await call.read()
            seconds.append(time.perf_counter() - started)
        await call.done_writing()
        return seconds


def wire_floor(request_bytes: int = 4096, reply_bytes: int = 65536, trips: int = 2000) -> dict:
    """Median, 10th and 90th percentile ms of `trips` round trips (the first tenth are warm-up) of `request_bytes` out
    and `reply_bytes` back over one gRPC stream to a fresh process."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(reply_bytes)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(echo.stdout.readline())
        seconds = sorted(asyncio.run(_trips(port, request_bytes, trips))[trips // 10 :])
    finally:
        echo.kill()
        echo.wait()
    at = lambda q: 1e3 * seconds[int(q * (len(seconds) - 1))]
    return {
        "request_bytes": request_bytes,
        "reply_bytes": reply_bytes,
        "trips": len(seconds),
        "median_ms": 1e3 * statistics.median(seconds),
        "p10_ms": at(0.1),
        "p90_ms": at(0.9),
    }
