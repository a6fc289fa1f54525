"""`eyas bench trace`: what tracing costs per round, in process.

Runs every prompt with tracing off and on, back to back in alternating order, and reports seconds
per round of both (process CPU time, which other processes on a busy machine disturb far less than
wall time; wall time too), the overhead (median over repeats of on/off, minus one), and the
recorder's own cost per round (encoding the round's messages and record, writing and flushing it),
timed directly on the recorded rounds. In the service the coordinator cuts the messages out of
bytes it already holds, so the in-process figure bounds its cost.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eyas.assets import DEFAULT_DRAFTER, demo_model
from eyas.engine import Engine
from eyas.trace.record import RequestRecorder
from eyas.trace.store import TraceWriter
from eyas.tree import TreePolicy

from .harness import CODE_PROMPTS

def trace_overhead(engine: Engine, prompts: list[str], max_new_tokens: int = 64, repeats: int = 5) -> dict:
    """Seconds per round with tracing off and on (CPU and wall), the overheads, and the recorder's direct cost."""
    clocks = {"cpu": time.process_time, "wall": time.perf_counter}
    with tempfile.TemporaryDirectory() as tmp:
        writer = TraceWriter(Path(tmp) / "bench.trace")
        engine.generate(prompts[0], max_new_tokens=8, trace=writer)  # warm up both paths
        engine.generate(prompts[0], max_new_tokens=8)
        per_round = {(clock, traced): [] for clock in clocks for traced in (False, True)}
        records = []
        for repeat in range(repeats):
            spent = dict.fromkeys(per_round, 0.0)
            rounds = dict.fromkeys((False, True), 0)
            for i, prompt in enumerate(prompts):
                for traced in (False, True) if (repeat + i) % 2 == 0 else (True, False):
                    started = {clock: read() for clock, read in clocks.items()}
                    gen = engine.generate(
                        prompt, max_new_tokens=max_new_tokens, trace=writer if traced else None, on_round=records.append
                    )
                    for clock, read in clocks.items():
                        spent[clock, traced] += read() - started[clock]
                    rounds[traced] += gen.stats.rounds
            for clock, traced in per_round:
                per_round[clock, traced].append(spent[clock, traced] / rounds[traced])
        request = engine.new_request(prompts[0])
        recorder = RequestRecorder(writer.write, request, engine.tree, engine.manifest.id, engine.manifest.to_dict(), "local")
        started = time.perf_counter()
        for record in records:
            recorder.local_round(record)
        direct = (time.perf_counter() - started) / len(records)
        writer.close()
    result: dict = {"rounds": len(records)}
    for clock in clocks:
        off, on = per_round[clock, False], per_round[clock, True]
        result[f"{clock}_seconds_per_round_off"] = statistics.median(off)
        result[f"{clock}_seconds_per_round_on"] = statistics.median(on)
        result[f"{clock}_overhead"] = statistics.median(b / a for a, b in zip(off, on)) - 1.0
        result[f"{clock}_overhead_per_repeat"] = [b / a - 1.0 for a, b in zip(off, on)]
    result["recorder_seconds_per_round"] = direct
    result["recorder_share"] = direct / result["cpu_seconds_per_round_off"]
    return result


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark for the options of `eyas bench trace`; returns its JSON record."""
    torch.set_num_threads(args.threads)
    target = args.target or demo_model("target")
    drafter = args.drafter or demo_model(DEFAULT_DRAFTER)
    engine = Engine.from_pretrained(target, drafter, tree=TreePolicy())  # one fixed tree: traced and untraced rounds alike
    result = trace_overhead(engine, CODE_PROMPTS, args.max_new_tokens, args.repeats)
    result.update(
        target=str(target),
        drafter=str(drafter),
        tree=vars(engine.tree),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        threads=args.threads,
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
    )
    return result
