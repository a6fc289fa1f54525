"""The trace file format, version 2: a header, then length-prefixed, checksummed msgpack frames.

Header: `MAGIC` then the format version (uint16, little-endian). Frame: payload length and CRC-32 of
the payload (two uint32, little-endian), then the payload: a msgpack map with "kind" and the fields
of that kind's record below. The FlattenedTree and AcceptanceDecision protobuf messages are msgpack
binary values, so their bytes stay exactly as they were sent. Readers ignore unknown keys and skip
unknown kinds.

Version 1 recorded the uniforms each sampled round consumed in tree order; since sampling is keyed by
(seed, position) (docs/sampling.md) a round replays from its sampling options and its tree alone, and
version 1 files are refused with a message naming their version (`scan`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field, fields

import msgpack

MAGIC = b"\x89eyas-trace\n"
FORMAT_VERSION = 2
HEADER = MAGIC + struct.pack("<H", FORMAT_VERSION)
FRAME = struct.Struct("<II")
MAX_PAYLOAD = 1 << 30


class TraceFormatError(ValueError):
    """A frame's payload is not a valid record; the message names the field."""


@dataclass
class RequestStart:
    """A traced request begins: what it asked for and the manifest it runs under."""

    request: str
    prompt_ids: list[int]
    sampling: dict  # SamplingParams fields
    stop: dict  # max_new_tokens, eos_token_ids, stop_strings
    policy: dict  # TreePolicy fields
    manifest_id: str
    manifest: dict | None  # the full manifest when the recorder knows it
    source: str  # "local" (in process) or "service"
    time: float  # seconds since the epoch
    offset: int = field(default=-1, compare=False)  # byte offset of the frame in its file


@dataclass
class Round:
    """One round: the messages exactly as sent, the sampling options (seed included), what was emitted, timings."""

    request: str
    round: int
    version: int
    manifest_id: str
    tree: bytes  # eyas.v1.FlattenedTree
    decision: bytes  # eyas.v1.AcceptanceDecision
    policy: dict
    sampling: dict
    emitted: list[int]
    seconds: dict  # engine phases: draft, tree, verify, publish
    service_seconds: dict  # service split of remote calls (empty in process): rpc, serialize, queue, compute
    nodes_expanded: int
    nodes_recorded: int
    offset: int = field(default=-1, compare=False)


@dataclass
class RequestEnd:
    """A traced request finished (or failed, with `error`)."""

    request: str
    version: int
    finish_reason: str
    output_ids: list[int]
    error: str
    offset: int = field(default=-1, compare=False)


Record = RequestStart | Round | RequestEnd
KINDS: dict[str, type] = {"request": RequestStart, "round": Round, "end": RequestEnd}
KIND_OF = {cls: kind for kind, cls in KINDS.items()}

_CHECKS = {
    "str": lambda v: type(v) is str,
    "int": lambda v: type(v) is int,
    "float": lambda v: type(v) in (int, float),
    "bytes": lambda v: type(v) is bytes,
    "dict": lambda v: type(v) is dict,
    "dict | None": lambda v: v is None or type(v) is dict,
    "list[int]": lambda v: type(v) is list and all(type(x) is int for x in v),
}


def frame(payload: bytes) -> bytes:
    """One frame: length, CRC-32, payload."""
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def encode(record: Record) -> bytes:
    """A record as one frame."""
    data = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "offset"}
    return frame(msgpack.packb({"kind": KIND_OF[type(record)], **data}, use_bin_type=True))


def decode(payload: bytes, offset: int) -> Record | None:
    """The record in a frame's payload; None for a kind this reader does not know. Raises TraceFormatError."""
    try:
        data = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several types on malformed input
        raise TraceFormatError(f"payload is not msgpack ({type(exc).__name__}: {exc})") from None
    if type(data) is not dict:
        raise TraceFormatError(f"payload is a msgpack {type(data).__name__}, not a map")
    kind = data.get("kind")
    cls = KINDS.get(kind) if type(kind) is str else None
    if cls is None:
        return None
    values = {}
    for f in fields(cls):
        if f.name == "offset":
            continue
        if f.name not in data:
            raise TraceFormatError(f"{kind} record has no {f.name!r}")
        if not _CHECKS[f.type](data[f.name]):
            raise TraceFormatError(f"{kind} record field {f.name!r} is not {f.type}")
        values[f.name] = data[f.name]
    return cls(**values, offset=offset)
