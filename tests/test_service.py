"""The disaggregated service end to end: exact output under concurrency, streaming, bad input, jobs, scaling, memory.

One real Ray instance, a service with two draft and two target workers on tiny models, and the
Python client over gRPC. Greedy output must equal the in-process engine and Hugging Face greedy
decoding token for token; sampled output with a fixed seed must equal the in-process engine's plain
(non-speculative) sampling with that seed.
"""

import json
import random
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from tests.helpers.servicekit import TREE, build_models, engine_outputs, hf_greedy, service_config, wait_until

from prometheus_client.parser import text_string_to_metric_families

from eyas import Engine
from eyas.client.cli import format_status
from eyas.client.client import Client, EyasError
from eyas.client.jobs import run_job
from eyas.cluster.service import Service

rng = random.Random(4)
PROMPTS = [[rng.randrange(3, 96) for _ in range(n)] for n in [1, 2, 3, 5, 7, 8, 11, 13, 16, 19, 23, 29, 31, 37, 41, 3, 6, 9, 12, 15, 18, 21, 24, 27]]
LENGTHS = [8 + (7 * i) % 33 for i in range(len(PROMPTS))]
KV_SLOTS = 8


@pytest.fixture(scope="module")
def svc(ray_session, tmp_path_factory):
    target, drafter = build_models(tmp_path_factory.mktemp("service"))
    # every test here runs with the workers' continuous batching and with drafting ahead on, and with
    # KV_SLOTS per worker: 2 x KV_SLOTS < len(PROMPTS), so the concurrent tests also queue for KV slots
    sections = {"service": {"ready_timeout_s": 120, "rpc_timeout_s": 60, "metrics_port": 0, "draft_ahead": 2, "kv_slots": KV_SLOTS}}
    service = Service(service_config(target, drafter, draft=2, targets=2, **sections), port=0).start()
    client = Client(service.address)
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    yield {"service": service, "client": client, "engine": engine, "target": target}
    client.close()
    service.stop()


def run_concurrently(client, requests):
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda kw: client.generate(**kw), requests))


def test_front_door_listens_on_loopback(svc):
    assert svc["service"].address.startswith("127.0.0.1:")
    assert svc["client"].health()["status"] == "SERVING"


def test_a_round_costs_one_call_on_each_worker(svc):
    """The publish rides on the next Round call (to the draft worker, which passes the commit on with the next
    Verify): besides its Start / Prefill and its Release, a request costs each pool one call per round (no Commit or
    Reseed call of its own), and the target one more for each offer of trees drafted ahead that it refused."""
    client = svc["client"]

    def calls() -> dict[str, int]:
        pools = client.status()["pools"]
        counts = {pool["name"]: sum(w["calls"] for w in pool["workers"]) for pool in pools}
        target = next(pool for pool in pools if pool["name"] == "target")["workers"]
        return {**counts, "refused": sum(w["options_offered"] - w["options_taken"] for w in target)}

    before = calls()
    result = client.generate(PROMPTS[9], max_new_tokens=40)
    after = calls()
    rounds = result.stats["rounds"]
    assert rounds > 1 and result.stats["rebuilds"] == 0
    refused = after["refused"] - before["refused"]
    assert {name: after[name] - before[name] for name in after} == {"draft": rounds + 2, "target": rounds + 2 + refused, "refused": refused}


def test_concurrent_greedy_output_equals_engine_and_hugging_face(svc):
    # 24 requests against 2 x 8 target slots: the ones that find every slot taken wait, none is refused
    results = run_concurrently(svc["client"], [{"prompt": p, "max_new_tokens": n} for p, n in zip(PROMPTS, LENGTHS)])
    expected = engine_outputs(svc["engine"], PROMPTS, LENGTHS)
    assert [r.token_ids for r in results] == expected
    assert [r.token_ids for r in results] == hf_greedy(svc["target"], PROMPTS, LENGTHS)
    status = svc["client"].status()
    workers = [w for pool in status["pools"] for w in pool["workers"]]
    assert len(workers) == 4 and all(w["calls"] > 0 for w in workers), "least-loaded routing uses every worker"
    metrics = status["metrics"]
    batches = metrics["eyas_batch_calls_count{pool=draft}"]
    assert metrics["eyas_batch_calls_sum{pool=draft}"] > batches  # Round Batch calls carried several requests' calls
    # ... and at most half of a worker's requests (at most KV_SLOTS = 8 each): the other half is in the other group
    assert metrics["eyas_batch_calls_bucket{le=4.0,pool=draft}"] == batches
    targets = next(pool["workers"] for pool in status["pools"] if pool["name"] == "target")
    assert all(w["forward_calls"] > w["forwards"] for w in targets)  # the draft workers' Verify batches verified together


def test_draft_ahead_hits_in_each_requests_stats_add_up_to_the_metric(svc):
    """Drafting ahead is on here: each request's stats split its rounds into those that verified a pre-built tree
    and the rest as the service's round counter does, and its hits never exceed its rounds and tokens."""
    def rounds(tree: str) -> float:
        return svc["client"].status()["metrics"].get(f"eyas_rounds_total{{tree={tree}}}", 0.0)

    before = rounds("hit"), rounds("fresh")
    results = run_concurrently(svc["client"], [{"prompt": p, "max_new_tokens": 24} for p in PROMPTS[:8]])
    hits, fresh = rounds("hit") - before[0], rounds("fresh") - before[1]
    assert sum(r.stats["ahead_rounds"] for r in results) == hits
    assert sum(r.stats["rounds"] for r in results) == hits + fresh > 0
    for r in results:
        assert 0 <= r.stats["ahead_rounds"] <= r.stats["rounds"] and 0 <= r.stats["ahead_tokens"] <= r.stats["tokens"]
        assert r.stats["ahead_tokens"] >= r.stats["ahead_rounds"]  # a verified round commits at least its bonus token


def test_prometheus_metrics_agree_with_the_status_and_the_rounds_served(svc):
    status = svc["client"].status()
    host_port = status["metrics_address"]
    assert host_port.startswith("127.0.0.1:")
    text = urllib.request.urlopen(f"http://{host_port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in (s for s in family.samples if not s.name.endswith("_created")):
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    total = lambda prefix: sum(v for k, v in samples.items() if k.startswith(prefix + "{"))  # noqa: E731
    assert status["rounds"] > 0 and samples["eyas_accepted_length_count"] == status["rounds"]
    assert total("eyas_tokens_total") == status["tokens"]
    assert total("eyas_request_latency_seconds_count") == status["completed"] and samples["eyas_active_requests"] == 0
    # every accepted draft node has an accepted parent, so the calibration counts add up to the accepted lengths
    assert total("eyas_draft_confidence_accepted_total") == samples["eyas_accepted_length_sum"]
    for key, nodes in samples.items():
        if key.startswith("eyas_draft_confidence_nodes_total{"):
            assert samples.get(key.replace("_nodes_", "_accepted_"), 0.0) <= nodes
    assert samples["eyas_tree_nodes_total{stage=verified}"] - samples["eyas_tree_nodes_total{stage=retained}"] == status["rounds"]
    assert status["metrics"] == samples
    shown = format_status(status)
    assert "acceptance by draft confidence (bucket upper edge): " in shown and f"metrics: http://{host_port}/metrics" in shown


def test_sampled_output_with_a_fixed_seed_equals_plain_sampling(svc):
    options = [
        {"temperature": 0.7, "seed": 1},
        {"temperature": 1.0, "seed": 2, "top_p": 0.9},
        {"temperature": 1.3, "seed": 3, "top_k": 20},
        {"temperature": 0.9, "seed": 4, "top_p": 0.8, "top_k": 10},
        {"temperature": 1.0, "seed": 5},
        {"temperature": 1.0, "seed": 6},
    ]
    prompts, lengths = PROMPTS[:6], [24] * 6
    results = run_concurrently(svc["client"], [{"prompt": p, "max_new_tokens": n, **o} for p, n, o in zip(prompts, lengths, options)])
    for result, prompt, n, o in zip(results, prompts, lengths, options):
        assert result.token_ids == svc["engine"].generate(prompt, max_new_tokens=n, speculate=False, **o).token_ids


def test_stream_yields_each_round_as_it_commits(svc):
    chunks = list(svc["client"].stream(PROMPTS[5], max_new_tokens=30))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == svc["engine"].generate(PROMPTS[5], max_new_tokens=30).token_ids
    rounds = [c for c in chunks if c.token_ids]
    assert [c.version for c in rounds] == list(range(1, len(rounds) + 1))
    last = chunks[-1]
    assert last.finish_reason == "length" and last.stats["rounds"] == len(rounds) and last.stats["tokens"] == 30
    assert "".join(c.text for c in chunks) == svc["engine"].target.tokenizer.decode(tokens)
    assert set(last.stats["service_seconds"]) == {"compute", "rpc", "serialize", "queue", "batch", "coordinator", "rebuild"}


def test_text_prompts_and_stop_strings_behave_as_in_process(svc):
    text = "w5 w17 w33 w8"
    reference = svc["engine"].generate(text, max_new_tokens=20)
    stop = reference.text.split()[3]
    expected = svc["engine"].generate(text, max_new_tokens=20, stop=[stop])
    result = svc["client"].generate(text, max_new_tokens=20, stop=[stop])
    assert (result.token_ids, result.text, result.finish_reason) == (expected.token_ids, expected.text, "stop")


@pytest.mark.parametrize(
    "options, code, field",
    [
        ({"prompt": []}, "INVALID_ARGUMENT", "prompt"),
        ({"prompt": ""}, "INVALID_ARGUMENT", "prompt"),
        ({"prompt": [1, 500]}, "INVALID_ARGUMENT", "prompt"),
        ({"max_new_tokens": 0}, "INVALID_ARGUMENT", "max_new_tokens"),
        ({"max_new_tokens": 600}, "INVALID_ARGUMENT", "max_new_tokens"),
        ({"prompt": "w5 " * 600}, "INVALID_ARGUMENT", "prompt"),  # under the text's byte bound, over the positions
        ({"temperature": -1.0}, "INVALID_ARGUMENT", "sampling.temperature"),
        ({"top_p": 0.0}, "INVALID_ARGUMENT", "sampling.top_p"),
        ({"top_k": -3}, "INVALID_ARGUMENT", "sampling.top_k"),
        ({"seed": -1}, "INVALID_ARGUMENT", "sampling.seed"),
        ({"tree": {"width": 4, "depth": 4, "budget": 99}}, "INVALID_ARGUMENT", "tree.budget"),
        ({"tree": {"width": 0, "depth": 4, "budget": 8}}, "INVALID_ARGUMENT", "tree.width"),
        ({"tree": {"width": 4, "depth": 4, "budget": 8, "stop": -0.5}}, "INVALID_ARGUMENT", "tree.stop"),
        ({"stop": ["w5", "w" * 300]}, "INVALID_ARGUMENT", "stop[1]"),
        ({"manifest_id": "0123456789abcdef"}, "FAILED_PRECONDITION", "manifest_id"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(svc, options, code, field):
    options = {"prompt": PROMPTS[3], "max_new_tokens": 8, **options}
    with pytest.raises(EyasError) as err:
        svc["client"].generate(**options)
    assert (err.value.code, err.value.field) == (code, field)
    assert svc["client"].generate(PROMPTS[3], max_new_tokens=8).token_ids == svc["engine"].generate(PROMPTS[3], max_new_tokens=8).token_ids


def test_request_ids_are_unique_and_cancel_names_running_requests(svc):
    client = svc["client"]
    stream = client.stream(PROMPTS[10], max_new_tokens=200, request_id="dup")
    first = next(stream)
    assert first.request_id == "dup"
    with pytest.raises(EyasError) as err:
        client.generate(PROMPTS[3], max_new_tokens=4, request_id="dup")
    assert (err.value.code, err.value.field) == ("ALREADY_EXISTS", "request_id")
    client.cancel("dup")
    assert list(stream)[-1].finish_reason == "cancelled"
    with pytest.raises(EyasError) as err:
        client.cancel("dup")
    assert (err.value.code, err.value.field) == ("NOT_FOUND", "request_id")


def test_batch_job_reports_bad_lines_keeps_going_and_resumes(svc, tmp_path):
    good = [{"id": f"g{i}", "prompt": p, "max_new_tokens": n} for i, (p, n) in enumerate(zip(PROMPTS[:5], LENGTHS[:5]))]
    lines = [json.dumps(g).encode() for g in good[:3]]
    lines += [
        json.dumps({"id": "empty", "prompt": ""}).encode(),
        json.dumps({"id": "zero", "prompt": [5, 6], "max_new_tokens": 0}).encode(),
        json.dumps({"id": "typo", "prompt": [5, 6], "temprature": 0.5}).encode(),
        b'{"id": "bytes", "prompt": "w5 \xff\xfe"}',
        b"this is not json",
        json.dumps({"id": "g0", "prompt": [5]}).encode(),
    ]
    lines += [json.dumps(g).encode() for g in good[3:]]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")

    report = run_job(svc["client"], source, out, progress=False)
    errors = {e["line"]: e for e in report.errors}
    assert report.written == 5 and sorted(errors) == [4, 5, 6, 7, 8, 9]
    assert (errors[4]["code"], errors[4]["field"]) == ("INVALID_ARGUMENT", "prompt")
    assert (errors[5]["code"], errors[5]["field"]) == ("INVALID_ARGUMENT", "max_new_tokens")
    assert "temprature: unknown option" in errors[6]["message"]
    assert "invalid UTF-8" in errors[7]["message"]
    assert "not JSON" in errors[8]["message"]
    assert "duplicate" in errors[9]["message"]
    written = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    expected = engine_outputs(svc["engine"], [g["prompt"] for g in good], [g["max_new_tokens"] for g in good])
    assert [written[g["id"]]["token_ids"] for g in good] == expected

    with out.open("a") as f:
        f.write('{"id": "torn", "tok')  # an interrupted run leaves a torn last line
    source.write_bytes(source.read_bytes() + json.dumps({"id": "late", "prompt": PROMPTS[6], "max_new_tokens": 5}).encode() + b"\n")
    again = run_job(svc["client"], source, out, progress=False)
    assert (again.written, again.skipped, len(again.errors)) == (1, 6, 5)  # line 9 repeats g0, which is done
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == sorted([*written, "late"])


def test_memory_returns_to_baseline_after_200_requests(svc):
    client = svc["client"]
    requests = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": 2 + i % 5} for i in range(220)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kw: client.generate(**kw), requests[:20]))  # warm-up: allocator pools settle
        baseline = {w["worker_id"]: w["rss_bytes"] for p in client.status()["pools"] for w in p["workers"]}
        list(pool.map(lambda kw: client.generate(**kw), requests[20:]))
    status = client.status()
    assert (status["active"], status["queued"]) == (0, 0)
    for pool in status["pools"]:
        for w in pool["workers"]:
            assert (w["sessions"], w["kv_bytes"], w["assigned"]) == (0, 0, 0), w
            assert w["rss_bytes"] - baseline[w["worker_id"]] < 32 * 2**20, f"{w['worker_id']} grew by {(w['rss_bytes'] - baseline[w['worker_id']]) / 2**20:.1f} MiB"


def test_scaling_both_pools_while_requests_run_fails_nothing(svc):
    client = svc["client"]
    prompts, lengths = PROMPTS[8:16], [80] * 8  # still running when the pools shrink
    started = [threading.Event() for _ in prompts]
    results = [None] * len(prompts)

    def run(i):
        tokens = []
        for chunk in client.stream(prompts[i], max_new_tokens=lengths[i]):
            tokens += chunk.token_ids
            started[i].set()
        results[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    wait_until(lambda: all(e.is_set() for e in started), 60, "every request's first round")
    status = client.scale(draft=1, target=1)  # retires a loaded worker in each pool: its requests move
    assert [(p["name"], p["size"], len(p["workers"])) for p in status["pools"]] == [("draft", 1, 1), ("target", 1, 1)]
    status = client.scale(draft=2, target=3)
    assert [(p["name"], p["size"], len(p["workers"])) for p in status["pools"]] == [("draft", 2, 2), ("target", 3, 3)]
    for t in threads:
        t.join(120)
    assert results == engine_outputs(svc["engine"], prompts, lengths)
    status = client.status()
    assert status["failed"] == 0 and status["rebuilds"] > 0
