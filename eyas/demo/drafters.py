"""Train the demo drafters (EAGLE-1, HASS, EAGLE-3) against the demo target and write the report."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from ..drafters.checkpoint import WEIGHTS_FILE
from ..manifest import MANIFEST_FILE
from ..train.recipe import Recipe
from ..train.trainer import LOG_FILE, Trainer
from .build import DRAFT_LM_STEPS, TARGET_STEPS, build_base_models
from .report import measure, write_report

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "train"


def publish_drafter(checkpoint: Path, destination: Path) -> None:
    """Copy a trained drafter (config, bf16 weights, manifest) into the bundled models; the engine loads fp32."""
    from safetensors.torch import load_file, save_file

    destination.mkdir(parents=True, exist_ok=True)
    shutil.copy(checkpoint / "config.json", destination / "config.json")
    shutil.copy(checkpoint / MANIFEST_FILE, destination / MANIFEST_FILE)
    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(str(checkpoint / WEIGHTS_FILE)).items()}
    save_file(weights, str(destination / WEIGHTS_FILE), metadata={"format": "pt"})


def training_summary(output: Path, minutes: float) -> str:
    last_eval, steps = {}, 0
    for line in (output / LOG_FILE).read_text().splitlines():
        record = json.loads(line)
        steps = max(steps, record.get("step", 0))
        if record.get("eval"):
            last_eval = record["eval"]
    top1 = {k: round(v, 3) for k, v in last_eval.items() if k.startswith("top1/")}
    return f"{steps} steps, {minutes:.1f} minutes; held-out top-1 agreement by rollout step {top1}"


def build_demo(
    out_root: str | Path = "models/demo",
    work_dir: str | Path = "runs/demo",
    base: bool = True,
    target_steps: int | None = None,
    draft_lm_steps: int | None = None,
    drafter_steps: int | None = None,
    kinds: tuple[str, ...] = ("eagle1", "hass", "eagle3"),
    prompts: int = 50,
    max_new_tokens: int = 64,
) -> Path:
    """Base models (unless reused), each drafter from configs/train/<kind>.yaml, then REPORT.md."""
    out_root, work_dir = Path(out_root), Path(work_dir)
    if base:
        build_base_models(out_root, target_steps or TARGET_STEPS, draft_lm_steps or DRAFT_LM_STEPS)
    training = {}
    for kind in kinds:
        recipe = Recipe.from_yaml(
            RECIPES / f"{kind}.yaml",
            target=str(out_root / "target"),
            output=str(work_dir / kind),
            max_steps=drafter_steps,
        )
        features = recipe.features
        if features != "online":
            recipe.features = str(work_dir / Path(features).name)
        if Path(recipe.output).exists():
            shutil.rmtree(recipe.output)
        started = time.perf_counter()
        final = Trainer(recipe).fit()
        minutes = (time.perf_counter() - started) / 60
        publish_drafter(final, out_root / kind)
        training[kind] = training_summary(Path(recipe.output), minutes)
    previous = out_root / "report.json"
    if previous.exists():
        training = {**json.loads(previous.read_text())["training"], **training}
    present = tuple(k for k in ("eagle1", "hass", "eagle3") if (out_root / k / "config.json").exists())
    results = measure(out_root, present, prompts, max_new_tokens)
    return write_report(out_root, results, prompts, max_new_tokens, training)
