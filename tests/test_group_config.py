"""Target-group config errors are refused before Ray starts, naming the field: a tensor_parallel that does not
divide the target's heads, kv heads or experts; more ranks than the embedded Ray's CPUs or devices; a group
of drafters; fractional GPUs per rank; an unknown placement."""

import re

import pytest
import ray
from tests.helpers.servicekit import service_config
from tests.helpers.tiny import make_drafter, make_target

from eyas.actors.config import ConfigError
from eyas.cluster.service import Service


@pytest.fixture(scope="module", autouse=True)
def no_ray():
    ray.shutdown()  # these refusals come before an embedded Ray starts: none may be running (the next module needing one starts it)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("groupconfig")
    llama = make_target(root / "llama")  # 4 heads, 2 kv heads
    mixtral = make_target(root / "mixtral", "mixtral")  # 4 experts
    return {"llama": (llama, make_drafter(root / "d-llama", llama)), "mixtral": (mixtral, make_drafter(root / "d-mixtral", mixtral))}


def refused(models, kind: str, target: dict, draft: dict | None = None, **sections) -> str:
    config = service_config(*models[kind], pools={"draft": draft or {"replicas": 1}, "target": target}, **sections)
    running = ray.is_initialized()  # the session's instance, when a module before this one started it
    with pytest.raises(ConfigError) as info:
        Service(config, port=0).start()
    assert ray.is_initialized() == running  # refused before Ray was started
    return str(info.value)


@pytest.mark.parametrize(
    ("kind", "ranks", "message"),
    [
        ("llama", 3, "pools.target.tensor_parallel: 3 ranks do not divide the target's 4 attention heads"),
        ("llama", 4, "pools.target.tensor_parallel: 4 ranks do not divide the target's 2 key/value heads"),
        ("mixtral", 8, "pools.target.tensor_parallel: 8 ranks do not divide the target's 4 attention heads"),
    ],
)
def test_splits_that_do_not_divide_the_target(models, kind, ranks, message):
    assert refused(models, kind, {"tensor_parallel": ranks}) == message


def test_more_ranks_than_the_machine_has(models):
    message = refused(models, "llama", {"tensor_parallel": 2, "num_cpus": 2}, ray={"num_cpus": 3})
    assert message == "pools.target.tensor_parallel: 2 ranks of 2 CPU each exceed ray.num_cpus 3"
    message = refused(models, "llama", {"tensor_parallel": 2, "num_gpus": 1})
    assert message.startswith("pools.target.tensor_parallel: 2 ranks of 1 GPU each exceed the ") and message.endswith(" visible devices")


@pytest.mark.parametrize(
    ("draft", "target", "message"),
    [
        ({"tensor_parallel": 2}, {}, "pools.draft.tensor_parallel: only target workers run as groups, got 2"),
        ({}, {"tensor_parallel": 0}, "pools.target.tensor_parallel: must be an integer >= 1, got 0"),
        ({}, {"tensor_parallel": 2, "num_gpus": 0.5}, "pools.target.num_gpus: each rank of a group needs whole devices, got 0.5"),
        ({}, {"placement": "TIGHT"}, "pools.target.placement: 'TIGHT' is not one of ['STRICT_PACK', 'PACK', 'SPREAD', 'STRICT_SPREAD']"),
    ],
)
def test_bad_pool_fields(models, draft, target, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        service_config(*models["llama"], pools={"draft": {"replicas": 1, **draft}, "target": {"replicas": 1, **target}})
