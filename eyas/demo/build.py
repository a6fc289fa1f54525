"""Build the bundled demo base models: corpus -> tokenizer -> target LM -> small plain draft LM (and the MoE target).

Training runs a fixed number of epochs of the corpus (so a fixed number of steps, not a time budget), so a rebuild
gives the same models on any machine with the same Python; the reports record how long it took here. Every stage
checkpoints under the work directory and a rerun resumes where the last one stopped.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eyas.train.corpus import Corpus, collect
from eyas.demo.lm import PRESETS, encode_docs, train_lm
from eyas.demo.tokenizer import add_chat_template, load_tokenizer, train_tokenizer

EPOCHS = {"target": 3.0, "draft-lm": 1.0, "moe": 1.0}
LR = 2e-3
BATCH_SIZE, SEQ_LEN = 8, 256


def steps_for(corpus_tokens: int, epochs: float) -> int:
    """Optimizer steps that cover `epochs` passes over a corpus of that many tokens."""
    return math.ceil(epochs * corpus_tokens / (BATCH_SIZE * SEQ_LEN))


def tokenizer_dir(corpus: Corpus, work_dir: Path) -> Path:
    """The shared byte-level BPE tokenizer, trained once into work_dir/tokenizer."""
    out = work_dir / "tokenizer"
    if not (out / "tokenizer.json").exists():
        train_tokenizer([d.text for d in corpus.train], out_dir=out)
    return out


def build_base_model(name: str, out_root: str | Path = "models/demo", work_dir: str | Path = "runs/demo",
                     steps: int | None = None, seed: int = 0, corpus: Corpus | None = None) -> dict[str, Any]:
    """Train (or resume) one base model of PRESETS[name] into out_root/name (the target with the demo chat template);
    return its report.

    steps defaults to EPOCHS[name] passes over the training corpus.
    """
    corpus = corpus or collect()
    work_dir = Path(work_dir)
    tok = tokenizer_dir(corpus, work_dir)
    if steps is None:
        steps = steps_for(len(encode_docs(load_tokenizer(tok), corpus.train)), EPOCHS[name])
    report = train_lm(Path(out_root) / name, tok, PRESETS[name], seed, steps=steps, corpus=corpus, work_dir=work_dir / name,
                      seq_len=SEQ_LEN, batch_size=BATCH_SIZE, lr=LR, bf16=True)
    if name == "target":  # before any drafter is trained: the template is part of the target's fingerprint
        add_chat_template(Path(out_root) / name)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eyas.demo.build", description=__doc__)
    p.add_argument("names", nargs="*", default=["target", "draft-lm"], choices=sorted(PRESETS), help="models to build")
    p.add_argument("--out", default="models/demo", help="output root")
    p.add_argument("--work-dir", default="runs/demo", help="checkpoints (a rerun resumes from them)")
    p.add_argument("--steps", type=int, help="train this many steps instead of the preset's epochs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    corpus = collect()
    for name in args.names:
        r = build_base_model(name, args.out, args.work_dir, args.steps, args.seed, corpus)
        print(name, json.dumps({k: r[k] for k in ("params", "steps", "epochs", "tokens_per_s", "final_train_loss", "heldout_ppl")}))


if __name__ == "__main__":
    main()
