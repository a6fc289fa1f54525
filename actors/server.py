"""gRPC plumbing shared by every eyas server: binding rules, the shared-token check, per-call timing.

Servers bind 127.0.0.1 unless configured otherwise; binding any other address requires a shared
token, and then every call must carry it as `x-eyas-token` metadata. Worker calls report where
their time went (decode, queue, compute, encode) in an `eyas-timing` trailer, so the coordinator
can split a round's overhead into RPC, serialization and queueing.
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable

import grpc

TOKEN_KEY = "x-eyas-token"
TIMING_KEY = "eyas-timing"
PHASES = ("decode", "queue", "compute", "encode")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advertised_host(host: str) -> str:
    """The address peers dial for a server bound to `host`: the node's IP for a wildcard bind."""
    if host in ("0.0.0.0", "::"):
        import ray  # only servers inside Ray bind a wildcard; clients import this module without Ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1" if is_loopback(host) else host


def check_binding(host: str, token: str | None) -> None:
    """Refuse to expose a server beyond this machine without a shared token."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"host: binding {host} exposes the service beyond this machine; set network.token (or EYAS_TOKEN) "
            "so every call must carry the shared token"
        )


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata a client attaches to every call."""
    return ((TOKEN_KEY, token),) if token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every call that does not carry the shared token (UNAUTHENTICATED)."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        sent = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if handler is None or hmac.compare_digest(str(sent).encode(), self._token):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that aborts with UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{TOKEN_KEY}: missing or wrong shared token")

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


async def start_server(
    register: Callable[[grpc.aio.Server], None], host: str, port: int, token: str | None
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on host:port (0 picks a free port) with the services `register` adds."""
    check_binding(host, token)
    interceptors = [TokenInterceptor(token)] if token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)],
    )
    register(server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise OSError(f"port: cannot listen on {host}:{port} (in use?): {exc}") from None
    await server.start()
    return server, bound


class Clock:
    """Splits one call's server time into decode, queue, compute and encode seconds."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def trailer(self) -> tuple[tuple[str, str], ...]:
        return ((TIMING_KEY, ",".join(f"{self.seconds[p]:.9f}" for p in PHASES)),)


def parse_timing(call: grpc.Call) -> dict[str, float]:
    """The server's phase seconds from a finished call's `eyas-timing` trailer (zeros when absent)."""
    for key, value in call.trailing_metadata() or ():
        if key == TIMING_KEY:
            return dict(zip(PHASES, map(float, value.split(","))))
    return dict.fromkeys(PHASES, 0.0)
