"""`eyas bench failover`: failover and refusal costs of a local service on the demo models.

For target pools of two workers and of one: four concurrent streams, then SIGKILL of the busiest
target worker; per repeat, the time from the kill to the next tokens of every request that was
rebuilt (p50 and max over repeats), and how many requests failed out of those in flight. Then
the front door's Health latency while maximal prompts are being refused.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from eyas.actors.config import ServiceConfig
from eyas.client.client import Client, EyasError
from eyas.cluster.service import Service

PROMPTS = [[5, 17, 33, 8, 9], [7, 7, 7], [11, 22, 33, 44, 55, 66, 77], [60, 1, 60, 1]]
LENGTH = 160


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)


def kill_round(client: Client) -> dict:
    """Four streams; kill the busiest target worker after every stream's first round."""
    arrivals: list[list[float]] = [[] for _ in PROMPTS]
    finals: list[dict | None] = [None] * len(PROMPTS)
    failures: list[str | None] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        try:
            for chunk in client.stream(PROMPTS[i], max_new_tokens=LENGTH, ignore_eos=True):
                arrivals[i].append(time.perf_counter())
                if chunk.finish_reason:
                    finals[i] = chunk.stats
        except EyasError as exc:
            failures[i] = str(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    wait_for(lambda: all(arrivals), 120)
    target = next(p for p in client.status()["pools"] if p["name"] == "target")
    victim = max(target["workers"], key=lambda w: w["assigned"])
    killed = time.perf_counter()
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(600)
    gaps = [
        next(t for t in times if t > killed) - killed
        for times, stats in zip(arrivals, finals)
        if stats is not None and stats["rebuilds"] > 0 and any(t > killed for t in times)
    ]
    return {"next_tokens_s": gaps, "failed": sum(f is not None for f in failures), "in_flight": len(PROMPTS), "errors": [f for f in failures if f]}


def failover(targets: int, repeats: int) -> dict:
    config = ServiceConfig.from_dict({"models": {"dtype": "float32"}, "pools": {"draft": {"replicas": 1}, "target": {"replicas": targets}}, "network": {"http_port": 0}})
    with Service(config, port=0) as service, Client(service.address) as client:
        rounds = []
        for _ in range(repeats):
            rounds.append(kill_round(client))
            wait_for(lambda: sum(w["state"] == "ready" for p in client.status()["pools"] if p["name"] == "target" for w in p["workers"]) == targets, 300)
    gaps = [g for r in rounds for g in r["next_tokens_s"]]
    return {
        "target_workers": targets,
        "repeats": repeats,
        "next_tokens_after_kill_s": {"p50": statistics.median(gaps) if gaps else None, "max": max(gaps, default=None), "samples": gaps},
        "failed": sum(r["failed"] for r in rounds),
        "in_flight": sum(r["in_flight"] for r in rounds),
        "errors": [e for r in rounds for e in r["errors"]],
    }


def health_under_refusals(refusals: int = 6) -> dict:
    """Health latency while prompts just under the message cap are refused for length."""
    config = ServiceConfig.from_dict({"models": {"dtype": "float32"}, "network": {"http_port": 0}})
    prompt = "w" * (config.max_request_bytes - 4096)  # the largest text the front door decodes
    with Service(config, port=0) as service, Client(service.address) as client:
        latencies: list[float] = []
        refused: list[float] = []
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                client.health()
                latencies.append(time.perf_counter() - t0)

        def refuse() -> None:
            for _ in range(refusals):
                t0 = time.perf_counter()
                try:
                    client.generate(prompt, max_new_tokens=4)
                except EyasError as exc:
                    assert exc.field == "prompt", exc
                refused.append(time.perf_counter() - t0)

        with ThreadPoolExecutor(2) as pool:
            prober = pool.submit(probe)
            pool.submit(refuse).result()
            done.set()
            prober.result()
    return {
        "prompt_bytes": len(prompt),
        "refusal_s": {"p50": statistics.median(refused), "max": max(refused)},
        "health_s": {"p50": statistics.median(latencies), "max": max(latencies), "calls": len(latencies)},
    }


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark for the options of `eyas bench failover`; returns its JSON record."""
    ray.init(num_cpus=6, include_dashboard=False, logging_level="warning")
    try:
        return {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
            "models": "demo",
            "failover": [failover(2, args.repeats), failover(1, args.repeats)],
            "health_while_refusing": health_under_refusals(),
        }
    finally:
        ray.shutdown()
