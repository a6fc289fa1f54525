"""Live service metrics in Prometheus form, owned by the coordinator and served on `service.metrics_port`.

One registry per service (so several services in one process do not collide). `observe_round`
folds in every published round; `snapshot` gives the same numbers as plain data for `eyas status`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

CONFIDENCE_BUCKETS = tuple(round(0.1 * i, 1) for i in range(1, 11))  # upper edges 0.1 .. 1.0
SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
BYTES = tuple(2**k for k in range(10, 31, 2))
BATCH_LABELS = ("1", "2", "3-4", "5-8", "9-16", "17+")


def batch_label(active: int) -> str:
    """Concurrency bucket of a request: how many requests were in flight with it."""
    for label, upper in zip(BATCH_LABELS, (1, 2, 4, 8, 16)):
        if active <= upper:
            return label
    return BATCH_LABELS[-1]


class ServiceMetrics:
    """The coordinator's counters, histograms and gauges."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # seconds; the throughput window reads it
        self.registry = CollectorRegistry()
        r = self.registry
        self.confidence_nodes = Counter(
            "eyas_draft_confidence_nodes", "Verified nodes whose parent was accepted, by draft confidence bucket", ["bucket"], registry=r
        )
        self.confidence_accepted = Counter(
            "eyas_draft_confidence_accepted", "Of those, the nodes the target accepted, by draft confidence bucket", ["bucket"], registry=r
        )
        self.tree_nodes = Counter("eyas_tree_nodes", "Tree nodes by stage: expanded, recorded, retained, verified", ["stage"], registry=r)
        self.accepted_length = Histogram(
            "eyas_accepted_length", "Draft tokens accepted per round", buckets=tuple(range(0, 17)), registry=r
        )
        self.phase_seconds = Histogram("eyas_phase_seconds", "Seconds per round by phase", ["phase"], buckets=SECONDS, registry=r)
        self.temporary_kv = Histogram(
            "eyas_temporary_kv_bytes", "Provisional KV bytes per round, draft and target side", ["side"], buckets=BYTES, registry=r
        )
        self.experts = Histogram(
            "eyas_moe_experts_per_verification", "(layer, expert) pairs routed by one verification", buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r
        )
        self.latency = Histogram(
            "eyas_request_latency_seconds", "End-to-end request latency by concurrency", ["batch"], buckets=SECONDS + (5.0, 10.0, 30.0, 60.0), registry=r
        )
        self.tokens = Counter("eyas_tokens", "Committed tokens by concurrency", ["batch"], registry=r)
        self.throughput = Gauge("eyas_throughput_tokens_per_second", "Committed tokens per second over the last minute by concurrency", ["batch"], registry=r)
        self.active = Gauge("eyas_active_requests", "Requests in flight", registry=r)
        self.rounds = Counter(
            "eyas_rounds", "Verified rounds, by whether the tree was drafted ahead (hit) or drafted after the reseed (fresh)", ["tree"], registry=r
        )
        self.batch_calls = Histogram(
            "eyas_batch_calls", "Requests' calls per Batch call sent to a worker, by pool", ["pool"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r
        )
        self.http_requests = Counter(
            "eyas_http_requests", "Requests to the OpenAI-compatible HTTP endpoint, by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self._recent: deque[tuple[float, int, str]] = deque()
        self._recent_tokens: dict[str, int] = {}  # label -> tokens of the rounds in `_recent` (every label seen: 0 when none)
        self._lock = threading.Lock()
        self._children: dict[tuple[int, str], object] = {}  # (metric, label) -> its labelled child
        self._server = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose the registry over HTTP on host:port (port 0 picks a free one); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def observe_round(self, record, service_seconds: dict[str, float], active: int) -> None:
        """Fold in one published round (an `eyas.rounds.RoundRecord`) and the service's own phase times."""
        tree, decision = record.tree, record.decision
        accepted = set(decision.accepted_rows)
        probs = tree.draft_probs.tolist()
        offered: dict[str, int] = {}
        taken: dict[str, int] = {}
        for row, parent in enumerate(tree.parents.tolist()):
            if row and parent in accepted:
                bucket = str(next(b for b in CONFIDENCE_BUCKETS if probs[row] <= b + 1e-12))
                offered[bucket] = offered.get(bucket, 0) + 1
                taken[bucket] = taken.get(bucket, 0) + (row in accepted)
        for bucket, count in offered.items():
            self._child(self.confidence_nodes, bucket).inc(count)
            self._child(self.confidence_accepted, bucket).inc(taken[bucket])
        for stage, count in (
            ("expanded", record.nodes_expanded),
            ("recorded", record.nodes_recorded),
            ("retained", tree.num_rows - 1),
            ("verified", tree.num_rows),
        ):
            self._child(self.tree_nodes, stage).inc(count)
        self.accepted_length.observe(decision.num_accepted)
        self._child(self.rounds, "hit" if record.pre_built else "fresh").inc()
        for phase, seconds in {**record.seconds, **service_seconds}.items():
            self._child(self.phase_seconds, phase).observe(seconds)
        self._child(self.temporary_kv, "draft").observe(record.draft_kv_bytes)
        self._child(self.temporary_kv, "target").observe(record.target_kv_bytes)
        if record.experts:
            self.experts.observe(len(record.experts))
        label = batch_label(active)
        self._child(self.tokens, label).inc(len(record.emitted))
        now = self._clock()
        with self._lock:
            self._recent.append((now, len(record.emitted), label))
            self._recent_tokens[label] = self._recent_tokens.get(label, 0) + len(record.emitted)
            while self._recent and self._recent[0][0] < now - 60:
                _, n, lab = self._recent.popleft()
                self._recent_tokens[lab] -= n  # a label with no round left in the window drops to 0
            window = max(1e-9, min(60.0, now - self._recent[0][0])) if len(self._recent) > 1 else 60.0
            for lab, n in self._recent_tokens.items():  # running sums: a round costs O(labels), not O(window)
                self._child(self.throughput, lab).set(n / window)

    def _child(self, metric, label: str):
        """`metric.labels(label)`, kept: a round touches a few dozen of them."""
        child = self._children.get((id(metric), label))
        if child is None:
            child = self._children[(id(metric), label)] = metric.labels(label)
        return child

    def observe_request(self, seconds: float, active: int) -> None:
        self.latency.labels(batch_label(active)).observe(seconds)

    def snapshot(self) -> dict[str, float]:
        """Every sample as {"name{label=value,...}": value}, for `eyas status` and the StatusReply."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out
