"""Trace files: an append-only writer, and a reader that keeps every whole record of a damaged file.

The reader never raises on file content and never loops without progress: a file cut mid-record,
flipped bytes, an unknown format version or an empty file give the records up to the last whole one
and a `TraceProblem` (byte offset and what was wrong) for the rest, also issued as a `TraceWarning`.
"""

from __future__ import annotations

import os
import struct
import threading
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .format import FORMAT_VERSION, FRAME, HEADER, MAGIC, MAX_PAYLOAD, Record, RequestEnd, RequestStart, Round, TraceFormatError, decode


class TraceWarning(UserWarning):
    """Part of a trace file could not be read."""


@dataclass(frozen=True)
class TraceProblem:
    """Where reading stopped or a record was skipped, and why; `cut` when the file ends inside a record."""

    offset: int
    message: str
    cut: bool = False

    def __str__(self) -> str:
        return f"byte {self.offset}: {self.message}"


@dataclass
class TracedRequest:
    """One request's records, in file order; `key` is its id, suffixed with #2, #3... when an id repeats."""

    key: str
    start: RequestStart | None = None
    rounds: list[Round] = field(default_factory=list)
    end: RequestEnd | None = None


@dataclass
class Trace:
    """The whole, valid records of a trace file in file order, and what could not be read."""

    path: str
    records: list[Record]
    problems: list[TraceProblem]

    @property
    def requests(self) -> list[TracedRequest]:
        """The records grouped by request, in the order the requests started."""
        return group(self.records)

    def request(self, key: str) -> TracedRequest:
        """The request named `key` (its id, or id#n for a repeated id)."""
        for request in self.requests:
            if request.key == key:
                return request
        known = ", ".join(r.key for r in self.requests) or "none"
        raise ValueError(f"no request {key!r} in {self.path} (requests: {known})")


def group(records: list[Record]) -> list[TracedRequest]:
    """Records by request: a start record opens a request; rounds and the end go to the latest one with that id."""
    requests: list[TracedRequest] = []
    open_: dict[str, TracedRequest] = {}
    seen: dict[str, int] = {}
    for record in records:
        current = open_.get(record.request)
        if isinstance(record, RequestStart) or current is None:
            seen[record.request] = seen.get(record.request, 0) + 1
            n = seen[record.request]
            current = TracedRequest(record.request if n == 1 else f"{record.request}#{n}")
            open_[record.request] = current
            requests.append(current)
        if isinstance(record, RequestStart):
            current.start = record
        elif isinstance(record, Round):
            current.rounds.append(record)
        else:
            current.end = record
            del open_[record.request]
    return requests


def version_problem(version: int) -> str:
    """Why a trace of another format version is not read."""
    if version == 1:
        return (
            f"format version 1 is no longer read (this reader reads version {FORMAT_VERSION}): version 1 recorded "
            "per-round draws in tree order, which position-keyed sampling cannot replay; record the trace again"
        )
    return f"unknown format version {version} (this reader reads version {FORMAT_VERSION})"


def scan(stream: BinaryIO, size: int) -> Iterator[tuple[int, bytes] | TraceProblem]:
    """Whole frames (offset, payload) after the header, then at most one problem where reading had to stop."""
    header = stream.read(len(HEADER))
    if not header:
        yield TraceProblem(0, "empty file: no trace header")
        return
    if not header.startswith(MAGIC):
        if MAGIC.startswith(header):
            yield TraceProblem(0, f"file ends inside the header ({len(header)} of {len(HEADER)} bytes)")
        else:
            yield TraceProblem(0, "not an eyas trace (the magic bytes differ)")
        return
    if len(header) < len(HEADER):
        yield TraceProblem(0, f"file ends inside the header ({len(header)} of {len(HEADER)} bytes)")
        return
    (version,) = struct.unpack("<H", header[len(MAGIC) :])
    if version != FORMAT_VERSION:
        yield TraceProblem(len(MAGIC), version_problem(version))
        return
    offset = len(HEADER)
    while offset < size:
        prefix = stream.read(FRAME.size)
        if len(prefix) < FRAME.size:
            yield TraceProblem(offset, f"cut mid-record: {len(prefix)} of {FRAME.size} frame header bytes", cut=True)
            return
        length, crc = FRAME.unpack(prefix)
        left = size - offset - FRAME.size
        if length > min(left, MAX_PAYLOAD):
            yield TraceProblem(offset, f"cut mid-record or corrupted length: the frame claims {length} bytes, {left} remain", cut=True)
            return
        payload = stream.read(length)
        if len(payload) < length:
            yield TraceProblem(offset, f"cut mid-record: {len(payload)} of {length} payload bytes", cut=True)
            return
        if zlib.crc32(payload) != crc:
            yield TraceProblem(offset, "corrupted bytes: the frame's checksum does not match its payload")
            return
        yield offset, payload
        offset += FRAME.size + length


def read_trace(path: str | Path, warn: bool = True) -> Trace:
    """Every whole, valid record of a trace file; problems are listed (and warned about unless `warn` is False)."""
    records: list[Record] = []
    problems: list[TraceProblem] = []
    with open(path, "rb") as stream:
        for item in scan(stream, os.fstat(stream.fileno()).st_size):
            if isinstance(item, TraceProblem):
                problems.append(item)
                continue
            offset, payload = item
            try:
                record = decode(payload, offset)
            except TraceFormatError as exc:
                problems.append(TraceProblem(offset, f"record skipped: {exc}"))
                continue
            if record is None:
                problems.append(TraceProblem(offset, "record of an unknown kind skipped"))
            else:
                records.append(record)
    if warn:
        for problem in problems:
            warnings.warn(f"{path}: {problem}", TraceWarning, stacklevel=2)
    return Trace(str(path), records, problems)


class TraceWriter:
    """Appends frames to a trace file, creating it with a header; one writer may be shared by many threads.

    Reopening an existing trace checks it and drops an incomplete last frame (left by a crash), so the
    records appended after it stay readable; a trace damaged elsewhere is refused.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "ab")
        try:
            self._prepare()
        except BaseException:
            self._file.close()
            raise

    def _prepare(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        if size == 0:
            self._file.write(HEADER)
            self._file.flush()
            return
        end = len(HEADER)
        with open(self.path, "rb") as stream:
            for item in scan(stream, size):
                if isinstance(item, TraceProblem):
                    if not item.cut or item.offset < len(HEADER):
                        raise TraceFormatError(f"{self.path}: cannot append to a damaged trace: {item}")
                    break
                end = item[0] + FRAME.size + len(item[1])
        if end < size:
            warnings.warn(f"{self.path}: dropping {size - end} bytes after the last whole record", TraceWarning, stacklevel=3)
            self._file.truncate(end)

    def write(self, frames: bytes) -> None:
        """Append whole frames (one or more encoded records) and flush them."""
        with self._lock:
            self._file.write(frames)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
