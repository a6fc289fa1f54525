"""Service overhead benchmark: the service's time per round against the in-process engine's, and what concurrency buys.

Same machine, same models, same prompts, one run: the in-process engine (one torch thread, like each
worker) and a local service with one draft and one target worker. Reports per-round time with the
service's extra cost split into RPC, serialization (with receipt checks), queueing and coordinator
work; then aggregate tokens/s of N concurrent requests against the same requests one at a time.
Prints one JSON record.

    python -m eyas.cluster.bench [--target DIR --drafter DIR] [--requests 8] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from eyas import Engine
from eyas.client.client import Client

from .config import PoolConfig, ServiceConfig
from .service import Service

ENGINE_PHASES = ("draft", "tree", "verify", "publish")
SERVICE_PHASES = ("compute", "rpc", "serialize", "queue", "coordinator")


def prompts_for(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def in_process(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """One request at a time in this process: outputs, per-round phase seconds, tokens/s."""
    engine.generate(prompts[0], max_new_tokens=8)  # warm-up
    outputs, rounds, phases, tokens = [], 0, dict.fromkeys(ENGINE_PHASES, 0.0), 0
    started = time.perf_counter()
    for prompt in prompts:
        gen = engine.generate(prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)
        outputs.append(gen.token_ids)
        rounds += gen.stats.rounds
        tokens += len(gen.token_ids)
        for phase in ENGINE_PHASES:
            phases[phase] += gen.stats.seconds[phase]
    wall = time.perf_counter() - started
    return {
        "outputs": outputs,
        "rounds": rounds,
        "ms_per_round": 1e3 * sum(phases.values()) / rounds,
        "phases_ms_per_round": {p: 1e3 * s / rounds for p, s in phases.items()},
        "tokens_per_s": tokens / wall,
    }


def through_service(client: Client, prompts: list[list[int]], max_new_tokens: int, concurrency: int) -> dict:
    """The same requests through the service: one at a time (with the overhead split), then `concurrency` at once."""
    options = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    client.generate(prompts[0], max_new_tokens=8)  # warm-up
    started = time.perf_counter()
    results = [client.generate(p, **options) for p in prompts]
    sequential_wall = time.perf_counter() - started
    rounds = sum(r.stats["rounds"] for r in results)
    phases = {p: sum(r.stats["service_seconds"][p] for r in results) for p in SERVICE_PHASES}
    tokens = sum(len(r.token_ids) for r in results)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        concurrent = list(pool.map(lambda p: client.generate(p, **options), prompts))
    concurrent_wall = time.perf_counter() - started
    return {
        "outputs": [r.token_ids for r in results],
        "concurrent_outputs": [r.token_ids for r in concurrent],
        "rounds": rounds,
        "ms_per_round": 1e3 * sum(phases.values()) / rounds,
        "breakdown_ms_per_round": {p: 1e3 * s / rounds for p, s in phases.items()},
        "sequential_tokens_per_s": tokens / sequential_wall,
        "concurrent_tokens_per_s": sum(len(r.token_ids) for r in concurrent) / concurrent_wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyas.cluster.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target directory (default: the bundled demo target)")
    parser.add_argument("--drafter", help="drafter directory (default: the bundled demo EAGLE-3 drafter)")
    parser.add_argument("--requests", type=int, default=8, help="requests, also the concurrency of the second run")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternate in-process and service runs this often")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-workers", type=int, default=1)
    parser.add_argument("--target-workers", type=int, default=1)
    args = parser.parse_args(argv)

    config = ServiceConfig.load(None, target=args.target, drafter=args.drafter)
    target, drafter = config.models()
    torch.set_num_threads(1)  # as each worker runs
    engine = Engine.from_pretrained(target, drafter, tree=config.tree)
    prompts = prompts_for(engine.target.vocab_size, args.requests, args.prompt_tokens, args.seed)
    workers = args.draft_workers + args.target_workers
    config = replace(
        config,
        draft_pool=PoolConfig(replicas=args.draft_workers, num_cpus=1, threads=1),
        target_pool=PoolConfig(replicas=args.target_workers, num_cpus=1, threads=1),
        ray_num_cpus=max(workers, os.cpu_count() or 1),  # logical CPUs: every worker gets its bundle
    )
    local_runs, service_runs = [], []
    with Service(config, port=0) as service, Client(service.address) as client:
        for _ in range(args.repeats):
            local_runs.append(in_process(engine, prompts, args.max_new_tokens))
            service_runs.append(through_service(client, prompts, args.max_new_tokens, args.requests))

    def median(runs: list[dict], *keys: str) -> float:
        values = []
        for run in runs:
            for key in keys:
                run = run[key]
            values.append(run)
        return statistics.median(values)

    local_ms, service_ms = median(local_runs, "ms_per_round"), median(service_runs, "ms_per_round")
    record = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads_per_process": 1},
        "models": {"target": target, "drafter": drafter, "tree": vars(config.tree)},
        "workers": {"draft": args.draft_workers, "target": args.target_workers},
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "identical_outputs": all(s["outputs"] == l["outputs"] == s["concurrent_outputs"] for s, l in zip(service_runs, local_runs)),
        "rounds": local_runs[0]["rounds"],
        "tokens_per_round": args.requests * args.max_new_tokens / local_runs[0]["rounds"],
        "one_at_a_time": {
            "in_process_ms_per_round": local_ms,
            "in_process_phases_ms_per_round": {p: median(local_runs, "phases_ms_per_round", p) for p in ENGINE_PHASES},
            "service_ms_per_round": service_ms,
            "service_breakdown_ms_per_round": {p: median(service_runs, "breakdown_ms_per_round", p) for p in SERVICE_PHASES},
            "service_overhead": service_ms / local_ms - 1,
        },
        "throughput": {
            "in_process_tokens_per_s": median(local_runs, "tokens_per_s"),
            "service_one_at_a_time_tokens_per_s": median(service_runs, "sequential_tokens_per_s"),
            f"service_{args.requests}_concurrent_tokens_per_s": median(service_runs, "concurrent_tokens_per_s"),
            "concurrency_gain": median(service_runs, "concurrent_tokens_per_s") / median(service_runs, "sequential_tokens_per_s"),
        },
    }
    json.dump(record, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
