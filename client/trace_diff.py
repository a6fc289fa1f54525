"""`eyas trace diff A B`: the first round where two traces differ, and how.

Requests are paired in file order (request ids may differ: a local run and a service run of the same
prompts compare equal); timings are ignored; tokens and rows must match exactly and
probabilities within `tolerance`.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.errors import WireError
from eyas.trace.compare import Difference, Label, decision_difference, tree_difference
from eyas.trace.messages import decode_round
from eyas.trace.store import Trace, TracedRequest


@dataclass(frozen=True)
class TraceDifference:
    """Where two traces first differ: the request pair (by position and key), the round, and what."""

    index: int
    keys: tuple[str, str]
    round: int | None
    difference: Difference

    def __str__(self) -> str:
        d = self.difference
        where = f"request {self.index + 1} (A: {self.keys[0]}, B: {self.keys[1]})"
        where += f", round {self.round}" if self.round is not None else ""
        node = f" at node {d.node}" if d.node is not None else ""
        return f"{where}: {d.what}{node}: A has {d.expected}; B has {d.actual}"


def _request_difference(a: TracedRequest, b: TracedRequest, tolerance: float, label: Label) -> tuple[int | None, Difference] | None:
    if (a.start is None) != (b.start is None):
        return None, Difference("request record", None, str(a.start is not None), str(b.start is not None))
    if a.start is not None:
        for name in ("prompt_ids", "sampling", "stop", "policy", "manifest_id"):
            x, y = getattr(a.start, name), getattr(b.start, name)
            if x != y:
                return None, Difference(f"request {name}", None, repr(x), repr(y))
    for ra, rb in zip(a.rounds, b.rounds):
        if ra.version != rb.version:
            return ra.round, Difference("version", None, str(ra.version), str(rb.version))
        try:
            tree_a, dec_a, _, _ = decode_round(ra)
            tree_b, dec_b, _, _ = decode_round(rb)
        except WireError as exc:
            return ra.round, Difference("messages", None, "decodable messages", str(exc))
        difference, _ = tree_difference(tree_a, tree_b, tolerance, label)
        if difference is None:
            difference, _ = decision_difference(tree_a, dec_a, dec_b, tolerance, label)
        if difference is None and ra.emitted != rb.emitted:
            difference = Difference("emitted tokens", None, str([label(t) for t in ra.emitted]), str([label(t) for t in rb.emitted]))
        if difference is not None:
            return ra.round, difference
    if len(a.rounds) != len(b.rounds):
        first = min(len(a.rounds), len(b.rounds))
        return first, Difference("number of rounds", None, str(len(a.rounds)), str(len(b.rounds)))
    ends = [(r.end.finish_reason, r.end.output_ids, r.end.error) if r.end is not None else None for r in (a, b)]
    if ends[0] != ends[1]:
        return None, Difference("end of request", None, repr(ends[0]), repr(ends[1]))
    return None


def diff_traces(a: Trace, b: Trace, tolerance: float = 0.0, label: Label = str) -> TraceDifference | None:
    """The first difference of two traces, or None when they record the same rounds."""
    ra, rb = a.requests, b.requests
    for index, (x, y) in enumerate(zip(ra, rb)):
        found = _request_difference(x, y, tolerance, label)
        if found is not None:
            return TraceDifference(index, (x.key, y.key), *found)
    if len(ra) != len(rb):
        index = min(len(ra), len(rb))
        keys = tuple(r[index].key if index < len(r) else "-" for r in (ra, rb))
        return TraceDifference(index, keys, None, Difference("number of requests", None, str(len(ra)), str(len(rb))))
    return None
