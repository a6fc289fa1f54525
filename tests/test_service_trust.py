"""Trust, failover and input bounds of a running service, over real Ray and real gRPC on loopback addresses.

The main service binds 127.0.0.2 (a second loopback address) with a front-door token, one draft
and two target workers. Outsiders, even holding the front-door token, cannot reach a worker; a
target worker killed under four concurrent requests fails none of them; every oversized input is
refused fast, naming its field, while another request runs unchanged. A second service binds ::1.
"""

import json
import os
import shutil
import signal
import threading
import time

import grpc
import pytest
import ray
from tests.helpers.servicekit import TREE, build_models, engine_outputs, service_config, wait_until, with_unknown_field

from eyas import Engine, wire
from eyas.client.cli import format_status
from eyas.client.client import Client, EyasError
from eyas.client.jobs import run_job
from eyas.cluster.service import Service
from eyas.manifest import weight_digest
from eyas.rpc import TOKEN_KEY, call_metadata, field_of
from eyas.stored_tree import StoredTree
from eyas.tree import TreePolicy
from eyas.v1 import round_pb2 as pb
from eyas.v1 import service_pb2 as spb

TOKEN = "front-door-token"
PROMPTS = [[5, 17, 33, 8, 9], [7, 7, 7], [11, 22, 33, 44, 55, 66, 77], [60, 1, 60, 1]]
LENGTH = 96


@pytest.fixture(scope="module")
def svc(ray_session, tmp_path_factory):
    target, drafter = build_models(tmp_path_factory.mktemp("trust"))
    network = {"host": "127.0.0.2", "token": TOKEN}
    service = Service(service_config(target, drafter, draft=1, targets=2, network=network), port=0).start()
    client = Client(service.address, token=TOKEN)
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    expected = engine_outputs(engine, PROMPTS, [LENGTH] * len(PROMPTS))
    yield {"service": service, "client": client, "engine": engine, "expected": expected, "models": (target, drafter)}
    client.close()
    service.stop()


def workers(client):
    return [dict(w, pool=p["name"]) for p in client.status()["pools"] for w in p["workers"]]


def stream_all(client, prompts, started, outputs, errors, request_id=""):
    """Threads streaming each prompt; `started[i]` is set after its first round."""

    def run(i):
        tokens = []
        try:
            for chunk in client.stream(prompts[i], max_new_tokens=LENGTH, request_id=request_id and f"{request_id}-{i}"):
                tokens += chunk.token_ids
                started[i].set()
            outputs[i] = tokens
        except EyasError as exc:
            errors[i] = exc
            started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads


def test_a_service_on_a_second_loopback_address_with_a_token_serves_correctly(svc):
    client = svc["client"]
    assert svc["service"].address.startswith("127.0.0.2:")
    assert all(w["address"].startswith("127.0.0.2:") and w["state"] == "ready" for w in workers(client))
    with Client(svc["service"].address) as anonymous, pytest.raises(EyasError) as err:
        anonymous.health()
    assert err.value.code == "UNAUTHENTICATED"
    assert [client.generate(p, max_new_tokens=LENGTH).token_ids for p in PROMPTS] == svc["expected"]


def test_outsiders_cannot_touch_a_workers_requests_and_a_live_request_is_unchanged(svc):
    client = svc["client"]
    started, outputs, errors = [threading.Event()], [None], [None]
    threads = stream_all(client, PROMPTS[:1], started, outputs, errors, request_id="victim")
    wait_until(started[0].is_set, 60, "the victim's first round")
    request_id = "victim-0"
    for worker in workers(client):
        channel = grpc.insecure_channel(worker["address"])
        service = "eyas.v1.TargetWorker" if worker["pool"] == "target" else "eyas.v1.DraftWorker"
        for metadata in ((), call_metadata(TOKEN), ((TOKEN_KEY, "guess"),)):
            calls = [("Health", pb.WorkerHealthRequest())]
            for version in range(0, 40, 4):  # a flood of Verifies at every plausible version, then Releases
                ref = wire.ref(request_id, version, client.health()["manifest_id"])
                round_call = ("Verify", pb.VerifyRequest(ref=ref, round_id="intruder")) if worker["pool"] == "target" else ("Round", pb.RoundRequest(draft=pb.DraftRequest(ref=ref)))
                calls += [round_call, ("Release", pb.Release(ref=ref))]
            for method, msg in calls:
                with pytest.raises(grpc.RpcError) as err:
                    channel.unary_unary(f"/{service}/{method}")(msg.SerializeToString(), timeout=10, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert request_id not in err.value.details()
        channel.close()
    threads[0].join(120)
    assert errors == [None] and outputs == svc["expected"][:1]


@pytest.mark.slow  # a worker killed and its requests moved: about 17 s
def test_killing_a_target_worker_under_four_requests_fails_none_when_another_serves(svc):
    client = svc["client"]
    for repeat in range(5):
        started, outputs, errors = [threading.Event() for _ in PROMPTS], [None] * 4, [None] * 4
        threads = stream_all(client, PROMPTS, started, outputs, errors)
        wait_until(lambda: all(e.is_set() for e in started), 60, "every request's first round")
        victim = max((w for w in workers(client) if w["pool"] == "target"), key=lambda w: w["assigned"])
        os.kill(victim["pid"], signal.SIGKILL)
        for t in threads:
            t.join(180)
        assert errors == [None] * 4, f"repeat {repeat}: {errors}"
        assert outputs == svc["expected"], f"repeat {repeat}"
        wait_until(
            lambda: len([w for w in workers(client) if w["pool"] == "target" and w["state"] == "ready"]) == 2,
            120,
            "the target pool back at two workers",
        )
    status = client.status()
    assert (status["failed"], status["active"]) == (0, 0)


def refused_fast(call, code: str, field: str) -> float:
    t0 = time.perf_counter()
    with pytest.raises(EyasError) as err:
        call()
    assert (err.value.code, err.value.field) == (code, field), err.value
    return time.perf_counter() - t0


def test_oversized_inputs_are_refused_fast_naming_the_field_while_a_request_runs(svc):
    client = svc["client"]
    started, outputs, errors = [threading.Event()], [None], [None]
    threads = stream_all(client, PROMPTS[2:3], started, outputs, errors)
    wait_until(started[0].is_set, 60, "the concurrent request's first round")
    positions = 512  # the tiny target's max_position_embeddings
    gen = lambda prompt, **kw: client.generate(prompt, max_new_tokens=4, **kw)  # noqa: E731
    seconds = [
        refused_fast(lambda: gen("w5 " * (16 * positions // 3 + 1)), "INVALID_ARGUMENT", "prompt"),
        refused_fast(lambda: gen([5] * (positions + 1)), "INVALID_ARGUMENT", "prompt"),
        refused_fast(lambda: gen([5, 6], stop=["w"] * 17), "INVALID_ARGUMENT", "stop"),
        refused_fast(lambda: gen([5, 6], stop=["w" * 257]), "INVALID_ARGUMENT", "stop[0]"),
        refused_fast(lambda: gen([5, 6], request_id="r" * 129), "INVALID_ARGUMENT", "request_id"),
        refused_fast(lambda: client.cancel("r" * 129), "INVALID_ARGUMENT", "ref.request_id"),
        refused_fast(lambda: client.scale(target=10_000), "INVALID_ARGUMENT", "target"),
    ]
    with pytest.raises(EyasError) as err:
        gen("w5 " * (1 << 19))  # 1.5 MB: over service.max_request_bytes, refused by the client before it is sent
    assert (err.value.code, err.value.field) == ("INVALID_ARGUMENT", "prompt")
    assert f"over the service's limit of {1 << 20} (service.max_request_bytes)" in err.value.details
    channel = grpc.insecure_channel(svc["service"].address)
    generate = channel.unary_stream("/eyas.v1.Eyas/Generate")
    oversized = spb.GenerateRequest(text="w5 " * (1 << 19)).SerializeToString()
    with pytest.raises(grpc.RpcError) as raw:  # sent anyway, gRPC's transport refuses it before eyas decodes it
        list(generate(oversized, timeout=10, metadata=call_metadata(TOKEN)))
    assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as raw:
        list(generate(b"\xff\xff\xff", timeout=10, metadata=call_metadata(TOKEN)))
    assert (raw.value.code(), field_of(raw.value.trailing_metadata())) == (grpc.StatusCode.INVALID_ARGUMENT, "message")
    channel.close()
    assert client.health()["status"] == "SERVING"
    threads[0].join(120)
    assert errors == [None] and outputs == svc["expected"][2:3]
    assert max(seconds) < 5.0, seconds  # generous: each refusal happens before any model work


def test_an_oversized_job_line_is_reported_and_the_job_goes_on(svc, tmp_path):
    lines = [{"id": "first", "prompt": PROMPTS[0], "max_new_tokens": 8}, {"id": "big", "prompt": "w5 " * (5 << 18)},
             {"id": "last", "prompt": PROMPTS[1], "max_new_tokens": 8}]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = run_job(svc["client"], source, out, progress=False)
    assert report.written == 2 and [(e["line"], e["id"], e["code"], e["field"]) for e in report.errors] == [(2, "big", "INVALID_ARGUMENT", "prompt")]
    assert "service.max_request_bytes" in report.errors[0]["message"]
    written = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert written == {"first": svc["expected"][0][:8], "last": svc["expected"][1][:8]}


def test_run_job_with_a_malformed_item_answers_it_and_ends(svc):
    item = spb.JobItem(id="ok", request=spb.GenerateRequest(token_ids=spb.TokenIds(ids=PROMPTS[0]), max_new_tokens=8))
    channel = grpc.insecure_channel(svc["service"].address)
    run_job = channel.stream_stream("/eyas.v1.Eyas/RunJob", response_deserializer=spb.JobResult.FromString)
    results = list(run_job(iter([item.SerializeToString(), b"\xff\xff\xff"]), timeout=60, metadata=call_metadata(TOKEN)))
    channel.close()
    by_id = {r.id: r for r in results}
    assert len(results) == 2 and by_id["ok"].token_ids == svc["expected"][0][:8]
    assert (by_id[""].error.code, by_id[""].error.field) == ("INVALID_ARGUMENT", "item")


def test_a_field_the_schema_does_not_define_is_refused_at_the_front_door_naming_it(svc):
    tree = pb.TreePolicy.FromString(with_unknown_field(pb.TreePolicy(width=2, depth=2, budget=4), 99))
    request = spb.GenerateRequest(token_ids=spb.TokenIds(ids=PROMPTS[0]), max_new_tokens=4, tree=tree)
    channel = grpc.insecure_channel(svc["service"].address)
    generate = channel.unary_stream("/eyas.v1.Eyas/Generate")
    with pytest.raises(grpc.RpcError) as raw:
        list(generate(request.SerializeToString(), timeout=30, metadata=call_metadata(TOKEN)))
    assert (raw.value.code(), field_of(raw.value.trailing_metadata())) == (grpc.StatusCode.INVALID_ARGUMENT, "tree.99")
    assert "field 99 is not defined in eyas.v1.TreePolicy" in raw.value.details()
    good = spb.JobItem(id="good", request=spb.GenerateRequest(token_ids=spb.TokenIds(ids=PROMPTS[0]), max_new_tokens=8))
    odd = spb.JobItem(id="odd", request=request)
    run_job = channel.stream_stream("/eyas.v1.Eyas/RunJob", response_deserializer=spb.JobResult.FromString)
    results = {r.id: r for r in run_job(iter([good.SerializeToString(), odd.SerializeToString()]), timeout=60, metadata=call_metadata(TOKEN))}
    channel.close()
    assert results["good"].token_ids == svc["expected"][0][:8]
    assert (results["odd"].error.code, results["odd"].error.field) == ("INVALID_ARGUMENT", "request.tree.99")


def test_cancelled_requests_are_counted_apart_from_completed(svc):
    client = svc["client"]
    before = client.status()
    stream = client.stream(PROMPTS[1], max_new_tokens=LENGTH, request_id="to-cancel")
    next(stream)
    client.cancel("to-cancel")
    assert [c.finish_reason for c in stream][-1] == "cancelled"
    after = wait_until(lambda: (s := client.status())["active"] == 0 and s, 30, "the cancelled request to end")
    assert (after["cancelled"], after["completed"]) == (before["cancelled"] + 1, before["completed"])


def test_a_service_with_tree_auto_chooses_its_trees_and_keeps_the_output(svc):
    """`tree: auto`: the coordinator prices trees with the forward costs each worker measures on its device, explores,
    then chooses per concurrency; every round's tokens stay the target's greedy ones, and a request may still ask
    for a fixed tree up to the widest one auto explores."""
    target, drafter = svc["models"]
    service = Service(service_config(target, drafter, tree="auto"), port=0).start()
    try:
        with Client(service.address) as client:
            status = client.status()
            assert status["tree_auto"] and not status["tree_chosen"] and status["tree_exploring"] == 18
            short = client.generate(PROMPTS[0], max_new_tokens=4)  # ends within the first exploration
            assert short.token_ids == svc["expected"][0][:4]
            status = client.status()
            assert 0 < status["tree_exploring"] < 18 and not status["tree_chosen"]
            line = f"tree: auto (exploring, {status['tree_exploring']} round(s) to go before it chooses; width/depth/budget chosen so far: none yet)"
            assert line in format_status(status).splitlines()
            outputs, errors = [None] * len(PROMPTS), []
            threads = [threading.Thread(target=lambda i=i: outputs.__setitem__(i, client.generate(PROMPTS[i], max_new_tokens=LENGTH)))
                       for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert [o.token_ids for o in outputs] == svc["expected"]
            status = client.status()
            chosen = status["tree_chosen"]
            assert chosen, "after its exploring rounds the tuner has chosen a tree"
            assert "tree: auto (width/depth/budget chosen so far: " in format_status(status)
            assert all(p["width"] <= 8 and p["depth"] <= 8 and p["budget"] <= 64 for p in chosen.values())
            fixed = client.generate(PROMPTS[0], max_new_tokens=LENGTH, tree={"width": 2, "depth": 8, "budget": 16})
            assert fixed.token_ids == svc["expected"][0]
            with pytest.raises(EyasError) as err:
                client.generate(PROMPTS[0], max_new_tokens=4, tree={"width": 9, "depth": 2, "budget": 4})
            assert err.value.field == "tree.width"
    finally:
        service.stop()


@pytest.mark.slow
def test_a_service_without_a_tree_serves_the_one_stored_beside_its_drafter(svc, tmp_path):
    """No `tree` configured: the coordinator serves the tree stored beside the drafter (docs/tree.md#the-default-tree);
    the output stays the target's, and a request may ask for a fixed tree up to the widest one tree auto explores."""
    target, drafter = svc["models"]
    drafter = shutil.copytree(drafter, tmp_path / "drafter")
    StoredTree(TreePolicy(1, 3, 3), weight_digest(drafter), svc["engine"].target.fingerprint.weight_digest).save(drafter)
    service = Service(service_config(target, drafter, tree=None), port=0).start()
    try:
        with Client(service.address) as client:
            status = client.status()
            assert not status.get("tree_auto") and "tree: 1/3/3 (width/depth/budget)" in format_status(status)
            assert client.generate(PROMPTS[0], max_new_tokens=LENGTH).token_ids == svc["expected"][0]
            wide = client.generate(PROMPTS[1], max_new_tokens=LENGTH, tree={"width": 8, "depth": 8, "budget": 64})
            assert wide.token_ids == svc["expected"][1]
    finally:
        service.stop()


def test_a_service_on_ipv6_loopback_serves_correctly(svc):
    target, drafter = svc["models"]
    service = Service(service_config(target, drafter, network={"host": "::1"}), port=0).start()
    try:
        assert service.address.startswith("[::1]:")
        with Client(service.address) as client:
            assert all(w["address"].startswith("[::1]:") for w in workers(client))
            assert client.generate(PROMPTS[0], max_new_tokens=LENGTH).token_ids == svc["expected"][0]
    finally:
        service.stop()
