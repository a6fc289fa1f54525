"""Service metrics: the per-concurrency throughput gauge follows the last minute, label by label."""

from __future__ import annotations

import pytest
from tests.helpers.tiny import make_drafter, make_target

from eyas import Engine
from eyas.actors.metrics import ServiceMetrics


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    target = make_target(root / "t")
    engine = Engine.from_pretrained(target, make_drafter(root / "d", target, "eagle1"), tree={"width": 3, "depth": 3, "budget": 8})
    records = []
    engine.generate([5, 6, 7], max_new_tokens=12, on_round=records.append)
    assert len(records) >= 2
    return records


def throughput(metrics: ServiceMetrics) -> dict[str, float]:
    prefix = "eyas_throughput_tokens_per_second{batch="
    return {k[len(prefix) : -1]: v for k, v in metrics.snapshot().items() if k.startswith(prefix)}


def test_a_label_that_dropped_out_of_the_window_reads_zero(rounds):
    now = [0.0]
    metrics = ServiceMetrics(clock=lambda: now[0])
    first, second = rounds[0], rounds[1]
    metrics.observe_round(first, {}, active=1)
    assert throughput(metrics) == {"1": len(first.emitted) / 60.0}
    now[0] = 90.0  # the round at concurrency 1 is older than a minute now
    metrics.observe_round(second, {}, active=2)
    assert throughput(metrics) == {"1": 0.0, "2": len(second.emitted) / 60.0}
    now[0] = 120.0
    metrics.observe_round(first, {}, active=2)
    assert throughput(metrics) == {"1": 0.0, "2": (len(first.emitted) + len(second.emitted)) / 30.0}
