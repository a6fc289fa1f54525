"""The Python client of a running eyas service: generate, stream, batch jobs, status, scaling.

Talks gRPC only (no Ray in the client process). Failures raise `EyasError` with the status code
and the field the service named. A message larger than the service takes is refused here, before it
is sent, naming `prompt` (gRPC's transport on the service's side would refuse it without naming any).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf.message import Message

from eyas.rpc import FIELD_KEY, MIN_REQUEST_BYTES, call_metadata, field_of
from eyas.trace.store import TraceWriter
from eyas.v1 import service_pb2 as spb
from eyas.v1 import service_pb2_grpc as spb_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
SERVER_ENV = "EYAS_SERVER"  # overrides DEFAULT_ADDRESS for every client


def default_address() -> str:
    """Where clients look for a service: $EYAS_SERVER, else 127.0.0.1:50051."""
    return os.environ.get(SERVER_ENV) or DEFAULT_ADDRESS
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "seed")  # top_k: sampling top-k
TREE_KNOBS = ("width", "depth", "budget")  # width: the tree's expansion width; "stop" may come with them


class EyasError(RuntimeError):
    """A call the service refused or could not serve: `code` (a gRPC status name), `field`, `details`."""

    def __init__(self, code: str, field: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.field = field
        self.details = details

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, address: str) -> "EyasError":
        code, trailers = error.code(), error.trailing_metadata() or ()
        answered = any(key == FIELD_KEY for key, _ in trailers)  # the service names a field on every refusal
        if code == grpc.StatusCode.UNAVAILABLE and not answered:
            return cls(code.name, "", f"no eyas service answers at {address} ({error.details()}); start one with `eyas serve`")
        return cls(code.name, field_of(trailers), error.details())


@dataclass
class Chunk:
    """Tokens committed by one round; the last chunk has `finish_reason` and `stats`."""

    request_id: str
    version: int
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)


@dataclass
class Result:
    """A finished generation."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict


def build_request(
    prompt: str | Sequence[int],
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    tree: dict | None = None,
    request_id: str = "",
    manifest_id: str = "",
    trace: bool = False,
) -> spb.GenerateRequest:
    """A GenerateRequest; options left as None take the service's defaults; `trace` asks for the trace frames."""
    msg = spb.GenerateRequest(
        request_id=request_id, manifest_id=manifest_id, stop=list(stop), ignore_eos=ignore_eos, trace=trace
    )
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(int(t) for t in prompt)
    if max_new_tokens is not None:
        msg.max_new_tokens = max_new_tokens
    for name, value in zip(SAMPLING_OPTIONS, (temperature, top_p, top_k, seed)):
        if value is not None:
            setattr(msg.sampling, name, value)
    if tree is not None:
        if set(tree) - {"stop"} != set(TREE_KNOBS):
            raise ValueError(f"tree: give exactly {', '.join(TREE_KNOBS)}, and stop if wanted (width is the expansion width; top_k is sampling only), got {sorted(tree)}")
        msg.tree.width, msg.tree.depth, msg.tree.budget = (tree[knob] for knob in TREE_KNOBS)
        msg.tree.stop = tree.get("stop", 0.0)
    return msg


def chunk_from_proto(msg: spb.TokenChunk) -> Chunk:
    stats = message_to_dict(msg.stats) if msg.HasField("stats") else {}
    return Chunk(msg.ref.request_id, msg.ref.version, list(msg.token_ids), msg.text, msg.finish_reason, stats)


class Client:
    """Talks to an eyas front door at `address` (host:port; default `default_address()`); `token` is needed when the service requires one."""

    def __init__(self, address: str | None = None, token: str | None = None, timeout: float | None = None):
        self.address = address or default_address()
        self.timeout = timeout
        self.metadata = call_metadata(token or os.environ.get("EYAS_TOKEN"))
        self._channel = grpc.insecure_channel(self.address)
        self.stub = spb_grpc.EyasStub(self._channel)
        self._max_request_bytes: int | None = None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, prompt: str | Sequence[int], trace: str | Path | None = None, **options) -> Iterator[Chunk]:
        """Yield token chunks as rounds commit; options as `build_request` (max_new_tokens, temperature, ...).

        With `trace`, the service streams this request's trace records back (the tree and decision bytes as
        they crossed its wire) and they are appended to that local file as they arrive.
        """
        request = build_request(prompt, trace=trace is not None, **options)
        refusal = self.oversize(request, request)
        if refusal is not None:
            raise refusal
        writer = TraceWriter(trace) if trace is not None else None
        call = self.stub.Generate(request, timeout=self.timeout, metadata=self.metadata)
        try:
            for msg in call:
                if writer is not None and msg.trace:
                    writer.write(msg.trace)
                yield chunk_from_proto(msg)
        except grpc.RpcError as error:
            raise EyasError.from_rpc(error, self.address) from None
        finally:
            call.cancel()
            if writer is not None:
                writer.close()

    def generate(self, prompt: str | Sequence[int], trace: str | Path | None = None, **options) -> Result:
        """Generate one completion and return it whole; `trace` appends its rounds to that trace file."""
        tokens: list[int] = []
        text: list[str] = []
        for chunk in self.stream(prompt, trace, **options):
            tokens += chunk.token_ids
            text.append(chunk.text)
        return Result(chunk.request_id, tokens, "".join(text), chunk.finish_reason, chunk.stats)

    def oversize(self, message: Message, request: spb.GenerateRequest) -> EyasError | None:
        """The refusal of a `message` (carrying `request`) larger than the service takes, or None when it fits: it
        names `prompt` when the rest of the message would fit. The service's limit is asked once, from Health."""
        size = message.ByteSize()
        if size <= MIN_REQUEST_BYTES:
            return None
        if self._max_request_bytes is None:
            self._max_request_bytes = self.health()["max_request_bytes"]
        limit = self._max_request_bytes
        if size <= limit:
            return None
        prompt = len(request.text.encode()) if request.HasField("text") else request.token_ids.ByteSize()
        field = "prompt" if size - prompt <= limit else "message"
        return EyasError(
            "INVALID_ARGUMENT", field,
            f"{field}: the request is {size} bytes, over the service's limit of {limit} (service.max_request_bytes)",
        )

    def _unary(self, method: str, request):
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as error:
            raise EyasError.from_rpc(error, self.address) from None

    def status(self) -> dict:
        """Pools (workers, their load, sessions and memory), request counts and acceptance so far."""
        return message_to_dict(self._unary("Status", spb.StatusRequest()))

    def scale(self, draft: int | None = None, target: int | None = None) -> dict:
        """Resize the pools at run time; returns the status afterwards."""
        request = spb.ScaleRequest()
        if draft is not None:
            request.draft = draft
        if target is not None:
            request.target = target
        return message_to_dict(self._unary("Scale", request))

    def health(self) -> dict:
        return message_to_dict(self._unary("Health", spb.HealthRequest()))

    def cancel(self, request_id: str) -> None:
        self._unary("Cancel", spb.CancelRequest(ref={"request_id": request_id}))


def message_to_dict(msg: Message) -> dict:
    """Every field of a message as plain Python values (ints stay ints, maps become dicts)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            messages = f.message_type.fields_by_name["value"].message_type is not None
            out[f.name] = {k: message_to_dict(v) if messages else v for k, v in value.items()}
        elif f.is_repeated:
            out[f.name] = [message_to_dict(v) if f.message_type is not None else v for v in value]
        elif f.message_type is not None:
            out[f.name] = message_to_dict(value)
        else:
            out[f.name] = value
    return out
