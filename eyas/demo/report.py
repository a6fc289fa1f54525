"""Acceptance of the demo drafters on held-out prompts, written to models/demo/REPORT.md."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from ..engine import Engine
from .corpus import heldout_prompts

TREES = {
    "tree (width 8, depth 5, budget 32)": {"width": 8, "depth": 5, "budget": 32},
    "tree (width 4, depth 4, budget 16)": {"width": 4, "depth": 4, "budget": 16},
    "chain (width 1, depth 5)": {"width": 1, "depth": 5, "budget": 5},
}
REGENERATE = "eyas demo build --skip-base   # or: python -m eyas.demo.report --root models/demo"


def acceptance(engine: Engine, prompts: list[str], tree: dict, max_new_tokens: int) -> dict:
    """Greedy generation over `prompts`: tokens committed per verification forward, pooled over all rounds."""
    tokens = rounds = 0
    histogram: list[int] = []
    for prompt in prompts:
        stats = engine.generate(prompt, max_new_tokens=max_new_tokens, tree=tree, stop_at_eos=False).stats
        tokens += stats.tokens
        rounds += stats.rounds
        for k, count in enumerate(stats.accepted_length_histogram):
            histogram += [0] * (k + 1 - len(histogram))
            histogram[k] += count
    return {"mean_accept_length": tokens / rounds, "tokens": tokens, "rounds": rounds, "histogram": histogram}


def measure(root: str | Path, kinds: tuple[str, ...], n_prompts: int = 50, max_new_tokens: int = 64) -> dict:
    """Mean acceptance length of each drafter under each tree setting, on the same held-out prompts."""
    root = Path(root)
    results: dict = {}
    for kind in kinds:
        engine = Engine.from_pretrained(root / "target", root / kind)
        prompts = [p.text for p in heldout_prompts(engine.target.tokenizer, n_prompts)]
        results[kind] = {name: acceptance(engine, prompts, tree, max_new_tokens) for name, tree in TREES.items()}
    return results


def write_report(root: str | Path, results: dict, n_prompts: int, max_new_tokens: int, training: dict) -> Path:
    """REPORT.md: target perplexity, acceptance table, and how every number is regenerated."""
    root = Path(root)
    target = json.loads((root / "target" / "train_report.json").read_text())
    draft_lm = json.loads((root / "draft-lm" / "train_report.json").read_text())
    lines = [
        "# Bundled demo models",
        "",
        f"Measured on {platform.machine()} with {platform.python_version()}, CPU only.",
        "",
        "## Target",
        "",
        f"- Llama-family target, {target['params'] / 1e6:.1f}M parameters, trained {target['minutes']:.0f} minutes "
        f"on {target['tokens_seen'] / 1e6:.2f}M tokens of the Python standard library's source.",
        f"- Held-out perplexity: **{target['heldout_ppl']:.2f}** (loss {target['heldout_loss']:.3f} nats/token) on "
        f"{len(target['heldout_modules'])} held-out modules, after rounding the weights to bfloat16.",
        f"- Plain draft LM (`draft-lm/`): {draft_lm['params'] / 1e6:.1f}M parameters, held-out perplexity "
        f"{draft_lm['heldout_ppl']:.2f}.",
        "",
        "## Drafters: mean acceptance length",
        "",
        f"Greedy decoding of {max_new_tokens} new tokens from each of {n_prompts} held-out prompts (function headers "
        "with docstrings from the held-out modules). Mean acceptance length = tokens committed per target "
        "verification forward (accepted draft tokens + 1), pooled over all rounds.",
        "",
        "| drafter | " + " | ".join(TREES) + " |",
        "| --- | " + " | ".join("---" for _ in TREES) + " |",
    ]
    for kind, by_tree in results.items():
        lines.append(f"| {kind} | " + " | ".join(f"{by_tree[name]['mean_accept_length']:.2f}" for name in TREES) + " |")
    lines += ["", "## Drafter training", ""]
    for kind, summary in training.items():
        lines.append(f"- {kind}: {summary}")
    lines += ["", "## Regenerate", "", "```bash", REGENERATE, "```", ""]
    path = root / "REPORT.md"
    path.write_text("\n".join(lines))
    (root / "report.json").write_text(json.dumps({"results": results, "training": training}, indent=2))
    return path


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m eyas.demo.report", description=__doc__)
    parser.add_argument("--root", default="models/demo")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    kinds = tuple(k for k in ("eagle1", "hass", "eagle3") if (Path(args.root) / k).exists())
    results = measure(args.root, kinds, args.prompts, args.max_new_tokens)
    previous = Path(args.root) / "report.json"
    training = json.loads(previous.read_text())["training"] if previous.exists() else {}
    print(write_report(args.root, results, args.prompts, args.max_new_tokens, training).read_text())


if __name__ == "__main__":
    main()
