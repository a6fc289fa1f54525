"""The shared bench harness: prompt sources, per-system tallies, interleaved runs, JSON out and charts.

Every benchmark compares systems side by side in one run on the same prompts: prompts are split
into blocks and every system runs each block in turn, the order rotating per block, so machine
drift lands on all systems alike.
"""

from __future__ import annotations

import json
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from eyas.assets import demo_model
from eyas.train.corpus import heldout_prompts
from eyas.engine import Engine
from eyas.tree import TreePolicy

EYAS_DRAFTERS = ("eagle1", "hass", "eagle3")
CODE_PROMPTS = [  # short code prompts, as text

    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "def read_lines(path):\n    with open(path) as f:",
    "    return sorted(items, key=lambda x:",
]



@dataclass
class Suite:
    """One target, its drafters and plain draft LM, and the prompts (token ids) every system decodes."""

    name: str
    target: Path
    drafters: dict[str, Path]
    draft_lm: Path | None
    prompts: list[list[int]]


def demo_suite(n_prompts: int) -> Suite:
    """The bundled demo models and held-out standard-library prompts."""
    target = demo_model("target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.encode(p.text) for p in heldout_prompts(tokenizer, n_prompts)]
    drafters = {k: demo_model(k) for k in EYAS_DRAFTERS}
    return Suite("demo", target, drafters, demo_model("draft-lm"), prompts)


def prompts_for(engine: Engine, count: int, length: int, seed: int, source: str | None) -> list[list[int]]:
    """`count` prompts of `length` tokens: windows spread over a text file, or random token ids."""
    if source is not None:
        ids = engine.tokenize(Path(source).read_text())
        step = max(1, (len(ids) - length) // count)
        return [ids[i * step : i * step + length] for i in range(count)]
    rng = random.Random(seed)
    return [[rng.randrange(3, engine.target.vocab_size) for _ in range(length)] for _ in range(count)]


def _cpuinfo() -> str:
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


def cpu_model() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else what the platform says."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def machine(engine: Engine) -> dict:
    """Where a run was timed: the processor (or GPU), its flags that move the choice of dtype, and the torch threads."""
    device = engine.target.runtime.device
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device), "platform": platform.platform()}
    info = _cpuinfo()
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    flags = set(fields.get("flags", "").split())
    return {
        "device": cpu_model(),
        "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
        "cores": len([line for line in info.splitlines() if line.startswith("processor")]),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


@dataclass
class Tally:
    """What a system did over the prompts it ran: tokens, wall seconds, target forwards, acceptance, phases."""

    tokens: int = 0
    seconds: float = 0.0
    prompts: int = 0
    target_forwards: int | None = 0
    decode_forwards: int | None = 0  # target forwards that committed tokens (rounds; all forwards for HF)
    accepted_histogram: list[int] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def add_histogram(self, histogram: list[int]) -> None:
        for k, count in enumerate(histogram):
            self.accepted_histogram += [0] * (k + 1 - len(self.accepted_histogram))
            self.accepted_histogram[k] += count

    def merge(self, other: "Tally") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.prompts += other.prompts
        for name in ("target_forwards", "decode_forwards"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, None if mine is None or theirs is None else mine + theirs)
        self.add_histogram(other.accepted_histogram)
        for phase, seconds in other.phases.items():
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self.extra.update(other.extra)


class EyasRunner:
    """The in-process engine with one drafter; `tree` fixes the policy of every call (None: the engine's own)."""

    def __init__(self, engine: Engine, tree: dict | None = None):
        self.engine, self.tree = engine, tree

    @classmethod
    def load(cls, target: Path, drafter: Path, dtype: str = "auto", draft_ahead: int = 0, tree: dict | str | None = None) -> "EyasRunner":
        """A fresh engine with `tree` (None: the drafter's stored tree, as `Engine.from_pretrained`)."""
        return cls(Engine.from_pretrained(target, drafter, tree=tree, dtype=dtype, draft_ahead=draft_ahead))

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Tally:
        tally = Tally()
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            gen = self.engine.generate(
                prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i, tree=self.tree, stop_at_eos=False
            )
            tally.seconds += time.perf_counter() - start
            stats = gen.stats
            tally.tokens += stats.tokens
            tally.prompts += 1
            tally.target_forwards += stats.target_forwards
            tally.decode_forwards += stats.rounds
            tally.add_histogram(stats.accepted_length_histogram)
            for phase, seconds in stats.seconds.items():
                tally.phases[phase] = tally.phases.get(phase, 0.0) + seconds
        if self.tree is None:
            tally.extra["tree_policy"] = asdict(self.engine.tuner.current if self.engine.tree == "auto" else self.engine.tree)
        tally.extra["draft_dtype"] = str(self.engine.drafter.dtype).removeprefix("torch.")
        return tally


def run_interleaved(
    runners: dict[tuple[str, str, float], Callable], prompts: list[list[int]], blocks: int, max_new_tokens: int, seed: int
) -> dict[tuple[str, str, float], Tally]:
    """Each block of prompts goes through every system in turn, the order rotating from block to block.

    Each step says on stderr what runs, how long the run took so far and, from the block before, about how long
    is left (a system's own time in the previous block estimates its time in the next).
    """
    keys = list(runners)
    tallies = {key: Tally() for key in keys}
    size = -(-len(prompts) // blocks)
    blocks_run = [prompts[b * size : (b + 1) * size] for b in range(blocks) if prompts[b * size : (b + 1) * size]]
    last: dict[tuple[str, str, float], float] = {}  # each system's seconds in its latest block
    began = time.perf_counter()
    for b, block in enumerate(blocks_run):
        rotation = keys[b % len(keys) :] + keys[: b % len(keys)]
        for i, key in enumerate(rotation):
            elapsed = time.perf_counter() - began
            left = ""
            if len(last) == len(keys):
                remaining = sum(last[k] for k in rotation[i:]) + (len(blocks_run) - b - 1) * sum(last.values())
                left = f", about {_duration(remaining)} left"
            print(
                f"eyas bench: block {b + 1}/{len(blocks_run)}: {key[0]} {key[1]} t={key[2]} ({_duration(elapsed)} so far{left})",
                file=sys.stderr,
                flush=True,
            )
            start = time.perf_counter()
            tallies[key].merge(runners[key](block, max_new_tokens, key[2], seed))
            last[key] = time.perf_counter() - start
    print(f"eyas bench: {len(blocks_run)} blocks in {_duration(time.perf_counter() - began)}", file=sys.stderr, flush=True)
    return tallies


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def write_charts(result: dict, out_dir: Path) -> list[Path]:
    """Bar charts of tokens/s, speedup and acceptance length, and accepted length by depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for t in sorted({e["temperature"] for e in result["systems"]}):
        entries = [e for e in result["systems"] if e["temperature"] == t]
        labels = [f"{e['system']}\n{e['drafter']}" for e in entries]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for ax, key, title in zip(axes, ("tokens_per_s", "speedup_vs_hf", "mean_accept_length"), ("tokens/s", "speedup vs HF at that temperature", "acceptance length")):
            ax.bar(labels, [e.get(key) or 0 for e in entries])
            ax.set_title(f"{title} (temperature {t})")
            ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        path = out_dir / f"bench-t{t}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for e in result["systems"]:
        hist = e["accepted_length_by_depth"]
        if e["temperature"] == 0 and hist and sum(hist):
            total = sum(hist)
            reach = [sum(hist[d:]) / total for d in range(len(hist))]
            ax.plot(range(len(reach)), reach, marker="o", label=f"{e['system']} {e['drafter']}")
    ax.set(title="rounds accepting at least d drafts (greedy)", xlabel="d", ylabel="share of rounds")
    ax.legend(fontsize=7)
    path = out_dir / "bench-depth.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return written + [path]


def tree_record(policy: TreePolicy | str) -> dict | str:
    """A service's tree as a record names it: "auto", or the fixed policy's knobs."""
    return policy if policy == "auto" else asdict(policy)


def write_json(record: dict, path: str | Path | None) -> None:
    """The benchmark's one JSON record, to `path`, or to stdout when None (progress lines go to stderr)."""
    text = json.dumps(record, indent=2)
    if path is None:
        print(text)
    else:
        Path(path).write_text(text)
