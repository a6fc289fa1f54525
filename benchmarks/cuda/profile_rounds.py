"""Where a round's time goes on a device: the demo models' rounds by phase on two held-out prompts, then torch's
profiler over a third (host time per operator, device time per kernel, and host time per operator and shape).
The records in `benchmarks/cuda/h200-3/prof-*.txt` came from it:

    python3 benchmarks/cuda/profile_rounds.py DTYPE GRAPHS [DEVICE]   # bfloat16|float32, on|off, default cuda
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from eyas import Engine, Generation
from eyas.client.bench.harness import demo_suite
from eyas.client.bench.runtime import heldout_ids


def per_round(generation: Generation) -> dict[str, float]:
    """Milliseconds per round of each phase of one generation."""
    return {k: round(1000 * v / generation.stats.rounds, 2) for k, v in generation.stats.seconds.items()}


def main(dtype: str, graphs: str, device: str = "cuda") -> None:
    suite = demo_suite(4)
    tree = {"width": 4, "depth": 5, "budget": 64}
    engine = Engine.from_pretrained(suite.target, suite.drafters["eagle3"], tree=tree, dtype=dtype, device=device, graphs=graphs == "on")
    prompts = heldout_ids(engine, 100, 4)
    engine.generate(prompts[0], max_new_tokens=64, stop_at_eos=False)  # warm-up
    for prompt in prompts[1:3]:
        start = time.perf_counter()
        g = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False)
        wall = time.perf_counter() - start
        print(dtype, graphs, "rounds", g.stats.rounds, "ms/round", round(1000 * wall / g.stats.rounds, 2), per_round(g), flush=True)
    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        g = engine.generate(prompts[3], max_new_tokens=64, stop_at_eos=False)
    print("profiled rounds", g.stats.rounds, per_round(g))
    ops = prof.key_averages()
    print(ops.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(ops.table(sort_by="self_cuda_time_total" if on_cuda else "cpu_time_total", row_limit=15, max_name_column_width=60))
    shapes = prof.key_averages(group_by_input_shape=True)
    print(shapes.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50, max_shapes_column_width=80))


if __name__ == "__main__":
    main(*sys.argv[1:])
