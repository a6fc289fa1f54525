"""Killing a worker process mid-request loses nothing: every request completes with unchanged greedy output.

The draft pool has two workers (requests move to the survivor); the target pool has one (requests
wait for its replacement). Either way the coordinator rebuilds the caches from the committed tokens.
"""

import os
import signal
import threading

import pytest
import ray
from servicekit import TREE, build_models, engine_outputs, service_config, wait_until

from eyas import Engine
from eyas.client.client import Client
from eyas.cluster.service import Service

PROMPTS = [[5, 17, 33, 8, 9], [7, 7, 7], [3], [11, 22, 33, 44, 55, 66, 77], [9, 8, 7, 6], [60, 1, 60, 1]]
LENGTH = 128  # long enough that every request is still running when the worker dies


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    ray.init(num_cpus=5, include_dashboard=False)
    target, drafter = build_models(tmp_path_factory.mktemp("recovery"))
    service = Service(service_config(target, drafter, draft=2, targets=1), port=0).start()
    client = Client(service.address)
    expected = engine_outputs(Engine.from_pretrained(target, drafter, tree=TREE), PROMPTS, [LENGTH] * len(PROMPTS))
    yield client, expected
    client.close()
    service.stop()
    ray.shutdown()


def pool(client, name):
    return next(p for p in client.status()["pools"] if p["name"] == name)


def kill_mid_request(client, pool_name):
    """Stream every prompt; once each has committed a round, SIGKILL a busy worker of `pool_name`; collect outputs."""
    started = [threading.Event() for _ in PROMPTS]
    outputs, finals = [None] * len(PROMPTS), [None] * len(PROMPTS)

    def run(i):
        tokens = []
        for chunk in client.stream(PROMPTS[i], max_new_tokens=LENGTH):
            tokens += chunk.token_ids
            started[i].set()
        outputs[i], finals[i] = tokens, chunk

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    wait_until(lambda: all(e.is_set() for e in started), 60, "every request's first round")
    victim = max(pool(client, pool_name)["workers"], key=lambda w: w["assigned"])
    assert victim["assigned"] > 0
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(180)
    return victim, outputs, finals


def test_killing_a_draft_worker_mid_request_loses_nothing(svc):
    client, expected = svc
    victim, outputs, finals = kill_mid_request(client, "draft")
    assert outputs == expected  # nothing lost, nothing repeated, greedy unchanged
    assert all(f.finish_reason == "length" for f in finals)
    assert sum(f.stats["rebuilds"] for f in finals) >= victim["assigned"]
    workers = wait_until(lambda: [w for w in pool(client, "draft")["workers"] if w["state"] == "ready"] if len(pool(client, "draft")["workers"]) == 2 else None, 120, "the draft pool to be back at two workers")
    assert victim["worker_id"] not in {w["worker_id"] for w in workers}


def test_killing_the_only_target_worker_mid_request_loses_nothing(svc):
    client, expected = svc
    victim, outputs, finals = kill_mid_request(client, "target")
    assert outputs == expected
    assert all(f.stats["rebuilds"] >= 1 for f in finals)
    (replacement,) = pool(client, "target")["workers"]
    assert replacement["worker_id"] != victim["worker_id"] and replacement["state"] == "ready"
    status = client.status()
    assert (status["failed"], status["active"]) == (0, 0)
