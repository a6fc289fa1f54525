"""`eyas bench tree`: `tree: auto` against a grid of fixed trees, on the same prompts, in one run.

One engine decodes every prompt block with each fixed policy and with `auto` in turn (the
harness's interleaving, so machine drift lands on all alike). The tuner's one-time cost
measurement happens in the warm-up; its exploration rounds count, as they do in service.
"""

from __future__ import annotations

import platform
from dataclasses import asdict

import torch

from eyas.tree import TreePolicy

from .harness import EyasRunner, demo_suite, run_interleaved

GRID = (
    TreePolicy(1, 3, 3), TreePolicy(1, 5, 5), TreePolicy(1, 7, 7),
    TreePolicy(2, 4, 8), TreePolicy(2, 6, 12), TreePolicy(4, 4, 16), TreePolicy(4, 6, 24),
    TreePolicy(8, 5, 32), TreePolicy(8, 6, 48), TreePolicy(8, 8, 64), TreePolicy(3, 6, 16), TreePolicy(6, 7, 40),
    TreePolicy(1, 8, 8, 0.1), TreePolicy(1, 8, 8, 0.2),
)


def label(policy: TreePolicy) -> str:
    """width/depth/budget, and the floor where there is one."""
    return f"{policy.width}/{policy.depth}/{policy.budget}" + (f" stop {policy.stop:g}" if policy.stop else "")


def run(drafter: str, n_prompts: int, blocks: int, max_new_tokens: int, temperature: float) -> dict:
    """Tokens/s and acceptance of every grid policy and of `auto`; `auto_vs_best` is auto's tokens/s over the best policy's."""
    suite = demo_suite(n_prompts)
    auto = EyasRunner.load(suite.target, suite.drafters[drafter])
    runners = {("eyas", "auto", temperature): auto.run}
    for p in GRID:
        runners[("eyas", label(p), temperature)] = EyasRunner(auto.engine, asdict(p)).run
    for runner in runners.values():  # warm-up, untimed: the tuner measures this machine's costs here
        runner(suite.prompts[:1], 8, temperature, 0)
    tallies = run_interleaved(runners, suite.prompts, blocks, max_new_tokens, seed=0)
    results = {
        name: {
            "tokens_per_s": t.tokens / t.seconds,
            "mean_accept_length": t.tokens / t.decode_forwards,
            "tokens": t.tokens,
            "seconds": t.seconds,
        }
        for (_, name, _), t in tallies.items()
    }
    best = max((n for n in results if n != "auto"), key=lambda n: results[n]["tokens_per_s"])
    return {
        "drafter": drafter,
        "temperature": temperature,
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "config": {"prompts": len(suite.prompts), "blocks": blocks, "max_new_tokens": max_new_tokens},
        "settings": results,
        "auto_policy_at_end": asdict(auto.engine.tuner.current),
        "best_fixed": best,
        "auto_vs_best": results["auto"]["tokens_per_s"] / results[best]["tokens_per_s"],
    }
