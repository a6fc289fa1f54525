"""Training recipes: one YAML file per run, every key known, every default stated here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

KINDS = ("eagle1", "hass", "eagle3")


class RecipeError(ValueError):
    """A recipe is malformed (unknown key, bad value); raised before any training step."""


@dataclass
class Regeneration:
    """How the target rewrites the training windows (eyas/train/regenerate.py); all but `batch` key the cache."""

    prompt_tokens: int = 32  # each window's first tokens, kept as its unsupervised prompt
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])  # window i decodes at [i % len]
    windows: int | None = None  # regenerate this many windows, evenly spread over the data (null: every window)
    batch: int = 64  # windows decoded together

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "batch", "windows"):
            value = getattr(self, name)
            if (value is not None or name != "windows") and (not isinstance(value, int) or value < 1):
                raise RecipeError(f"regenerate.{name}: must be a positive integer, got {value!r}")
        temps = self.temperatures
        if not isinstance(temps, list) or not temps or any(not isinstance(t, (int, float)) or t < 0 for t in temps):
            raise RecipeError(f"regenerate.temperatures: a non-empty list of temperatures >= 0, got {temps!r}")


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
    regenerate: bool | dict = False  # train on the target's continuations of the windows (true, or Regeneration keys)
    regenerate_cache: str | None = None  # where regenerated windows are kept (null: regenerated/ beside output)

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
        if not isinstance(self.regenerate, (bool, dict)):
            keys = [f.name for f in fields(Regeneration)]
            raise RecipeError(f"regenerate: true, false or a mapping of {keys}, got {self.regenerate!r}")
        settings = self.regeneration()
        if settings and settings.prompt_tokens >= self.seq_len:
            raise RecipeError(f"regenerate.prompt_tokens ({settings.prompt_tokens}) must be below seq_len ({self.seq_len})")
        if self.recipe != "eagle3" and (self.draft_vocab_size is not None or self.feature_layers is not None):
            raise RecipeError("draft_vocab_size and feature_layers apply to eagle3 recipes only")

    def regeneration(self) -> Regeneration | None:
        """The regeneration settings, or None when the drafter trains on the data as written."""
        if self.regenerate is False:
            return None
        settings = {} if self.regenerate is True else self.regenerate
        known = [f.name for f in fields(Regeneration)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise RecipeError(f"unknown regenerate key {unknown[0]!r} (known: {', '.join(known)})")
        return Regeneration(**settings)

    def regeneration_cache(self) -> Path:
        return Path(self.regenerate_cache) if self.regenerate_cache else Path(self.output).parent / "regenerated"

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
