"""`eyas bench profile`: where a round's time goes on a device, or a batch's under a sampling profiler.

Rounds (the default): the demo models' rounds by phase on two held-out prompts, then torch's profiler over a third;
its tables (host time per operator, device time per kernel, host time per operator and shape) go to stderr.
`--batch`: `generate_batch` of 8 held-out prompts, timed a few times after the batch's graph shapes are captured, for
a sampling profiler (`py-spy record -- eyas bench profile --batch`), whose samples under `timed_batches` are the
batches' own.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from eyas import Engine, Generation

from .harness import demo_suite
from .runtime import heldout_ids, settle

BATCH = 8
MAX_NEW_TOKENS = 64


def per_round(generation: Generation) -> dict[str, float]:
    """Milliseconds per round of each phase of one generation."""
    return {k: round(1000 * v / generation.stats.rounds, 2) for k, v in generation.stats.seconds.items()}


def rounds(engine: Engine) -> dict:
    """Two held-out prompts' rounds by phase after a warm-up, then a third under torch's profiler (tables to stderr)."""
    prompts = heldout_ids(engine, 100, 4)
    engine.generate(prompts[0], max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)  # warm-up
    timed = []
    for prompt in prompts[1:3]:
        start = time.perf_counter()
        g = engine.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)
        wall = time.perf_counter() - start
        timed.append({"rounds": g.stats.rounds, "ms_per_round": 1000 * wall / g.stats.rounds, "phases_ms_per_round": per_round(g)})
    on_cuda = engine.target.runtime.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        g = engine.generate(prompts[3], max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)
    ops = prof.key_averages()
    print(ops.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60), file=sys.stderr)
    print(ops.table(sort_by="self_cuda_time_total" if on_cuda else "cpu_time_total", row_limit=15, max_name_column_width=60), file=sys.stderr)
    shapes = prof.key_averages(group_by_input_shape=True)
    print(shapes.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50, max_shapes_column_width=80), file=sys.stderr)
    return {"timed": timed, "profiled": {"rounds": g.stats.rounds, "phases_ms_per_round": per_round(g)}}


def timed_batches(engine: Engine, prompts: list[list[int]], repeats: int) -> list[dict]:
    """The batch `repeats` times, each with its tokens/s and milliseconds per lockstep round."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        gens = engine.generate_batch(prompts, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)
        wall = time.perf_counter() - start
        steps = max(g.stats.rounds for g in gens)
        tokens_per_s = sum(len(g.token_ids) for g in gens) / wall
        runs.append({"tokens_per_s": tokens_per_s, "lockstep_rounds": steps, "ms_per_round": 1000 * wall / steps})
        print(f"eyas bench profile: batch {tokens_per_s:.1f} tok/s, {1000 * wall / steps:.2f} ms a round", file=sys.stderr, flush=True)
    return runs


def batch(engine: Engine, prompts: list[list[int]], repeats: int) -> dict:
    """One at a time once, the batch once to capture its shapes, then the batch timed `repeats` times."""
    settle(engine, prompts[-1], MAX_NEW_TOKENS)  # tree auto's first exploration, untimed
    start = time.perf_counter()
    alone = [engine.generate(p, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False) for p in prompts[:BATCH]]
    one_at_a_time = sum(len(g.token_ids) for g in alone) / (time.perf_counter() - start)
    engine.generate_batch(prompts[:BATCH], max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)  # captures its shapes
    return {"one_at_a_time_tokens_per_s": one_at_a_time, "batches": timed_batches(engine, prompts[:BATCH], repeats)}


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark for the options of `eyas bench profile`; returns its JSON record."""
    suite = demo_suite(BATCH + 1)
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    tree = "auto" if args.batch else {"width": 4, "depth": 5, "budget": 64}
    engine = Engine.from_pretrained(suite.target, suite.drafters["eagle3"], tree=tree, dtype=args.dtype, device=args.device, graphs=graphs)
    record = {
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        "config": {"dtype": str(engine.target.runtime.dtype).removeprefix("torch."), "device": str(engine.target.runtime.device),
                   "graphs": engine.target.graphs is not None, "tree": tree},
    }
    if args.batch:
        record["batch"] = batch(engine, suite.prompts, args.repeats)
    else:
        record["rounds"] = rounds(engine)
    return record
