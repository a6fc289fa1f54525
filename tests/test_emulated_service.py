"""The service on timed models: its output equals the in-process engine's on the same emulated hardware, at 1 and 16
concurrent requests, drafting ahead on and off, greedy and seeded, and with trees drafted ahead offered to the target;
a worker killed under the load loses no committed token. (Exactness itself is tested on real models; here the
service's machinery runs on the timed models'.)"""

import argparse
import os
import random
import signal
import statistics

import pytest
from tests.helpers.servicekit import stream_while

from eyas import Engine
from eyas.actors.config import ServiceConfig
from eyas.client.bench.service import concurrency_curve
from eyas.client.client import Client
from eyas.cluster.service import Service

TREE = {"width": 4, "depth": 5, "budget": 16}
LENGTH = 48
PROMPTS = [[random.Random(i).randrange(1024) for _ in range(12 + i)] for i in range(16)]
SAMPLING = [{"temperature": 0.8, "seed": i} if i % 2 else {} for i in range(16)]


@pytest.fixture(scope="module", params=[0, 2], ids=["ahead-off", "ahead-2"])
def svc(ray_session, request):
    config = ServiceConfig.from_dict({
        "models": {"emulate": "null"},
        "tree": TREE,
        "pools": {"draft": {"replicas": 2}, "target": {"replicas": 1}},
        "service": {"ready_timeout_s": 120, "rpc_timeout_s": 60, "draft_ahead": request.param, "kv_slots": 16},
        "network": {"http_port": 0},
    })
    service = Service(config, port=0).start()
    client = Client(service.address)
    engine = Engine.emulated("null", tree=TREE, kv_slots=16, draft_ahead=request.param)
    expected = [engine.generate(p, max_new_tokens=LENGTH, stop_at_eos=False, **o).token_ids for p, o in zip(PROMPTS, SAMPLING)]
    yield {"client": client, "expected": expected}
    client.close()
    service.stop()


def test_one_request_at_a_time_equals_the_engine(svc):
    client = svc["client"]
    assert client.status()["emulation"] == "null"
    outputs = [client.generate(p, max_new_tokens=LENGTH, ignore_eos=True, **o).token_ids for p, o in zip(PROMPTS[:4], SAMPLING[:4])]
    assert outputs == svc["expected"][:4]


def test_sixteen_at_once_equal_the_engine(svc):
    outputs, finals, _ = stream_while(svc["client"], PROMPTS, LENGTH, lambda: None, options=[{**o, "ignore_eos": True} for o in SAMPLING])
    assert outputs == svc["expected"]
    assert all(f.finish_reason == "length" for f in finals)


def test_the_concurrency_curve_alternates_its_runs_and_reports_their_medians(svc):
    """`eyas bench service --concurrency`: each size runs `--repeats` times both ways, alternated; the point is the
    medians, and the service's outputs are generate_batch's."""
    engine = Engine.emulated("null", tree=TREE, kv_slots=16)
    args = argparse.Namespace(prompt_tokens=10, seed=5, max_new_tokens=12, repeats=3)
    [point] = concurrency_curve(engine, svc["client"], (4,), args)
    runs = point["runs"]
    assert point["identical_outputs"]
    assert len(runs["in_process_request_rounds_per_s"]) == len(runs["service_request_rounds_per_s"]) == 3
    assert point["in_process_request_rounds_per_s"] == statistics.median(runs["in_process_request_rounds_per_s"])
    assert point["service_request_rounds_per_s"] == statistics.median(runs["service_request_rounds_per_s"])
    assert point["service_over_in_process"] == point["service_request_rounds_per_s"] / point["in_process_request_rounds_per_s"]


def test_a_target_worker_killed_under_the_load_loses_no_committed_token(svc):
    client = svc["client"]

    def kill():
        target = next(p for p in client.status()["pools"] if p["name"] == "target")["workers"][0]
        os.kill(target["pid"], signal.SIGKILL)

    outputs, finals, _ = stream_while(client, PROMPTS, LENGTH, kill, options=[{**o, "ignore_eos": True} for o in SAMPLING])
    assert outputs == svc["expected"]
    assert sum(f.stats["rebuilds"] for f in finals) >= 1


def test_trees_offered_to_the_target_as_it_verifies_keep_the_engines_output(ray_session):
    """Where a verification outlasts the drafting ahead (`70b-tp4`), a lone request's trees drafted ahead are offered
    to the target while it verifies (`VerifyRequest.options`) and it goes on to the decided outcome's: the output,
    greedy and seeded, is still the in-process engine's."""
    config = ServiceConfig.from_dict({
        "models": {"emulate": "70b-tp4"},
        "tree": TREE,
        "service": {"ready_timeout_s": 120, "rpc_timeout_s": 60, "draft_ahead": 2, "kv_slots": 4},
        "network": {"http_port": 0},
    })
    engine = Engine.emulated("70b-tp4", tree=TREE, kv_slots=4, draft_ahead=2)
    expected = [engine.generate(p, max_new_tokens=LENGTH, stop_at_eos=False, **o).token_ids for p, o in zip(PROMPTS[:4], SAMPLING[:4])]
    with Service(config, port=0) as service, Client(service.address) as client:
        outputs = [client.generate(p, max_new_tokens=LENGTH, ignore_eos=True, **o).token_ids for p, o in zip(PROMPTS[:4], SAMPLING[:4])]
        target = next(p for p in client.status()["pools"] if p["name"] == "target")["workers"][0]
    assert outputs == expected
    assert target["options_taken"] > 0
