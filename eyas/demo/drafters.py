"""`eyas demo build`: every demo model from its recipe, stage by stage, resumable; then the report.

Stages: the dense target and the plain draft LM (eyas.demo.build), the EAGLE-1, HASS and EAGLE-3 drafters
(configs/train/<name>.yaml), and on request the Mixtral-style MoE target with its EAGLE-3 drafter. Each stage
checkpoints under the work directory; a rerun skips finished stages and resumes an interrupted one.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..drafters.checkpoint import WEIGHTS_FILE
from ..manifest import MANIFEST_FILE
from ..train.recipe import Recipe
from ..train.trainer import LOG_FILE, STATE_FILE, Trainer
from .build import build_base_model
from ..train.corpus import collect
from .report import measure, write_report

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "train"
DRAFTERS = ("eagle1", "hass", "eagle3")
# name -> (kind of stage, what it trains against)
STAGES = {
    "target": ("base", None), "draft-lm": ("base", None),
    "eagle1": ("drafter", "target"), "hass": ("drafter", "target"), "eagle3": ("drafter", "target"),
    "moe": ("base", None), "moe-eagle3": ("drafter", "moe"),
}
DEFAULT_STAGES = ("target", "draft-lm", *DRAFTERS)
SAVE_EVERY = 100  # drafter checkpoint interval: an interrupted build loses at most this many steps
MINUTES_FILE = "build_minutes.json"  # in a drafter's output: its training wall time, kept across resumptions


def publish_drafter(checkpoint: Path, destination: Path) -> None:
    """Copy a trained drafter (config, bf16 weights, manifest) into the bundled models; the engine loads fp32."""
    destination.mkdir(parents=True, exist_ok=True)
    shutil.copy(checkpoint / "config.json", destination / "config.json")
    shutil.copy(checkpoint / MANIFEST_FILE, destination / MANIFEST_FILE)
    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(str(checkpoint / WEIGHTS_FILE)).items()}
    save_file(weights, str(destination / WEIGHTS_FILE), metadata={"format": "pt"})


def training_summary(output: Path, minutes: float) -> str:
    last_eval, steps, cpu, run_cpu = {}, 0, 0.0, 0.0
    for line in (output / LOG_FILE).read_text().splitlines():
        record = json.loads(line)
        steps = max(steps, record.get("step", 0))
        if "cpu_s" in record:  # each run (a resumption starts one) counts its own processor time from zero
            cpu, run_cpu = (cpu + run_cpu, 0.0) if record["cpu_s"] < run_cpu else (cpu, record["cpu_s"])
        if record.get("eval"):
            last_eval = record["eval"]
    top1 = {k: round(v, 3) for k, v in last_eval.items() if k.startswith("top1/")}
    processor = f" ({(cpu + run_cpu) / 60:.1f} minutes of processor time)" if cpu + run_cpu else ""
    return f"{steps} steps, {minutes:.1f} minutes{processor}; held-out top-1 agreement by rollout step {top1}"


def latest_checkpoint(output: Path) -> Path | None:
    """The newest checkpoint-N directory a trainer left in output, if any."""
    found = [(int(m.group(1)), p) for p in output.glob("checkpoint-*")
             if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and (p / STATE_FILE).exists()]
    return max(found)[1] if found else None


def train_drafter(name: str, against: str, out_root: Path, work_dir: Path, steps: int | None) -> str:
    """Train (or resume, or skip if finished) configs/train/<name>.yaml against out_root/against; publish to out_root/name."""
    recipe = Recipe.from_yaml(RECIPES / f"{name}.yaml", target=str(out_root / against), output=str(work_dir / name),
                              max_steps=steps, save_every=SAVE_EVERY)
    output = Path(recipe.output)
    final = output / "final"
    if not (final / STATE_FILE).exists():
        started = time.perf_counter()
        Trainer(recipe, resume_from=latest_checkpoint(output)).fit()
        add_training_minutes(output, (time.perf_counter() - started) / 60)
    publish_drafter(final, out_root / name)
    if (output / "training.png").exists():
        (out_root / "curves").mkdir(exist_ok=True)
        shutil.copy(output / "training.png", out_root / "curves" / f"{name}.png")
    return training_summary(output, training_minutes(output))


def training_minutes(output: Path) -> float:
    """Wall minutes the training runs of a drafter output took, summed over resumptions (0 if unrecorded)."""
    path = output / MINUTES_FILE
    return json.loads(path.read_text())["minutes"] if path.exists() else 0.0


def add_training_minutes(output: Path, minutes: float) -> None:
    (output / MINUTES_FILE).write_text(json.dumps({"minutes": training_minutes(output) + minutes}) + "\n")


def build_demo(out_root: str | Path = "models/demo", work_dir: str | Path = "runs/demo",
               stages: tuple[str, ...] = DEFAULT_STAGES, drafter_steps: int | None = None, base_steps: int | None = None,
               prompts: int = 50, max_new_tokens: int = 64) -> Path:
    """Run the named stages in order (each resumable), then measure every bundled drafter and write REPORT.md."""
    out_root, work_dir = Path(out_root), Path(work_dir)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown demo stage {unknown[0]!r} (known: {', '.join(STAGES)})")
    previous = out_root / "report.json"
    training = json.loads(previous.read_text())["training"] if previous.exists() else {}
    corpus = collect()
    for i, name in enumerate(stages, 1):
        print(f"[demo build {i}/{len(stages)}] {name}", file=sys.stderr, flush=True)
        what, against = STAGES[name]
        if what == "base":
            build_base_model(name, out_root, work_dir, base_steps, corpus=corpus)
        else:
            training[name] = train_drafter(name, against, out_root, work_dir, drafter_steps)
    print(f"[demo build] measuring acceptance on {prompts} held-out prompts", file=sys.stderr, flush=True)
    results = measure(out_root, prompts, max_new_tokens)
    return write_report(out_root, results, prompts, max_new_tokens, training)
