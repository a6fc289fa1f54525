"""What a trace says in numbers: rounds, tokens, acceptance length, accepted length by depth, calibration.

Calibration compares the drafter's confidence in a node with how often the target accepted it,
over the nodes verification actually tried: the children of the rows on the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import WireError
from ..treerows import TreeError, check_decision, check_tree
from .invariants import UNBOUNDED_VOCAB
from .messages import decode_round
from .store import TracedRequest

BUCKETS = 10


@dataclass
class Bucket:
    """Tried nodes whose draft confidence lies in [low, high): how many, how many were accepted."""

    low: float
    high: float
    nodes: int = 0
    accepted: int = 0
    confidence: float = 0.0  # sum over the nodes

    @property
    def acceptance(self) -> float:
        return self.accepted / self.nodes if self.nodes else 0.0

    @property
    def mean_confidence(self) -> float:
        return self.confidence / self.nodes if self.nodes else 0.0


@dataclass
class Summary:
    """accepted_lengths[k]: rounds that accepted exactly k draft tokens; offered[d] / accepted_at[d]: rounds whose
    tree reached depth d / accepted a token at depth d (index 0 is the root, always both)."""

    requests: int = 0
    rounds: int = 0
    tokens: int = 0
    tree_rows: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    offered: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    calibration: list[Bucket] = field(default_factory=lambda: [Bucket(i / BUCKETS, (i + 1) / BUCKETS) for i in range(BUCKETS)])
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verification forward."""
        return self.tokens / self.rounds if self.rounds else 0.0

    def depth_acceptance(self) -> list[tuple[int, int, int]]:
        """(depth, rounds offering that depth, rounds accepting a token there), for depth 1 and deeper."""
        return [(d, self.offered[d], self.accepted_at[d]) for d in range(1, len(self.offered))]


def _grow(counts: list[int], index: int) -> None:
    counts.extend([0] * (index + 1 - len(counts)))


def summarize(requests: list[TracedRequest]) -> Summary:
    """Fold every well-formed round of `requests` into one summary (the invariant checks report the others)."""
    s = Summary(requests=len(requests))
    for request in requests:
        for rnd in request.rounds:
            try:
                tree, decision, _, _ = decode_round(rnd)
                check_tree(tree, vocab_size=UNBOUNDED_VOCAB)
                check_decision(decision, tree, UNBOUNDED_VOCAB)
            except (TreeError, WireError):
                continue
            s.rounds += 1
            s.tokens += len(rnd.emitted)
            s.tree_rows += tree.num_rows
            for phase, seconds in {**rnd.seconds, **rnd.service_seconds}.items():
                if isinstance(seconds, (int, float)):
                    s.seconds[phase] = s.seconds.get(phase, 0.0) + seconds
            k = decision.num_accepted
            _grow(s.accepted_lengths, k)
            s.accepted_lengths[k] += 1
            depth = max(tree.depths, default=0)
            _grow(s.offered, depth)
            _grow(s.accepted_at, max(depth, k))
            for d in range(depth + 1):
                s.offered[d] += 1
            for d in range(k + 1):
                s.accepted_at[d] += 1
            on_path = set(decision.accepted_rows)
            parents, probs = tree.parents, tree.draft_probs
            for row in range(1, tree.num_rows):
                if parents[row] in on_path:
                    bucket = s.calibration[min(int(probs[row] * BUCKETS), BUCKETS - 1)]
                    bucket.nodes += 1
                    bucket.accepted += row in on_path
                    bucket.confidence += probs[row]
    _grow(s.accepted_at, len(s.offered) - 1)
    return s
