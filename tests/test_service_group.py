"""A target group (tensor_parallel: 2, gloo on CPU, one real Ray placement group) behind one gRPC endpoint.

Greedy output through the service equals Hugging Face greedy decoding; status shows each rank with its
device, its half of the weights and its half of the KV; a group of 2 ranks and one draft worker serve 4
concurrent requests while one rank is killed, and every request completes with the same greedy output
(the group is replaced whole); scaling adds and removes whole groups; a group whose ranks cannot be
placed fails within its timeout, naming the pool and the bundle.
"""

import os
import signal
import time

import pytest
import ray
from tests.helpers.servicekit import build_models, hf_greedy, service_config, stream_while, wait_until

from eyas.actors.config import PoolConfig
from eyas.actors.routing import PoolError
from eyas.actors.target_worker import TargetWorker
from eyas.client.cli import format_status
from eyas.client.client import Client
from eyas.cluster.pools import Pool
from eyas.cluster.service import Service

pytestmark = pytest.mark.slow  # a placement group of gloo ranks per service: about 40 s in all

PROMPTS = [[5, 17, 33, 8, 9], [7, 7, 7], [11, 22, 33, 44, 55, 66, 77], [60, 1, 60, 1]]
LENGTH = 96  # long enough that every request is still running when a rank dies
POOLS = {"draft": {"replicas": 1}, "target": {"replicas": 1, "tensor_parallel": 2}}


@pytest.fixture(scope="module")
def svc(ray_session, tmp_path_factory):
    target, drafter = build_models(tmp_path_factory.mktemp("group"))
    config = service_config(target, drafter, pools=POOLS)
    service = Service(config, port=0).start()
    client = Client(service.address)
    expected = hf_greedy(target, PROMPTS, [LENGTH] * len(PROMPTS))
    yield {"client": client, "expected": expected, "config": config}
    client.close()
    service.stop()


def target_pool(client):
    return next(p for p in client.status()["pools"] if p["name"] == "target")


def test_greedy_output_through_a_group_equals_hugging_face(svc):
    client = svc["client"]
    outputs = [list(client.generate(p, max_new_tokens=LENGTH).token_ids) for p in PROMPTS]
    assert outputs == svc["expected"]


def test_status_shows_each_rank_with_half_the_weights_and_kv(svc):
    pool = target_pool(svc["client"])
    assert pool["tensor_parallel"] == 2
    (worker,) = pool["workers"]
    ranks = worker["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["device"] for r in ranks} == {"cpu"}
    assert ranks[0]["pid"] == worker["pid"] and ranks[1]["pid"] != worker["pid"]
    assert ranks[0]["weight_bytes"] == ranks[1]["weight_bytes"] and ranks[0]["kv_pool_bytes"] == ranks[1]["kv_pool_bytes"]
    # tiny target: 4 layers x 2 kv heads x 16 head_dim, 16 slots of 512 + 256 positions, float32; each rank one kv head
    assert ranks[0]["kv_pool_bytes"] == 4 * 2 * 16 * 1 * (512 + 256) * 16 * 4
    shown = format_status(svc["client"].status())
    assert "target pool: size 1 groups of 2 ranks" in shown and "rank 1  cpu" in shown


def test_killing_a_rank_mid_request_loses_nothing(svc):
    client = svc["client"]
    (victim,) = target_pool(client)["workers"]
    outputs, finals, _ = stream_while(client, PROMPTS, LENGTH, lambda: os.kill(victim["ranks"][1]["pid"], signal.SIGKILL), 240)
    assert outputs == svc["expected"]  # nothing lost, nothing repeated, greedy unchanged
    assert all(f.finish_reason == "length" and f.stats["rebuilds"] >= 1 for f in finals)
    replacement = wait_until(
        lambda: [w for w in target_pool(client)["workers"] if w["state"] == "ready" and w["worker_id"] != victim["worker_id"]],
        120,
        "a replacement group",
    )
    assert len(replacement[0]["ranks"]) == 2
    status = client.status()
    assert (status["failed"], status["active"]) == (0, 0)


def test_scaling_adds_and_removes_whole_groups(svc):
    client = svc["client"]
    grown = client.scale(target=2)
    workers = next(p for p in grown["pools"] if p["name"] == "target")["workers"]
    assert len(workers) == 2 and all(len(w["ranks"]) == 2 for w in workers)
    assert [list(client.generate(p, max_new_tokens=LENGTH).token_ids) for p in PROMPTS] == svc["expected"]
    shrunk = client.scale(target=1)
    (worker,) = next(p for p in shrunk["pools"] if p["name"] == "target")["workers"]
    assert len(worker["ranks"]) == 2


@ray.remote(num_cpus=2)
class Holder:
    """Holds CPUs outside any placement group: the cluster has room for a group in total, not free now."""

    def ready(self) -> bool:
        return True


def test_a_group_that_cannot_be_placed_fails_within_its_timeout(svc):
    service = svc["config"]
    reserved = service.draft_pool.replicas * service.draft_pool.num_cpus
    reserved += service.target_pool.replicas * service.target_pool.tensor_parallel * service.target_pool.num_cpus
    holder = Holder.options(num_cpus=ray.cluster_resources()["CPU"] - reserved - 1).remote()
    ray.get(holder.ready.remote())  # every CPU the service's workers left is held but one
    config = PoolConfig(tensor_parallel=2)
    pool = Pool("target", TargetWorker, config, svc["config"].worker_spec(config), ready_timeout=3, rpc_timeout=5)
    t0 = time.monotonic()
    with pytest.raises(PoolError, match=r"^pools\.target: no placement for target-0's 2 bundle\(s\) of 1 CPU \(STRICT_PACK\) within 3s"):
        pool.start()
    assert time.monotonic() - t0 < 3 + 10
    ray.kill(holder)
