"""Training recipes: one YAML file per run, every key known, every default stated here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

KINDS = ("eagle1", "hass", "eagle3")


class RecipeError(ValueError):
    """A recipe is malformed (unknown key, bad value); raised before any training step."""


@dataclass
class Recipe:
    recipe: str
    target: str
    data: list[str]
    output: str
    eval_data: list[str] = field(default_factory=list)
    seq_len: int = 256
    batch_size: int = 8
    max_steps: int = 1000
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 0.5
    seed: int = 0
    objective: dict = field(default_factory=dict)
    drafter: dict = field(default_factory=dict)
    draft_vocab_size: int | None = None
    feature_layers: list[int] | None = None
    features: str = "online"
    bf16: bool = False  # bfloat16 autocast for the teacher and drafter forwards; weights, softmax and losses stay fp32
    eval_every: int = 200
    eval_batches: int = 8
    save_every: int = 500
    log_every: int = 10
    workers: int = 1

    def __post_init__(self) -> None:
        if self.recipe not in KINDS:
            raise RecipeError(f"recipe: must be one of {KINDS}, got {self.recipe!r}")
        if not self.data:
            raise RecipeError("data: at least one data source is needed")
        for name in ("seq_len", "batch_size", "max_steps", "eval_every", "save_every", "log_every", "workers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise RecipeError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.batch_size % self.workers:
            raise RecipeError(f"batch_size {self.batch_size} must divide evenly among {self.workers} workers")
        if len(self.betas) != 2:
            raise RecipeError(f"betas: two values expected, got {self.betas!r}")
        if self.recipe != "eagle3" and (self.draft_vocab_size is not None or self.feature_layers is not None):
            raise RecipeError("draft_vocab_size and feature_layers apply to eagle3 recipes only")

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecipeError(f"unknown recipe key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        missing = [m for m in ("recipe", "target", "data", "output") if m not in data]
        if missing:
            raise RecipeError(f"missing recipe key {missing[0]!r}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "Recipe":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: a recipe is a YAML mapping")
        return cls.from_dict({**data, **{k: v for k, v in overrides.items() if v is not None}})

    def to_dict(self) -> dict:
        return asdict(self)
