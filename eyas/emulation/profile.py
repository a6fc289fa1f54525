"""Cost profiles of emulated accelerators: how long a forward takes, by rows, context and batch (docs/emulation.md).

A profile is a YAML file (bundled ones in configs/emulate/, named by their stem) with the cost of one target
forward and one drafter step, the features' width and dtype on the wire, and the synthetic law the timed models
follow (`eyas.emulation.law`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from ..assets import PROFILE_ROOT

WIRE_DTYPES = ("float32", "bfloat16", "float16")


class ProfileError(ValueError):
    """A cost profile is missing, unknown or malformed; the message names the key."""


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of one batched forward: `fixed_ms` up to `knee_rows` rows (reading the weights), `row_ms` per row past
    the knee (compute-bound), and `context_ms` per 1000 keys each batch entry reads (its KV)."""

    fixed_ms: float = 0.0
    knee_rows: int = 1
    row_ms: float = 0.0
    context_ms: float = 0.0

    def seconds(self, rows: int, keys: list[int]) -> float:
        """A forward of `rows` rows over batch entries reading `keys[b]` positions each."""
        ms = self.fixed_ms + self.row_ms * max(0, rows - self.knee_rows) + self.context_ms * sum(keys) / 1000
        return ms / 1000


@dataclass(frozen=True)
class Law:
    """The synthetic models' law: `vocab` tokens; a context is its last `context` tokens; the target ranks `ranked`
    tokens with logits falling by `sharpness` (x 0.5-1.5 by context) per rank; the drafter ranks the target's top
    token first with probability agree[0], second with agree[1], ... (else further down, odds halving per rank), with
    confidence `confident` or `unsure` (its logits' fall per rank) as it agrees or not."""

    vocab: int = 1024
    context: int = 4
    ranked: int = 32
    sharpness: float = 1.0
    agree: tuple[float, ...] = (0.78, 0.08, 0.04)
    confident: float = 2.0
    unsure: float = 0.7


@dataclass(frozen=True)
class Profile:
    """An emulated deployment: the target's and the drafter's forward costs, features on the wire, and the law."""

    name: str
    target: ForwardCost
    draft: ForwardCost
    feature_width: int = 2048
    feature_dtype: str = "bfloat16"
    max_positions: int = 4096
    law: Law = field(default_factory=Law)
    description: str = ""
    sources: str = ""

    def summary(self) -> dict:
        """What a printed emulated figure names: the profile, its costs and where they come from."""
        return {
            "emulation": True,
            "profile": self.name,
            "description": self.description,
            "target_forward": vars(self.target),
            "draft_step": vars(self.draft),
            "features": {"width": self.feature_width, "dtype": self.feature_dtype},
            "law": {**vars(self.law), "agree": list(self.law.agree)},
            "sources": self.sources,
        }


def bundled_profiles() -> list[str]:
    """Names of the profiles in configs/emulate/."""
    return sorted(p.stem for p in PROFILE_ROOT.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A bundled profile by name (`null`, `h200-1b`, `70b-tp4`) or a YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_ROOT / f"{name_or_path}.yaml"
        if not path.exists():
            raise ProfileError(f"no profile {str(name_or_path)!r} (bundled: {', '.join(bundled_profiles())})")
    if not path.exists():
        raise ProfileError(f"{path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: must be a mapping")
    return profile_from_dict(data, path.stem)


def profile_from_dict(data: dict, default_name: str = "") -> Profile:
    """A profile from its YAML mapping; an unknown key or a bad value is refused, naming it."""
    data = dict(data)
    costs = {key: _cost(data.pop(key, None), key) for key in ("target", "draft")}
    law = _law(data.pop("law", None) or {})
    features = _known(data.pop("features", None) or {}, "features", {"width", "dtype"})
    name = str(data.pop("name", default_name))
    description = str(data.pop("description", ""))
    sources = str(data.pop("sources", ""))
    max_positions = data.pop("max_positions", 4096)
    if data:
        raise ProfileError(f"{sorted(data)[0]}: unknown key (expected name, description, sources, target, draft, features, law, max_positions)")
    width, dtype = features.get("width", 2048), features.get("dtype", "bfloat16")
    if type(width) is not int or width < 3:
        raise ProfileError(f"features.width: must be an integer >= 3, got {width!r}")
    if dtype not in WIRE_DTYPES:
        raise ProfileError(f"features.dtype: {dtype!r} is not one of {list(WIRE_DTYPES)}")
    if type(max_positions) is not int or max_positions < 16:
        raise ProfileError(f"max_positions: must be an integer >= 16, got {max_positions!r}")
    return Profile(name, **costs, feature_width=width, feature_dtype=dtype, max_positions=max_positions, law=law,
                   description=description, sources=sources)


def _known(section: object, name: str, allowed: set[str]) -> dict:
    if not isinstance(section, dict):
        raise ProfileError(f"{name}: must be a mapping")
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ProfileError(f"{name}.{unknown[0]}: unknown key (expected one of {sorted(allowed)})")
    return section


def _cost(section: object, name: str) -> ForwardCost:
    if section is None:
        raise ProfileError(f"{name}: missing (a forward's fixed_ms, knee_rows, row_ms, context_ms)")
    values = _known(section, name, {f.name for f in fields(ForwardCost)})
    for key, value in values.items():
        kind = int if key == "knee_rows" else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or value < 0:
            raise ProfileError(f"{name}.{key}: must be a number >= 0, got {value!r}")
    return ForwardCost(**values)


def _law(section: object) -> Law:
    values = dict(_known(section, "law", {f.name for f in fields(Law)}))
    if "agree" in values:
        agree = values["agree"]
        if not isinstance(agree, list) or not agree or any(not isinstance(a, (int, float)) or a < 0 for a in agree) or sum(agree) > 1:
            raise ProfileError(f"law.agree: must be a nonempty list of probabilities summing to at most 1, got {agree!r}")
        values["agree"] = tuple(float(a) for a in agree)
    law = Law(**values)
    if type(law.vocab) is not int or not 64 <= law.vocab < 1 << 24:
        raise ProfileError(f"law.vocab: must be an integer in [64, 2^24), got {law.vocab!r}")
    if type(law.ranked) is not int or not len(law.agree) < law.ranked <= law.vocab // 4:
        raise ProfileError(f"law.ranked: must be an integer in ({len(law.agree)}, vocab / 4], got {law.ranked!r}")
    if type(law.context) is not int or not 1 <= law.context <= 16:
        raise ProfileError(f"law.context: must be an integer in [1, 16], got {law.context!r}")
    for key in ("sharpness", "confident", "unsure"):
        if not isinstance(getattr(law, key), (int, float)) or getattr(law, key) <= 0:
            raise ProfileError(f"law.{key}: must be a positive number, got {getattr(law, key)!r}")
    return law
