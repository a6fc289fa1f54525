"""How the service reports failures: gRPC status codes with details and an `eyas-field` trailer naming the field.

Engine errors map by kind: malformed input (TreeError, RequestError, WireError, ValueError) is
INVALID_ARGUMENT, a stale or future version (VersionError) or a manifest mismatch is
FAILED_PRECONDITION, a request the KV pool cannot hold (KVCapacityError) is
RESOURCE_EXHAUSTED, a broken target group (GroupError) is UNAVAILABLE; the service adds NOT_FOUND, ALREADY_EXISTS and the rest through `ServiceError`.
"""

from __future__ import annotations

import logging

import grpc

from eyas.errors import VersionError
from eyas.manifest import ManifestMismatch
from eyas.rpc import FIELD_KEY
from eyas.runtime.kv import KVCapacityError
from eyas.runtime.shard import GroupError

log = logging.getLogger("eyas.service")
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # a CallResult's code -> its status


class ServiceError(Exception):
    """A failure with an explicit gRPC status code and the field it concerns."""

    def __init__(self, code: grpc.StatusCode, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.code = code
        self.field = field


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(code, field, details) for an exception raised while serving a call."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.field, str(exc)
    if isinstance(exc, GroupError):  # a rank of the worker's group died: the worker is as good as lost
        return grpc.StatusCode.UNAVAILABLE, "group", str(exc)
    if isinstance(exc, KVCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, exc.field, str(exc)
    if isinstance(exc, (VersionError, ManifestMismatch)):
        return grpc.StatusCode.FAILED_PRECONDITION, exc.field, str(exc)
    if isinstance(exc, ValueError):
        field = getattr(exc, "field", None) or str(exc).split(":", 1)[0].strip()
        return grpc.StatusCode.INVALID_ARGUMENT, field, str(exc)
    log.exception("internal error while serving a call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "", f"internal error: {type(exc).__name__}: {exc}"


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status `exc` maps to; the field also travels as trailing metadata."""
    code, field, details = status_of(exc)
    await context.abort(code, details, trailing_metadata=((FIELD_KEY, field),))
