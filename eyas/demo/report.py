"""Acceptance of the demo drafters on held-out prompts, written to models/demo/REPORT.md with the training curves."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..assets import DEFAULT_DRAFTER
from ..engine import Engine
from ..train.corpus import heldout_prompts
from ..train.plots import plot_lm_curves

TREES = {
    "tree (width 8, depth 5, budget 32)": {"width": 8, "depth": 5, "budget": 32},
    "tree (width 4, depth 4, budget 16)": {"width": 4, "depth": 4, "budget": 16},
    "chain (depth 5)": {"width": 1, "depth": 5, "budget": 5},
    "chain (depth 8)": {"width": 1, "depth": 8, "budget": 8},
}
SAMPLED_TREES = ("tree (width 8, depth 5, budget 32)", "chain (depth 5)")
TEMPERATURES = (0.7, 1.0)
SPEED_DRAFTER = DEFAULT_DRAFTER  # timed against plain Hugging Face generate at greedy and each of TEMPERATURES
# drafter directory -> the target directory it drafts for
DRAFTER_TARGETS = {"eagle1": "target", "hass": "target", "eagle3": "target", "moe-eagle3": "moe"}
BASE_MODELS = ("target", "draft-lm", "moe")
REGENERATE = "eyas demo build            # every stage (resumes); --only moe for the MoE target and its drafter"


def acceptance(engine: Engine, prompts: list[str], tree: dict, max_new_tokens: int, temperature: float = 0.0) -> dict:
    """Tokens committed per verification forward over `prompts`, pooled over all rounds (seed i for prompt i)."""
    tokens = rounds = 0
    histogram: list[int] = []
    for i, prompt in enumerate(prompts):
        stats = engine.generate(prompt, max_new_tokens=max_new_tokens, tree=tree, stop_at_eos=False,
                                temperature=temperature, seed=i).stats
        tokens += stats.tokens
        rounds += stats.rounds
        for k, count in enumerate(stats.accepted_length_histogram):
            histogram += [0] * (k + 1 - len(histogram))
            histogram[k] += count
    return {"mean_accept_length": tokens / rounds, "tokens": tokens, "rounds": rounds, "histogram": histogram}


@torch.no_grad()
def speed(root: Path, kind: str, prompts: list[str], max_new_tokens: int) -> dict:
    """Tokens/s of eyas in process (this drafter, tree auto, one engine per temperature) against plain
    Hugging Face `generate` on the same prompt ids, prompt by prompt in turn, both in float32 on the CPU."""
    target = root / DRAFTER_TARGETS[kind]
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = {}
    for t in (0.0, *TEMPERATURES):
        engine = Engine.from_pretrained(target, root / kind, tree="auto")
        ids = [engine.target.tokenizer.encode(p) for p in prompts]
        sample = {"do_sample": True, "temperature": t, "top_k": 0, "top_p": 1.0} if t else {"do_sample": False}
        seconds = {"eyas": 0.0, "hf": 0.0}
        tokens = {"eyas": 0, "hf": 0}
        for i, prompt in enumerate([ids[0], *ids]):  # the first is a warm-up, not counted
            started = time.perf_counter()
            made = len(engine.generate(prompt, max_new_tokens, temperature=t, seed=i, stop_at_eos=False).token_ids)
            eyas_seconds = time.perf_counter() - started
            torch.manual_seed(i)
            x = torch.tensor([prompt])
            started = time.perf_counter()
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                            eos_token_id=None, pad_token_id=hf.generation_config.pad_token_id, **sample)
            hf_seconds = time.perf_counter() - started
            if i:
                seconds["eyas"] += eyas_seconds
                seconds["hf"] += hf_seconds
                tokens["eyas"] += made
                tokens["hf"] += y.shape[1] - x.shape[1]
        rates = {k: tokens[k] / seconds[k] for k in seconds}
        out[f"T={t}"] = {"eyas_tokens_per_s": rates["eyas"], "hf_tokens_per_s": rates["hf"],
                         "speedup": rates["eyas"] / rates["hf"], "tokens": tokens}
    return out


def measure(root: str | Path, n_prompts: int = 50, max_new_tokens: int = 64) -> dict:
    """For every bundled drafter: greedy acceptance under each tree, sampled acceptance at TEMPERATURES."""
    root = Path(root)
    results: dict = {}
    for kind, target in DRAFTER_TARGETS.items():
        if not (root / kind / "config.json").exists():
            continue
        engine = Engine.from_pretrained(root / target, root / kind)
        prompts = [p.text for p in heldout_prompts(engine.target.tokenizer, n_prompts)]
        results[kind] = {"greedy": {name: acceptance(engine, prompts, tree, max_new_tokens) for name, tree in TREES.items()}}
        for t in TEMPERATURES:
            results[kind][f"T={t}"] = {name: acceptance(engine, prompts, TREES[name], max_new_tokens, t)
                                       for name in SAMPLED_TREES}
        if kind == SPEED_DRAFTER:
            results[kind]["speed"] = speed(root, kind, prompts, max_new_tokens)
    return results


def _table(results: dict, mode: str, trees: list[str]) -> list[str]:
    lines = ["| drafter | " + " | ".join(trees) + " |", "| --- | " + " | ".join("---" for _ in trees) + " |"]
    for kind, by_mode in results.items():
        lines.append(f"| {kind} | " + " | ".join(f"{by_mode[mode][name]['mean_accept_length']:.2f}" for name in trees) + " |")
    return lines


def _base_line(name: str, report: dict) -> str:
    return (f"- `{name}/`: {report.get('architecture', 'LlamaForCausalLM')}, {report['params'] / 1e6:.1f}M parameters, "
            f"{report['steps']} steps ({report['epochs']:.2f} epochs of {report['train_tokens'] / 1e6:.2f}M tokens) in "
            f"{report['minutes']:.0f} minutes; held-out perplexity **{report['heldout_ppl']:.2f}** "
            f"(loss {report['heldout_loss']:.3f} nats/token, bfloat16 weights).")


def write_report(root: str | Path, results: dict, n_prompts: int, max_new_tokens: int, training: dict) -> Path:
    """REPORT.md: base-model perplexity and curves, acceptance tables, drafter training, how to regenerate."""
    root = Path(root)
    bases = {n: json.loads((root / n / "train_report.json").read_text())
             for n in BASE_MODELS if (root / n / "train_report.json").exists()}
    (root / "curves").mkdir(exist_ok=True)
    plot_lm_curves(bases, root / "curves" / "base-models.png")
    heldout = len(next(iter(bases.values()))["heldout_modules"]) if bases else 0
    lines = [
        "# Bundled demo models",
        "",
        f"Measured on {platform.machine()} with Python {platform.python_version()}, CPU only. Every model is trained "
        "from scratch on the Python standard library's source; perplexity and acceptance are measured on "
        f"{heldout} held-out modules that no model trains on.",
        "",
        "## Base models",
        "",
        *[_base_line(n, r) for n, r in bases.items()],
        "",
        "![base-model loss curves](curves/base-models.png)",
        "",
        "## Drafters: mean acceptance length",
        "",
        f"Decoding {max_new_tokens} new tokens from each of {n_prompts} held-out prompts (function headers with "
        "docstrings from the held-out modules). Mean acceptance length = tokens committed per target verification "
        "forward (accepted draft tokens + 1), pooled over all rounds. `moe-eagle3` drafts for the MoE target.",
        "",
        "Greedy:",
        "",
        *_table(results, "greedy", list(TREES)),
    ]
    for t in TEMPERATURES:
        lines += ["", f"Sampled at temperature {t} (seed i for prompt i):", "", *_table(results, f"T={t}", list(SAMPLED_TREES))]
    timed = {k: r["speed"] for k, r in results.items() if "speed" in r}
    for kind, by_t in timed.items():
        lines += ["", f"## Speed: eyas in process ({kind}, tree auto) against plain Hugging Face `generate`", "",
                  "Float32 on the CPU, the same prompts and token ids, the two systems alternating prompt by prompt "
                  "(a warm-up prompt first, not counted).", "",
                  "| temperature | eyas tok/s | Hugging Face tok/s | speedup |", "| --- | ---: | ---: | ---: |"]
        for t, r in by_t.items():
            lines.append(f"| {t.removeprefix('T=')} | {r['eyas_tokens_per_s']:.1f} | {r['hf_tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f}x |")
    lines += ["", "## Drafter training", ""]
    for kind, summary in training.items():
        lines.append(f"- {kind}: {summary}")
        if (root / "curves" / f"{kind}.png").exists():
            lines += ["", f"  ![{kind} training](curves/{kind}.png)", ""]
    lines += ["", "## Regenerate", "", "```bash", REGENERATE, "```", ""]
    path = root / "REPORT.md"
    path.write_text("\n".join(lines))
    (root / "report.json").write_text(json.dumps({"results": results, "training": training}, indent=2) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.demo.report", description=__doc__)
    parser.add_argument("--root", default="models/demo")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--speed-only", action="store_true",
                        help="time the speed section again and keep the acceptance tables of report.json")
    args = parser.parse_args()
    previous = Path(args.root) / "report.json"
    stored = json.loads(previous.read_text()) if previous.exists() else {}
    if args.speed_only:
        if not stored:
            parser.error(f"--speed-only: {previous} does not exist (run the whole report first)")
        results = stored["results"]
        tokenizer = AutoTokenizer.from_pretrained(Path(args.root) / DRAFTER_TARGETS[SPEED_DRAFTER])
        prompts = [p.text for p in heldout_prompts(tokenizer, args.prompts)]
        results[SPEED_DRAFTER]["speed"] = speed(Path(args.root), SPEED_DRAFTER, prompts, args.max_new_tokens)
    else:
        results = measure(args.root, args.prompts, args.max_new_tokens)
    training = stored["training"] if stored else {}
    print(write_report(args.root, results, args.prompts, args.max_new_tokens, training).read_text())


if __name__ == "__main__":
    main()
