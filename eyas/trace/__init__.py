"""Tree traces: per-round records of the messages exactly as sent, written append-only and read robustly.

The package exports the file format and store only (no torch), so a client can write the trace
frames a service streams back; the recorder lives in `eyas.trace.record`.
"""

from .format import FORMAT_VERSION, RequestEnd, RequestStart, Round, TraceFormatError
from .store import Trace, TracedRequest, TraceProblem, TraceWarning, TraceWriter, read_trace

__all__ = [
    "FORMAT_VERSION",
    "RequestEnd",
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
