"""How eyas runs Ray's control plane (docs/deploy.md): token authentication, and loopback for a one-machine service.

Ray reads these settings from the environment when it is imported (and its processes inherit them),
so `prepare` runs before anything imports Ray; importing this module does not. `Service.start` then
checks what Ray actually does (`requires_token`) instead of trusting the settings.
"""

from __future__ import annotations

import os

import grpc

AUTH_MODE = "RAY_AUTH_MODE"  # Ray's token authentication: "token" requires it, "disabled" turns it off
SINGLE_NODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray takes 127.0.0.1 as the node's address, as on a laptop
GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # a GCS call every client makes first, with an empty request


def prepare_embedded(loopback: bool) -> None:
    """Before Ray is imported, for a Ray this process starts: token authentication (unless RAY_AUTH_MODE says
    otherwise), and with `loopback` (a service bound to loopback) every Ray server on 127.0.0.1. A cluster joined
    with `--address` is left to the environment, which must name the cluster's token (docs/deploy.md)."""
    os.environ.setdefault(AUTH_MODE, "token")
    if loopback:
        os.environ.setdefault(SINGLE_NODE, "0")


def auth_mode() -> str:
    """RAY_AUTH_MODE as this process and the Ray it starts read it ("" when unset: Ray's own default)."""
    return os.environ.get(AUTH_MODE, "").lower()


def requires_token(gcs_address: str, timeout: float = 10.0) -> bool:
    """Whether the Ray cluster whose GCS is at `gcs_address` refuses a call that carries no token."""
    with grpc.insecure_channel(gcs_address) as channel:
        try:
            channel.unary_unary(GCS_PROBE)(b"", timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            raise ConnectionError(f"ray: the GCS at {gcs_address} did not answer ({exc.code().name}: {exc.details()})") from None
    return False
