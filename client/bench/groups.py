"""`eyas bench groups`: a 2-rank target group against 1 rank on the demo target (CPU, gloo).

Runtime part (two local processes joined like a group's ranks): weight and KV-pool bytes per rank; the
median time of one verify forward (a 12-row tree on a 256-token prefix) on 1 rank and on 2; and the
collectives of that forward timed alone on the same tensors: one all-reduce of the [1, 12, d] hidden
states (2 per layer + 1 for the embedding), one all-gather of the [12, V/2] logits, one lockstep broadcast.
Service part: greedy tokens/s of 4 concurrent requests through a service with tensor_parallel 1 and 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
import torch.multiprocessing as mp

from eyas.actors.config import ServiceConfig
from eyas.assets import DEFAULT_DRAFTER, demo_model
from eyas.client.client import Client
from eyas.cluster.service import Service
from eyas.manifest import FeatureAddress
from eyas.runtime.shard import Shard, join_group, open_rendezvous
from eyas.target import TargetModel, TargetSession

PREFIX, ROWS, REPEATS = 256, 12, 30
PROMPTS = [[5, 17, 33, 8, 9], [7, 7, 7], [11, 22, 33, 44, 55, 66, 77], [60, 1, 60, 1]]


def median_seconds(fn, repeats: int = REPEATS) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model: TargetModel) -> dict:
    """Rank 0: bytes held, one verify forward's time, and (on a group) its collectives timed alone."""
    session = TargetSession(model)
    session.prefill(0, [(7 * i) % 4000 + 3 for i in range(PREFIX)])
    tokens = torch.arange(ROWS) + 10
    positions = torch.arange(PREFIX, PREFIX + ROWS)
    mask = torch.ones(ROWS, ROWS, dtype=torch.bool).tril()
    call = model.call(session.slot, session.committed, tokens, positions, mask)
    out = {
        "weight_bytes": sum(t.numel() * t.element_size() for t in model.runtime.tensors()),
        "kv_pool_bytes": model.pool.reserved_bytes,
        "verify_forward_s": median_seconds(lambda: model.run([call])),
    }
    shard = model.runtime.shard
    if shard.size > 1:
        out.update(model.ranks.lead("collectives"))  # every rank times the same collectives in step
        out["lockstep_broadcast_s"] = median_seconds(lambda: model.ranks.lead("noop"))
        out["all_reduces_per_forward"] = 2 * model.num_layers + 1
    session.close()
    return out


def rank_main(rank: int, size: int, ports, results) -> None:
    torch.set_num_threads(1)
    store = open_rendezvous("127.0.0.1") if rank == 0 else None
    if rank == 0 and size > 1:
        for _ in range(size - 1):
            ports.put(store.port)
    port = store.port if rank == 0 else ports.get()
    shard = join_group("127.0.0.1", port, rank, size, torch.device("cpu"), datetime.timedelta(seconds=120), store) if size > 1 else Shard()
    model = TargetModel.from_pretrained(demo_model("target"), FeatureAddress.eagle1(), kv_slots=4, max_seq_len=1024, shard=shard)
    hidden = torch.zeros(1, ROWS, model.hidden_size, dtype=model.runtime.dtype)
    logits = torch.zeros(ROWS, model.vocab_size // size)

    def collectives() -> dict:
        return {
            "all_reduce_s": median_seconds(lambda: shard.all_reduce(hidden)),
            "all_gather_logits_s": median_seconds(lambda: shard.gather_last(logits)),
        }

    model.ranks.ops.update(collectives=collectives, noop=lambda: None)
    if rank == 0:
        results.put(json.dumps(measure(model)))
        model.stop()
    else:
        model.follow()


def runtime_part(size: int) -> dict:
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, size, ports, results)) for r in range(size)]
    for p in procs:
        p.start()
    out = json.loads(results.get(timeout=600))
    for p in procs:
        p.join(60)
    return out


def service_part(size: int, tokens: int) -> dict:
    data = {
        "pools": {"draft": {"replicas": 1}, "target": {"replicas": 1, "tensor_parallel": size}},
        "tree": {"width": 4, "depth": 4, "budget": 12},
        "models": {"dtype": "float32"},  # one dtype for target and drafter on CPU
        "ray": {"num_cpus": 4},
        "network": {"http_port": 0},
    }
    with Service(ServiceConfig.from_dict(data), port=0) as service:
        client = Client(service.address)
        client.generate(PROMPTS[0], max_new_tokens=8)  # warm up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outputs = list(pool.map(lambda p: list(client.generate(p, max_new_tokens=tokens).token_ids), PROMPTS))
        wall = time.perf_counter() - t0
        status = client.status()
        client.close()
    produced = sum(len(o) for o in outputs)
    return {"tokens": produced, "seconds": wall, "tokens_per_s": produced / wall, "outputs": outputs, "status_target": status["pools"]}


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark for the options of `eyas bench groups`; returns its JSON record."""
    one, two = runtime_part(1), runtime_part(2)
    comm = two["all_reduces_per_forward"] * two["all_reduce_s"] + two["all_gather_logits_s"] + two["lockstep_broadcast_s"]
    services = {size: service_part(size, args.tokens) for size in (1, 2)}
    return {
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__, "ray": ray.__version__},
        "target": str(demo_model("target")),
        "drafter": str(demo_model(DEFAULT_DRAFTER)),
        "verify_forward": {"prefix": PREFIX, "rows": ROWS},
        "ranks_1": one,
        "ranks_2": two,
        "collectives_per_forward_s": comm,
        "weight_ratio": two["weight_bytes"] / one["weight_bytes"],
        "kv_ratio": two["kv_pool_bytes"] / one["kv_pool_bytes"],
        "service": {
            str(size): {k: v for k, v in result.items() if k not in ("outputs", "status_target")} for size, result in services.items()
        },
        "service_outputs_equal": services[1]["outputs"] == services[2]["outputs"],
    }
