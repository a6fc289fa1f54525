"""Build the bundled demo base models: corpus -> tokenizer -> target LM -> small plain draft LM.

Training runs a fixed number of steps (not a time budget), so a rebuild gives the same models on any
machine; the reports record how long it took here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eyas.demo.corpus import collect
from eyas.demo.lm import PRESETS, train_lm
from eyas.demo.tokenizer import train_tokenizer

TARGET_STEPS = 2400
DRAFT_LM_STEPS = 500
LR = 2e-3


def build_base_models(out_root: str | Path = "models/demo", target_steps: int = TARGET_STEPS,
                      draft_lm_steps: int = DRAFT_LM_STEPS, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Write out_root/target and out_root/draft-lm (model, shared tokenizer, train_report.json); return the reports."""
    corpus = collect()
    target, draft = Path(out_root) / "target", Path(out_root) / "draft-lm"
    train_tokenizer([d.text for d in corpus.train], out_dir=target)
    common = dict(corpus=corpus, lr=LR, bf16=True)
    return {
        "target": train_lm(target, target, PRESETS["target"], None, seed, steps=target_steps, **common),
        "draft-lm": train_lm(draft, target, PRESETS["draft-lm"], None, seed, steps=draft_lm_steps, **common),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eyas.demo.build", description=__doc__)
    p.add_argument("--out", default="models/demo", help="output root")
    p.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    p.add_argument("--draft-lm-steps", type=int, default=DRAFT_LM_STEPS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    reports = build_base_models(args.out, args.target_steps, args.draft_lm_steps, args.seed)
    for name, r in reports.items():
        print(name, json.dumps({k: r[k] for k in ("params", "steps", "tokens_per_s", "final_train_loss", "heldout_ppl")}))


if __name__ == "__main__":
    main()
