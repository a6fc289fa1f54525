"""Plumbing shared by every eyas server: binding rules (the HTTP endpoint's too), the shared-token check, per-call timing.

Servers bind 127.0.0.1 unless configured otherwise; binding any other address requires a shared
token, and then every call must carry it as `x-eyas-token` metadata. Worker calls report where
their time went (decode, queue, compute, encode) in an `eyas-timing` trailer, so the coordinator
can split a round's overhead into RPC, serialization and queueing.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable

import grpc

from eyas.rpc import TOKEN_KEY

DEFAULT_HOST = "127.0.0.1"  # what every server binds unless configured otherwise
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible HTTP endpoint's (network.http_port; docs/http.md)
HTTP_PORT = ("network.http_port", "--http-port (0: no HTTP endpoint)")  # how a busy HTTP port's error names the setting
TIMING_KEY = "eyas-timing"
WORKER_MESSAGE_BYTES = 256 << 20  # largest message between coordinator and workers (a long prefill's features)
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", WORKER_MESSAGE_BYTES), ("grpc.max_send_message_length", WORKER_MESSAGE_BYTES)]
PHASES = ("decode", "queue", "batch", "compute", "encode")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC and peers write it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_host(host: str) -> str:
    """The address peers dial for a server bound to `host`: exactly that address (`localhost` as 127.0.0.1),
    or the node's IP for a wildcard bind."""
    if host in ("0.0.0.0", "::"):
        import ray  # only servers inside Ray bind a wildcard; clients import this module without Ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1" if host == "localhost" else host


def advertised_address(host: str, port: int) -> str:
    """`host:port` peers dial for a server bound to host:port."""
    return host_port(advertised_host(host), port)


def check_binding(host: str, token: str | None) -> None:
    """Refuse to expose a server beyond this machine without a shared token."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"host: binding {host} exposes the service beyond this machine; set network.token (or EYAS_TOKEN) "
            "so every call must carry the shared token"
        )


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


def bind_server(
    register: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    token: str | None,
    max_receive_bytes: int = WORKER_MESSAGE_BYTES,
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to host:port (0 picks a free port) with the services `register` adds, not yet
    serving; a message over `max_receive_bytes` is refused (RESOURCE_EXHAUSTED) before it is decoded.

    The port is taken exclusively (no SO_REUSEPORT): a second server on a busy port is refused here, naming it,
    instead of silently sharing the port with the first.
    """
    check_binding(host, token)
    interceptors = [TokenInterceptor(token)] if token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", WORKER_MESSAGE_BYTES),
        ],
    )
    register(server)
    check_port(host, port)  # found before gRPC tries, which would also log its own error line
    try:
        bound = server.add_insecure_port(host_port(host, port))
    except RuntimeError:
        raise _busy(host, port) from None
    return server, bound


def check_port(host: str, port: int, field: str = "port", flag: str = "--port") -> None:
    """Raise `OSError` naming host:port if something holds it (port 0 always passes: the server picks one)."""
    if port:
        _bind(host, port, field, flag).close()


def listening_socket(host: str, port: int, field: str, flag: str) -> socket.socket:
    """A socket listening on host:port for a server that takes its socket ready-made (HTTP); a busy port is refused
    here, naming the config `field` and the command-line `flag` that choose another."""
    sock = _bind(host, port, field, flag)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _busy(host: str, port: int, field: str = "port", flag: str = "--port") -> OSError:
    return OSError(f"{field}: {host_port(host, port)} is in use (another eyas serve?); choose another with {flag}")


def _bind(host: str, port: int, field: str, flag: str) -> socket.socket:
    """A socket bound to host:port with SO_REUSEADDR, as gRPC binds (no SO_REUSEPORT), or `_busy`."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise _busy(host, port, field, flag) from None
    return sock


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    token: str | None,
    max_receive_bytes: int = WORKER_MESSAGE_BYTES,
) -> tuple[grpc.aio.Server, int]:
    """Bind (as `bind_server`) and start serving."""
    server, bound = bind_server(register, host, port, token, max_receive_bytes)
    await server.start()
    return server, bound


class Clock:
    """Splits one call's server time into decode, queue, batch (waiting for batch-mates), compute and encode seconds."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.started = self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def skip(self) -> None:
        """Charge the time since the previous lap to no phase (a wait another worker's phases account for)."""
        self._last = time.perf_counter()

    def move(self, source: str, target: str, seconds: float) -> None:
        """Recharge `seconds` already counted under `source` to `target`."""
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def trailer(self) -> tuple[tuple[str, str], ...]:
        return ((TIMING_KEY, ",".join(f"{self.seconds[p]:.9f}" for p in PHASES)),)


def parse_timing(call: grpc.Call) -> dict[str, float]:
    """The server's phase seconds from a finished call's `eyas-timing` trailer (zeros when absent)."""
    for key, value in call.trailing_metadata() or ():
        if key == TIMING_KEY:
            return dict(zip(PHASES, map(float, value.split(","))))
    return dict.fromkeys(PHASES, 0.0)
