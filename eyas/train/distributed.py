"""Data-parallel drafter training with Ray Train: N workers (gloo on CPU) share each global batch."""

from __future__ import annotations

from pathlib import Path

from .recipe import Recipe


def _worker_loop(config: dict) -> None:
    """Runs in every Ray Train worker: the same Trainer, with torch.distributed as its communicator."""
    import torch

    from .trainer import TorchComm, Trainer

    torch.set_num_threads(config["threads"])
    trainer = Trainer(Recipe.from_dict(config["recipe"]), TorchComm(), resume_from=config["resume_from"])
    trainer.fit(progress=config["progress"])


def fit_distributed(recipe: Recipe, resume_from: str | Path | None = None, progress: bool = True) -> Path:
    """Train `recipe` on `recipe.workers` Ray Train workers; returns the final checkpoint directory."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if recipe.regeneration():  # the workers read the windows the driver regenerates, wherever they run
        recipe = Recipe.from_dict({**recipe.to_dict(), "regenerate_cache": str(recipe.regeneration_cache().resolve())})
    if recipe.regeneration() or (recipe.features != "online" and not (Path(recipe.features) / "cache.json").exists()):
        from .trainer import Trainer

        Trainer(recipe.__class__(**{**recipe.to_dict(), "workers": 1}))  # builds the shared caches once, up front
    output = Path(recipe.output).resolve()
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={
            "recipe": recipe.to_dict(),
            "resume_from": str(resume_from) if resume_from else None,
            "threads": 1,
            "progress": progress,
        },
        scaling_config=ScalingConfig(num_workers=recipe.workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(output / "ray"), name="train"),
    )
    trainer.fit()
    return output / "final"
