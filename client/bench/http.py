"""`eyas bench service --http`: what the OpenAI-compatible HTTP endpoint adds over the gRPC front door.

One local service, the same greedy requests (fixed length: EOS ignored) through gRPC (the Python client),
HTTP returning one JSON body, and HTTP streaming server-sent events: one request at a time, N at once, and
one-token requests one at a time (what a request costs beside its rounds). One at a time, each prompt goes
through the three in turn, the order rotating from prompt to prompt, so that the requests compared ran moments
apart; N at once, each repeat runs the three in turn, the order rotating from repeat to repeat, so machine drift
lands on all alike. The HTTP client is the
standard library's (keep-alive, one connection per thread), so the numbers are the endpoint's cost rather
than a client library's. Per request: latency, and the CPU time of the service's processes, of this
process (the clients) and of every other process on the machine (on a shared machine, what the workers
competed with); at N at once: tokens/s. Prints one JSON record.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

from eyas.actors.config import PoolConfig, ServiceConfig
from eyas.client.client import Client
from eyas.cluster.service import Service
from eyas.engine import Engine
from eyas.tree import TreePolicy

from .harness import cpu_model, prompts_for, tree_record
from .peers import free_port
from .service import cpu_seconds, service_pids

SYSTEMS = ("grpc", "http", "http_stream")
GOALS = {"added_ms_per_request_at_1": 1.0, "added_fraction_at_n": 0.05}  # docs/http.md#cost


class HttpRequests:
    """Completions over HTTP/1.1 keep-alive, one connection per calling thread; returns each request's token ids."""

    def __init__(self, address: str, token: str | None):
        self.host, self.port = address.rsplit(":", 1)
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        if not hasattr(self._local, "connection"):
            self._local.connection = http.client.HTTPConnection(self.host, int(self.port))
        return self._local.connection

    def _post(self, body: str) -> http.client.HTTPResponse:
        connection = self._connection()
        try:
            connection.request("POST", "/v1/completions", body, self.headers)
            return connection.getresponse()
        except ConnectionError:
            connection.close()
            del self._local.connection
            raise

    def complete(self, prompt: list[int], max_tokens: int, stream: bool) -> list[int]:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream})
        try:
            response = self._post(body)
        except ConnectionError:  # the server closed this thread's idle connection (its keep-alive timeout): reconnect
            response = self._post(body)
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read().decode()}")
        if not stream:
            return json.loads(response.read())["choices"][0]["token_ids"]
        tokens = []
        for line in response:
            if line.startswith(b"data: {"):
                tokens += json.loads(line[6:])["choices"][0]["token_ids"]
        return tokens


def machine_cpu_seconds() -> float:
    """CPU seconds every process on the machine has used so far (Linux /proc/stat: all but idle and iowait)."""
    ticks = list(map(int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]))
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def cpu_clocks(pids: list[int]) -> tuple[float, float, float]:
    """CPU seconds so far of the service's processes, of this process (the clients) and of the whole machine."""
    return cpu_seconds(pids), time.process_time(), machine_cpu_seconds()


def run_record(outputs: list[list[int]], latencies: list[float], wall: float, spent: list[float], requests: int) -> dict:
    """One system's run: outputs, each request's latency, tokens/s over `wall` and the CPU seconds `spent` (as
    `cpu_clocks` splits them) per request."""
    service, client, machine = (1e3 * seconds / requests for seconds in spent)
    return {
        "outputs": outputs,
        "latency_s": latencies,
        "tokens_per_s": sum(map(len, outputs)) / wall,
        "cpu_ms_per_request": service,
        "client_cpu_ms_per_request": client,
        "machine_cpu_ms_per_request": machine,
    }


def measure(send: Callable[[list[int]], list[int]], prompts: list[list[int]], pool: ThreadPoolExecutor, pids: list[int]) -> dict:
    """Every prompt through `send` on `pool`'s threads (as many at once): `run_record`."""
    started, clocks = time.perf_counter(), cpu_clocks(pids)

    def timed(prompt: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        return send(prompt), time.perf_counter() - t0

    outputs, latencies = zip(*pool.map(timed, prompts))
    wall = time.perf_counter() - started
    spent = [b - a for a, b in zip(clocks, cpu_clocks(pids))]
    return run_record(list(outputs), list(latencies), wall, spent, len(prompts))


def measure_interleaved(
    sends: dict[str, Callable[[list[int]], list[int]]], prompts: list[list[int]], pids: list[int], turn: int
) -> dict[str, dict]:
    """Each prompt through every system in turn, one request at a time, the order rotating from prompt to prompt
    (starting at `turn`): a `run_record` per system, each request's pair taken moments apart."""
    names = list(sends)
    outputs: dict[str, list] = {name: [] for name in names}
    latencies: dict[str, list[float]] = {name: [] for name in names}
    spent = {name: [0.0, 0.0, 0.0] for name in names}
    for i, prompt in enumerate(prompts):
        for name in names[(turn + i) % len(names) :] + names[: (turn + i) % len(names)]:
            clocks, t0 = cpu_clocks(pids), time.perf_counter()
            outputs[name].append(sends[name](prompt))
            latencies[name].append(time.perf_counter() - t0)
            spent[name] = [total + b - a for total, a, b in zip(spent[name], clocks, cpu_clocks(pids))]
    return {name: run_record(outputs[name], latencies[name], sum(latencies[name]), spent[name], len(prompts)) for name in names}


def others_cpu(run: dict) -> float:
    """CPU ms per request that every process but the service and this one took during a run."""
    return run["machine_cpu_ms_per_request"] - run["cpu_ms_per_request"] - run["client_cpu_ms_per_request"]


def summary(runs: list[dict]) -> dict:
    """Medians over repeats of one system at one concurrency."""
    return {
        "latency_ms_median": 1e3 * statistics.median(t for run in runs for t in run["latency_s"]),
        "latency_ms_mean": 1e3 * statistics.median(statistics.fmean(run["latency_s"]) for run in runs),
        "tokens_per_s": statistics.median(run["tokens_per_s"] for run in runs),
        "service_cpu_ms_per_request": statistics.median(run["cpu_ms_per_request"] for run in runs),
        "client_cpu_ms_per_request": statistics.median(run["client_cpu_ms_per_request"] for run in runs),
        "others_cpu_ms_per_request": statistics.median(map(others_cpu, runs)),  # interference on a shared machine
    }


def added(runs: dict[str, list[dict]], system: str) -> dict:
    """What `system` adds over gRPC: per request, the median of the same request's latency difference in the same
    repeat (ms); for the whole run, the fraction more wall time (gRPC tokens/s over its tokens/s, less one)."""
    pairs = [h - g for hr, gr in zip(runs[system], runs["grpc"]) for h, g in zip(hr["latency_s"], gr["latency_s"])]
    fractions = [g["tokens_per_s"] / h["tokens_per_s"] - 1 for h, g in zip(runs[system], runs["grpc"])]
    cpu = [h["cpu_ms_per_request"] - g["cpu_ms_per_request"] for h, g in zip(runs[system], runs["grpc"])]
    client_cpu = [h["client_cpu_ms_per_request"] - g["client_cpu_ms_per_request"] for h, g in zip(runs[system], runs["grpc"])]
    others = [others_cpu(h) - others_cpu(g) for h, g in zip(runs[system], runs["grpc"])]
    return {
        "added_ms_per_request": 1e3 * statistics.median(pairs),
        "added_fraction": statistics.median(fractions),
        "added_fraction_per_repeat": fractions,
        "added_service_cpu_ms_per_request": statistics.median(cpu),
        "added_client_cpu_ms_per_request": statistics.median(client_cpu),
        "others_cpu_ms_per_request_more_than_grpc": statistics.median(others),  # interference, not this bench's work
    }


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark for the options of `eyas bench service --http`; returns its JSON record."""
    config = ServiceConfig.load(
        None, target=args.target, drafter=args.drafter, draft_ahead=args.draft_ahead, emulate=args.emulate, http_port=free_port()
    )
    if args.tree and args.tree != "auto":
        config = replace(config, tree=TreePolicy(*map(int, args.tree.split(","))))
    if args.emulate:  # timed models (docs/emulation.md): rounds as short as the profile's, so the front door weighs more
        target = drafter = f"emulated: {args.emulate}"
        engine = Engine.emulated(args.emulate)
    else:
        target, drafter = config.models()
        engine = Engine.from_pretrained(target, drafter)
    prompts = prompts_for(engine, args.requests, args.prompt_tokens, args.seed, args.prompts_from)
    config = replace(
        config,
        draft_pool=PoolConfig(replicas=args.draft_workers, num_cpus=1, threads=1),
        target_pool=PoolConfig(replicas=args.target_workers, num_cpus=1, threads=1),
        ray_num_cpus=max(args.draft_workers + args.target_workers, os.cpu_count() or 1),
    )
    n = args.requests
    if n < 2:
        raise ValueError(f"--requests: --http compares one at a time with --requests at once, so at least 2, got {n}")
    load_before = os.getloadavg()
    pools = {1: ThreadPoolExecutor(1), n: ThreadPoolExecutor(n)}  # threads live on, and with them their HTTP connections
    # (name, requests, at once, tokens each): the requests as given, one at a time and n at once; and one-token
    # requests one at a time, four per prompt, whose latency is mostly what a request costs beside its rounds
    levels = [("at_1", prompts, 1, args.max_new_tokens), (f"at_{n}", prompts, n, args.max_new_tokens), ("at_1_one_token", prompts * 4, 1, 1)]
    runs = {name: {system: [] for system in SYSTEMS} for name, *_ in levels}
    with Service(config, port=0) as service, Client(service.address) as client:
        web = HttpRequests(service.http_address, config.shared_token)
        send = {
            "grpc": lambda p, tokens: client.generate(p, max_new_tokens=tokens, ignore_eos=True).token_ids,
            "http": lambda p, tokens: web.complete(p, tokens, stream=False),
            "http_stream": lambda p, tokens: web.complete(p, tokens, stream=True),
        }
        pids = service_pids(client)
        for repeat in range(args.repeats + 1):  # the first round warms every path and each thread's connection up
            print(f"eyas bench: {'warm-up' if not repeat else f'repeat {repeat}/{args.repeats}'}", file=sys.stderr, flush=True)
            order = SYSTEMS[repeat % len(SYSTEMS) :] + SYSTEMS[: repeat % len(SYSTEMS)]
            for name, requests, at_once, tokens in levels:
                if at_once == 1:  # request by request: each system's request beside the others' on the same prompt
                    sends = {system: partial(send[system], tokens=tokens) for system in SYSTEMS}
                    results = pools[1].submit(measure_interleaved, sends, requests, pids, repeat).result()
                else:
                    results = {system: measure(partial(send[system], tokens=tokens), requests, pools[at_once], pids) for system in order}
                if repeat:
                    for system in SYSTEMS:
                        runs[name][system].append(results[system])
    for pool in pools.values():
        pool.shutdown()
    record = {
        "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(), "processor": cpu_model(),
            "load_average_before_and_after": [load_before, os.getloadavg()],  # other work on the machine: the noise
        },
        "models": {"target": target, "drafter": drafter, "tree": tree_record(config.policy)},
        "emulation": args.emulate,  # a profile name: every figure is then emulation
        "requests": n,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "identical_outputs": all(
            r["outputs"] == runs[name]["grpc"][0]["outputs"] for name in runs for system in SYSTEMS for r in runs[name][system]
        ),
        "goals": GOALS,
    }
    for name in runs:
        record[name] = {system: summary(runs[name][system]) for system in SYSTEMS}
        record[name]["http_over_grpc"] = {system: added(runs[name], system) for system in SYSTEMS[1:]}
    record["goals_met"] = {
        system: {
            "added_ms_per_request_at_1": record["at_1"]["http_over_grpc"][system]["added_ms_per_request"] <= GOALS["added_ms_per_request_at_1"],
            f"added_fraction_at_{n}": record[f"at_{n}"]["http_over_grpc"][system]["added_fraction"] <= GOALS["added_fraction_at_n"],
        }
        for system in SYSTEMS[1:]
    }
    return record
