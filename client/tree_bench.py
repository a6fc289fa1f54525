"""`python -m eyas.client.tree_bench`: `tree: auto` against a grid of fixed trees, on the same prompts, in one run.

One engine decodes every prompt block with each fixed policy and with `auto` in turn (the order
rotating per block, so machine drift lands on all alike). The tuner's one-time cost measurement
happens in the warm-up; its exploration rounds count, as they do in service. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict

import torch

from eyas.tree import TreePolicy

GRID = (
    TreePolicy(1, 3, 3), TreePolicy(1, 5, 5), TreePolicy(1, 7, 7),
    TreePolicy(2, 4, 8), TreePolicy(2, 6, 12), TreePolicy(4, 4, 16), TreePolicy(4, 6, 24),
    TreePolicy(8, 5, 32), TreePolicy(8, 6, 48), TreePolicy(8, 8, 64), TreePolicy(3, 6, 16), TreePolicy(6, 7, 40),
)


def run(drafter: str, n_prompts: int, blocks: int, max_new_tokens: int, temperature: float) -> dict:
    """Tokens/s and acceptance of every grid policy and of `auto`; `auto_vs_best` is auto's tokens/s over the best policy's."""
    from eyas import Engine
    from eyas.assets import demo_model
    from eyas.demo.corpus import heldout_prompts

    engine = Engine.from_pretrained(demo_model("target"), demo_model(drafter), tree="auto")
    prompts = [engine.target.tokenizer.encode(p.text) for p in heldout_prompts(engine.target.tokenizer, n_prompts)]
    settings: dict[str, TreePolicy | None] = {"auto": None, **{f"{p.top_k}/{p.depth}/{p.budget}": p for p in GRID}}
    totals = {name: {"tokens": 0, "rounds": 0, "seconds": 0.0} for name in settings}

    def decode(name: str, block: list[list[int]], first_seed: int) -> None:
        tree = None if settings[name] is None else asdict(settings[name])
        for i, prompt in enumerate(block):
            start = time.perf_counter()
            stats = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=first_seed + i, tree=tree, stop_at_eos=False).stats
            totals[name]["seconds"] += time.perf_counter() - start
            totals[name]["tokens"] += stats.tokens
            totals[name]["rounds"] += stats.rounds

    for name in settings:  # warm-up, untimed: the tuner measures this machine's costs here
        tree = None if settings[name] is None else asdict(settings[name])
        engine.generate(prompts[0], max_new_tokens=8, tree=tree, stop_at_eos=False)
    names, size = list(settings), -(-len(prompts) // blocks)
    for b in range(blocks):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            decode(name, prompts[b * size : (b + 1) * size], b * size)
    results = {
        name: {
            "tokens_per_s": t["tokens"] / t["seconds"],
            "mean_accept_length": t["tokens"] / t["rounds"],
            "tokens": t["tokens"],
            "seconds": t["seconds"],
        }
        for name, t in totals.items()
    }
    best = max((n for n in names if n != "auto"), key=lambda n: results[n]["tokens_per_s"])
    return {
        "drafter": drafter,
        "temperature": temperature,
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "config": {"prompts": len(prompts), "blocks": blocks, "max_new_tokens": max_new_tokens},
        "settings": results,
        "auto_policy_at_end": asdict(engine.tuner.current),
        "best_fixed": best,
        "auto_vs_best": results["auto"]["tokens_per_s"] / results[best]["tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tree: auto against a grid of fixed trees on the demo models (JSON on stdout)")
    parser.add_argument("--drafter", default="eagle3", choices=("eagle1", "hass", "eagle3"))
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, for stable timings)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(run(args.drafter, args.prompts, args.blocks, args.max_new_tokens, args.temperature), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
