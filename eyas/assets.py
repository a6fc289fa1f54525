"""Where the bundled demo models live, so every command has a working default on a fresh checkout."""

from __future__ import annotations

import os
from pathlib import Path

DEMO_ROOT = Path(os.environ.get("EYAS_DEMO_MODELS", Path(__file__).resolve().parents[1] / "models" / "demo"))
PROFILE_ROOT = Path(__file__).resolve().parents[1] / "configs" / "emulate"  # cost profiles of emulated accelerators
DEFAULT_DRAFTER = "hass"  # the bundled drafter models/demo/REPORT.md measures best


def demo_model(name: str) -> Path:
    """Path of a bundled demo model (`target`, `eagle1`, `hass`, `eagle3`, `draft-lm`), or a clear error."""
    path = DEMO_ROOT / name
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"bundled demo model {name!r} not found at {path}; run `eyas demo build` or pass explicit model paths"
        )
    return path
