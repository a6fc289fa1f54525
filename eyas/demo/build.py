"""Build the bundled demo base models: corpus -> tokenizer -> target LM -> small plain draft LM."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eyas.demo.corpus import collect
from eyas.demo.lm import PRESETS, train_lm
from eyas.demo.tokenizer import train_tokenizer


def build_base_models(out_root: str | Path = "models/demo", target_minutes: float = 24.0,
                      draft_lm_minutes: float = 4.0, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Write out_root/target and out_root/draft-lm (model, shared tokenizer, train_report.json); return the reports."""
    corpus = collect()
    target, draft = Path(out_root) / "target", Path(out_root) / "draft-lm"
    train_tokenizer([d.text for d in corpus.train], out_dir=target)
    return {
        "target": train_lm(target, target, PRESETS["target"], target_minutes, seed, corpus=corpus),
        "draft-lm": train_lm(draft, target, PRESETS["draft-lm"], draft_lm_minutes, seed, corpus=corpus),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eyas.demo.build", description=__doc__)
    p.add_argument("--out", default="models/demo", help="output root")
    p.add_argument("--target-minutes", type=float, default=24.0)
    p.add_argument("--draft-lm-minutes", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    reports = build_base_models(args.out, args.target_minutes, args.draft_lm_minutes, args.seed)
    for name, r in reports.items():
        print(name, json.dumps({k: r[k] for k in ("params", "steps", "tokens_per_s", "final_train_loss", "heldout_ppl")}))


if __name__ == "__main__":
    main()
