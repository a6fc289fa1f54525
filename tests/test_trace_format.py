"""The trace file format: append-only writing, and a reader that survives any damage.

A trace cut anywhere, with flipped or inserted bytes, with an unknown format version, or empty,
reads up to its last whole record and reports the byte offset of what was wrong; it never raises
and never hangs. Hypothesis fuzzes the reader and the record decoder.
"""

import struct
import warnings

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eyas.trace import RequestEnd, RequestStart, Round, TraceFormatError, TraceWarning, TraceWriter, read_trace
from eyas.trace.format import FRAME, HEADER, MAGIC, decode, encode, frame

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def start(request="r1"):
    return RequestStart(request, [5, 6, 7], {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0},
                        {"max_new_tokens": 4, "eos_token_ids": [2], "stop_strings": []},
                        {"width": 4, "depth": 3, "budget": 8}, "m" * 16, None, "local", 1.5)


def round_(n, request="r1"):
    return Round(request, n, n, "m" * 16, b"tree\x00" * (n + 1), b"decision" * n, {"width": 4, "depth": 3, "budget": 8},
                 {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 3}, [10 + n],
                 {"draft": 0.01, "verify": 0.02}, {}, 3, 9)


RECORDS = [start(), round_(0), round_(1), round_(2), RequestEnd("r1", 3, "length", [10, 11, 12], "")]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "t.trace"
    with TraceWriter(path) as writer:
        for record in RECORDS:
            writer.write(encode(record))
    return path


def offsets(data: bytes) -> list[int]:
    """Start offset of every frame, and the end of the file."""
    out, at = [], len(HEADER)
    while at < len(data):
        out.append(at)
        at += FRAME.size + FRAME.unpack_from(data, at)[0]
    return out + [at]


def read_quietly(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        return read_trace(path)


def test_records_round_trip_and_the_header_is_written_once(trace_file):
    with TraceWriter(trace_file) as writer:  # reopening appends
        writer.write(encode(start("r2")))
    data = trace_file.read_bytes()
    assert data.startswith(HEADER) and data.count(MAGIC) == 1
    trace = read_trace(trace_file)
    assert trace.records == [*RECORDS, start("r2")] and trace.problems == []
    assert [r.offset for r in trace.records] == offsets(data)[:-1]
    requests = trace.requests
    assert [(r.key, len(r.rounds), r.end is not None) for r in requests] == [("r1", 3, True), ("r2", 0, False)]


def test_a_repeated_request_id_opens_a_new_request(tmp_path):
    path = tmp_path / "t.trace"
    with TraceWriter(path) as writer:
        for record in [*RECORDS, *RECORDS]:
            writer.write(encode(record))
    assert [r.key for r in read_trace(path).requests] == ["r1", "r1#2"]


def test_an_empty_file_reads_nothing_and_says_so(tmp_path):
    path = tmp_path / "empty.trace"
    path.write_bytes(b"")
    with pytest.warns(TraceWarning, match="byte 0: empty file"):
        trace = read_trace(path)
    assert trace.records == [] and [p.offset for p in trace.problems] == [0]


def test_a_trace_cut_anywhere_keeps_every_whole_record(trace_file):
    data = trace_file.read_bytes()
    ends = offsets(data)
    for cut in range(len(data)):
        trace_file.write_bytes(data[:cut])
        trace = read_quietly(trace_file)
        whole = sum(1 for end in ends[1:] if end <= cut)
        assert trace.records == RECORDS[:whole], cut
        if cut > len(HEADER) and cut not in ends:
            (problem,) = trace.problems
            assert problem.cut and "cut mid-record" in problem.message and problem.offset == ends[whole]


def test_a_flipped_byte_stops_reading_at_the_damaged_record_with_its_offset(trace_file):
    data = bytearray(trace_file.read_bytes())
    ends = offsets(bytes(data))
    inside = ends[2] + FRAME.size + 3  # a byte in the third record's payload
    data[inside] ^= 0x40
    trace_file.write_bytes(bytes(data))
    with pytest.warns(TraceWarning, match=f"byte {ends[2]}: corrupted bytes"):
        trace = read_trace(trace_file)
    assert trace.records == RECORDS[:2]


def test_an_unknown_format_version_is_reported_not_misread(trace_file):
    data = trace_file.read_bytes()
    trace_file.write_bytes(MAGIC + struct.pack("<H", 7) + data[len(HEADER) :])
    with pytest.warns(TraceWarning, match=f"byte {len(MAGIC)}: unknown format version 7"):
        trace = read_trace(trace_file)
    assert trace.records == []
    with pytest.raises(TraceFormatError, match="cannot append"):
        TraceWriter(trace_file)


def test_a_version_1_trace_is_refused_naming_its_format_version(trace_file):
    data = trace_file.read_bytes()
    trace_file.write_bytes(MAGIC + struct.pack("<H", 1) + data[len(HEADER) :])
    with pytest.warns(TraceWarning, match=f"byte {len(MAGIC)}: format version 1 is no longer read .*version 2"):
        assert read_trace(trace_file).records == []
    with pytest.raises(TraceFormatError, match="format version 1"):
        TraceWriter(trace_file)


def test_a_file_that_is_not_a_trace_is_reported_and_never_appended_to(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a trace\n")
    with pytest.warns(TraceWarning, match="not an eyas trace"):
        assert read_trace(path).records == []
    with pytest.raises(TraceFormatError, match="not an eyas trace"):
        TraceWriter(path)
    assert path.read_text() == "hello, this is not a trace\n"


def test_reopening_drops_an_incomplete_last_record_so_new_records_stay_readable(trace_file):
    data = trace_file.read_bytes()
    trace_file.write_bytes(data[:-5])  # a crash in the middle of the last record
    with pytest.warns(TraceWarning, match="dropping"):
        writer = TraceWriter(trace_file)
    with writer:
        writer.write(encode(start("r2")))
    trace = read_trace(trace_file)
    assert trace.records == [*RECORDS[:-1], start("r2")] and trace.problems == []


def test_valid_frames_with_bad_records_are_skipped_and_reading_goes_on(tmp_path):
    path = tmp_path / "t.trace"
    bad = [
        frame(b"\xc1"),  # not msgpack
        frame(msgpack.packb([1, 2])),  # not a map
        frame(msgpack.packb({"kind": "round", "request": "r1"})),  # fields missing
        frame(msgpack.packb({**msgpack.unpackb(encode(round_(0))[FRAME.size :]), "emitted": [0.5]})),  # wrong type
        frame(msgpack.packb({"kind": "future-kind", "x": 1})),  # a kind from a later writer
    ]
    with TraceWriter(path) as writer:
        writer.write(encode(RECORDS[0]) + b"".join(bad) + encode(RECORDS[1]))
    trace = read_quietly(path)
    assert trace.records == RECORDS[:2]
    messages = [p.message for p in trace.problems]
    assert len(messages) == 5 and "not msgpack" in messages[0] and "not a map" in messages[1]
    assert "no 'round'" in messages[2] and "'emitted' is not list[int]" in messages[3] and "unknown kind" in messages[4]


damage = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
        st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
        st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 64)),
    ),
    min_size=1,
    max_size=4,
)


@FUZZ
@given(damage)
def test_fuzz_any_damage_yields_only_original_records_and_never_raises(trace_file, edits):
    data = bytearray(trace_file.read_bytes())
    for op, at, arg in edits:
        at = at % (len(data) + 1)
        if op == "flip" and at < len(data):
            data[at] ^= arg
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = arg
        elif op == "delete":
            del data[at : at + arg]
    trace_file.write_bytes(bytes(data))
    trace = read_quietly(trace_file)
    originals = iter(RECORDS)
    assert all(any(r == o for o in originals) for r in trace.records), "every record read is an original, in order"
    assert all(0 <= p.offset <= len(data) for p in trace.problems)


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_random_bytes_after_a_header_never_raise(tmp_path, tail):
    path = tmp_path / "random.trace"
    path.write_bytes(HEADER + tail)
    trace = read_quietly(path)
    assert all(0 <= p.offset <= len(HEADER) + len(tail) for p in trace.problems)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(["kind", "request", "round", "version", "tree", "decision", "sampling", "emitted", "prompt_ids", "x"])


@FUZZ
@given(st.dictionaries(field_names, values, max_size=10), st.sampled_from(["request", "round", "end", "other"]))
def test_fuzz_the_record_decoder_accepts_or_names_the_problem(fields, kind):
    payload = msgpack.packb({**fields, "kind": kind} if "kind" not in fields else fields, use_bin_type=True)
    try:
        record = decode(payload, 0)
    except TraceFormatError as exc:
        assert str(exc)
    else:
        assert record is None or type(record) in (RequestStart, Round, RequestEnd)
