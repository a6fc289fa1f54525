"""Killing a worker process mid-request loses nothing: every request completes with unchanged greedy output,
and a seeded sampled request rebuilt on a new worker keeps the text plain sampling with its seed gives.

The draft pool has two workers (requests move to the survivor); the target pool has one (requests
wait for its replacement). Either way the coordinator rebuilds the caches from the committed tokens.
"""

import os
import signal

import pytest
import ray
from tests.helpers.servicekit import TREE, build_models, engine_outputs, service_config, stream_while, wait_until

from eyas import Engine
from eyas.client.client import Client
from eyas.cluster.service import Service

PROMPTS = [[5, 17, 33, 8, 9], [7, 7, 7], [3], [11, 22, 33, 44, 55, 66, 77], [9, 8, 7, 6], [60, 1, 60, 1]]
LENGTH = 128  # long enough that every request is still running when the worker dies
SAMPLED = [{"temperature": 0.7, "seed": i} if i % 2 else {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": i} for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def svc(ray_session, tmp_path_factory):
    target, drafter = build_models(tmp_path_factory.mktemp("recovery"))
    # drafting ahead is on: a draft worker killed while it pre-builds trees loses no committed token
    sections = {"service": {"ready_timeout_s": 120, "rpc_timeout_s": 60, "draft_ahead": 2}}
    service = Service(service_config(target, drafter, draft=2, targets=1, **sections), port=0).start()
    client = Client(service.address)
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    expected = engine_outputs(engine, PROMPTS, [LENGTH] * len(PROMPTS))
    plain = [
        engine.generate(p, max_new_tokens=LENGTH, stop_at_eos=False, speculate=False, **o).token_ids
        for p, o in zip(PROMPTS, SAMPLED)
    ]
    yield client, expected, plain
    client.close()
    service.stop()


def pool(client, name):
    return next(p for p in client.status()["pools"] if p["name"] == name)


def kill_mid_request(client, pool_name, options=None):
    """Stream every prompt (with its sampling `options`); once each has committed a round, SIGKILL a busy worker of
    `pool_name`; collect outputs."""

    def kill():
        victim = max(pool(client, pool_name)["workers"], key=lambda w: w["assigned"])
        assert victim["assigned"] > 0
        os.kill(victim["pid"], signal.SIGKILL)
        return victim

    outputs, finals, victim = stream_while(client, PROMPTS, LENGTH, kill, options=options)
    return victim, outputs, finals


def test_killing_a_draft_worker_mid_request_loses_nothing(svc):
    client, expected, _ = svc
    victim, outputs, finals = kill_mid_request(client, "draft")
    assert outputs == expected  # nothing lost, nothing repeated, greedy unchanged
    assert all(f.finish_reason == "length" for f in finals)
    assert sum(f.stats["rebuilds"] for f in finals) >= victim["assigned"]
    workers = wait_until(lambda: [w for w in pool(client, "draft")["workers"] if w["state"] == "ready"] if len(pool(client, "draft")["workers"]) == 2 else None, 120, "the draft pool to be back at two workers")
    assert victim["worker_id"] not in {w["worker_id"] for w in workers}


def test_killing_the_only_target_worker_mid_request_loses_nothing(svc):
    client, expected, _ = svc
    victim, outputs, finals = kill_mid_request(client, "target")
    assert outputs == expected
    assert all(f.stats["rebuilds"] >= 1 for f in finals)
    (replacement,) = pool(client, "target")["workers"]
    assert replacement["worker_id"] != victim["worker_id"] and replacement["state"] == "ready"
    status = client.status()
    assert (status["failed"], status["active"]) == (0, 0)


def test_a_seeded_request_rebuilt_after_its_target_worker_died_keeps_its_sampled_text(svc):
    client, _, plain = svc
    victim, outputs, finals = kill_mid_request(client, "target", [{**o, "ignore_eos": True} for o in SAMPLED])
    assert outputs == plain  # the same text as plain sampling with each request's seed, despite the rebuild
    assert all(f.stats["rebuilds"] >= 1 and f.finish_reason == "length" for f in finals)
