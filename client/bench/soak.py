"""`eyas bench soak`: many requests through one service, the coordinator's resident memory sampled as they finish.

The service runs embedded (its own Ray, a free port) on the given models; `--concurrency` client
threads send `--requests` short requests (text and token-id prompts in turn, greedy and sampled in
turn), and every `--every` finished requests the coordinator's RSS is read from `eyas status`. The
record holds every sample and, after `--warmup` requests, the growth and the least-squares slope
per 1000 requests: flat means the coordinator keeps nothing per finished request.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from dataclasses import replace

from eyas.actors.config import ServiceConfig
from eyas.cluster.service import Service
from eyas.tree import TreePolicy

from ..client import Client
from .harness import CODE_PROMPTS

MIB = 2**20


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of (x, y) points, y per unit of x (0 for fewer than two distinct x)."""
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def requests(count: int, max_new_tokens: int):
    """`count` request options: text and token-id prompts (ids 5..63, in any vocabulary) in turn, greedy and sampled in turn."""
    texts = itertools.cycle(CODE_PROMPTS)
    for i in range(count):
        prompt = next(texts) if i % 2 == 0 else [5 + (7 * i + k) % 59 for k in range(4 + i % 13)]
        yield {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0.8 if i % 4 >= 2 else 0.0, "seed": i}


def run(args: argparse.Namespace) -> dict:
    config = ServiceConfig.load(args.config, http_port=0, **{k: v for k, v in (("target", args.target), ("drafter", args.drafter)) if v})
    config = replace(config, tree="auto" if args.tree == "auto" else TreePolicy(*map(int, args.tree.split(","))))
    samples: list[tuple[int, int]] = []
    done, failed = 0, 0
    lock = threading.Lock()
    say = lambda line: print(f"eyas bench soak: {line}", file=sys.stderr, flush=True)  # noqa: E731
    with Service(config, port=0, on_progress=say) as service, Client(service.address) as client:
        work = iter(requests(args.requests, args.max_new_tokens))
        samples.append((0, client.status()["coordinator_rss_bytes"]))
        began = time.perf_counter()

        def send() -> None:
            nonlocal done, failed
            while True:
                with lock:
                    options = next(work, None)
                if options is None:
                    return
                try:
                    client.generate(options.pop("prompt"), **options)
                except Exception:  # counted: a soak reports failures, it does not stop at one
                    with lock:
                        failed += 1
                with lock:
                    done += 1
                    count = done
                if count % args.every == 0:
                    rss = client.status()["coordinator_rss_bytes"]
                    with lock:
                        samples.append((count, rss))
                    say(f"{count} requests, coordinator rss {rss / MIB:.1f} MiB")

        threads = [threading.Thread(target=send) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - began
        status = client.status()
    samples.sort()
    after = [(n, rss) for n, rss in samples if n >= args.warmup]
    return {
        "config": {"requests": args.requests, "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
                   "tree": args.tree, "warmup": args.warmup, "every": args.every},
        "completed": status["completed"], "failed": status["failed"] + failed, "seconds": seconds,
        "coordinator_rss_mib": [(n, rss / MIB) for n, rss in samples],
        "after_warmup": {
            "first_mib": after[0][1] / MIB, "last_mib": after[-1][1] / MIB, "max_mib": max(r for _, r in after) / MIB,
            "growth_mib": (after[-1][1] - after[0][1]) / MIB, "slope_mib_per_1000": slope(after) * 1000 / MIB,
        } if len(after) >= 2 else None,
        "workers_rss_mib": {w["worker_id"]: w["rss_bytes"] / MIB for p in status["pools"] for w in p["workers"]},
    }
