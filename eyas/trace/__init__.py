"""Tree traces: per-round records of the messages exactly as sent, written append-only and read robustly."""

from .format import FORMAT_VERSION, RequestEnd, RequestStart, Round, TraceFormatError
from .record import RequestRecorder
from .store import Trace, TracedRequest, TraceProblem, TraceWarning, TraceWriter, read_trace

__all__ = [
    "FORMAT_VERSION",
    "RequestEnd",
    "RequestRecorder",
    "RequestStart",
    "Round",
    "Trace",
    "TraceFormatError",
    "TraceProblem",
    "TraceWarning",
    "TraceWriter",
    "TracedRequest",
    "read_trace",
]
