"""Where a batch's time goes: `generate_batch` of 8 held-out demo prompts, timed a few times after the batch's graph
shapes are captured, meant to run under a sampling profiler (py-spy), whose samples under `timed_batches` are the
batches' own (DTYPE bfloat16 or float32, DEVICE cuda or cpu):

    py-spy record --nonblocking -r 200 -f raw -o OUT.txt -- python3 benchmarks/cuda/profile_batch.py [DTYPE] [DEVICE]
"""

import sys
import time

from eyas import Engine
from eyas.client.bench.harness import demo_suite
from eyas.client.bench.runtime import settle

BATCH = 8
MAX_NEW_TOKENS = 64


def timed_batches(engine: Engine, prompts: list[list[int]], repeats: int) -> None:
    """The batch `repeats` times, each with its tokens/s and milliseconds per lockstep round."""
    for _ in range(repeats):
        start = time.perf_counter()
        gens = engine.generate_batch(prompts, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)
        wall = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in gens)
        rounds = max(g.stats.rounds for g in gens)
        print(f"batch: {tokens / wall:.1f} tok/s, {rounds} lockstep rounds, {1000 * wall / rounds:.2f} ms each", flush=True)


def main(dtype: str = "bfloat16", device: str = "cuda") -> None:
    suite = demo_suite(BATCH + 1)
    engine = Engine.from_pretrained(suite.target, suite.drafters["eagle3"], tree="auto", dtype=dtype, device=device)
    prompts = suite.prompts  # token ids
    settle(engine, prompts[-1], MAX_NEW_TOKENS)  # tree auto's first exploration, untimed
    start = time.perf_counter()
    alone = [engine.generate(p, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False) for p in prompts[:BATCH]]
    print(f"one at a time: {sum(len(g.token_ids) for g in alone) / (time.perf_counter() - start):.1f} tok/s", flush=True)
    engine.generate_batch(prompts[:BATCH], max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)  # captures its shapes
    timed_batches(engine, prompts[:BATCH], 5)


if __name__ == "__main__":
    main(*sys.argv[1:])
