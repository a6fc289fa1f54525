"""Pools placed by custom resources on different Ray nodes (ray.cluster_utils.Cluster: three nodes on one machine).

The draft pool asks for resource `draft`, the target pool for `target`; only one node offers each.
Drafting and verification run on different nodes and the output is still the target's greedy output.
"""

import pytest
import ray
from ray.cluster_utils import Cluster
from tests.helpers.servicekit import build_models, hf_greedy, service_config

from eyas.client.client import Client
from eyas.cluster.service import Service

pytestmark = pytest.mark.slow  # a Ray cluster of several nodes

PROMPTS = [[5, 17, 33, 8, 9], [7, 7, 7], [3], [11, 22, 33, 44, 55]]
LENGTHS = [24, 16, 12, 20]


@pytest.fixture(scope="module")
def cluster():
    ray.shutdown()  # the session's one-node instance, if a module before started it: the next module that needs it starts it again
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    draft_node = cluster.add_node(num_cpus=1, resources={"draft": 1})
    target_node = cluster.add_node(num_cpus=1, resources={"target": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield draft_node.node_id, target_node.node_id
    ray.shutdown()
    cluster.shutdown()


def test_draft_and_target_pools_on_their_own_nodes_give_exact_greedy_output(cluster, tmp_path):
    draft_node, target_node = cluster
    target, drafter = build_models(tmp_path, kind="eagle3")
    config = service_config(
        target,
        drafter,
        pools={"draft": {"num_cpus": 1, "resources": {"draft": 1}}, "target": {"num_cpus": 1, "resources": {"target": 1}}},
    )
    with Service(config, port=0) as service, Client(service.address) as client:
        pools = {p["name"]: p["workers"] for p in client.status()["pools"]}
        assert [w["node_id"] for w in pools["draft"]] == [draft_node]
        assert [w["node_id"] for w in pools["target"]] == [target_node]
        outputs = [client.generate(p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, LENGTHS)]
    assert outputs == hf_greedy(target, PROMPTS, LENGTHS)
