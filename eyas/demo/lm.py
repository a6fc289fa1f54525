"""Train a small Llama (or Mixtral-style MoE) causal LM on the demo corpus on CPU; saved in bfloat16.

Training is a fixed number of steps and resumable: every `checkpoint_every` steps the model, optimizer, losses and
evaluations go to `work_dir/checkpoint.pt`, and a rerun with the same settings continues from there exactly (the
data order is a function of the seed and the step). The report keeps the loss curve that REPORT.md plots.

On a machine shared with other jobs, run with OMP_WAIT_POLICY=PASSIVE in the environment: with spinning OpenMP
threads a two-thread step can become ten times slower as soon as another process takes a core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          PreTrainedModel, PreTrainedTokenizerFast)

from eyas.train.corpus import Corpus, Doc, collect
from eyas.demo.tokenizer import load_tokenizer

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM)}
BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=256, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=768, max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True, rms_norm_eps=1e-5,
)
SMALL = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
PRESETS: dict[str, dict[str, Any]] = {
    "target": {},
    "draft-lm": {**SMALL, "num_hidden_layers": 2, "intermediate_size": 384},
    # Mixtral-style sparse MoE: 4 experts per layer, 2 routed per token.
    "moe": {**SMALL, "architecture": "mixtral", "num_hidden_layers": 4, "intermediate_size": 256,
            "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01},
}
CHECKPOINT_FILE = "checkpoint.pt"


def encode_docs(tokenizer: PreTrainedTokenizerFast, docs: Sequence[Doc]) -> torch.Tensor:
    """One token stream: each document preceded by <|endoftext|>."""
    ids = []
    for enc in tokenizer.backend_tokenizer.encode_batch([d.text for d in docs]):
        ids += [tokenizer.eos_token_id] + enc.ids
    return torch.tensor(ids)


def chunks(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows of the stream, as a (n, seq_len + 1) view."""
    n = (len(stream) - 1) // seq_len
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def batches(stream: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless (batch, seq_len + 1) batches of packed windows, each epoch in a fresh random order."""
    rows = chunks(stream, seq_len)
    if len(rows) < batch_size:
        raise ValueError(f"corpus too small: {len(rows)} windows of {seq_len + 1} tokens < batch {batch_size}")
    while True:
        for idx in torch.randperm(len(rows), generator=gen).split(batch_size):
            if len(idx) == batch_size:
                yield rows[idx]


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to min_ratio at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_model(config_overrides: dict[str, Any], special: dict[str, int]) -> PreTrainedModel:
    """A fresh model of the architecture named by config_overrides["architecture"] (default llama)."""
    overrides = dict(config_overrides)
    config_cls, model_cls = ARCHITECTURES[overrides.pop("architecture", "llama")]
    return model_cls(config_cls(**{**BASE_CONFIG, **overrides, **special}))


def next_token_loss(model: PreTrainedModel, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean cross-entropy of the (B, T+1) batch's next tokens, the MoE load-balancing loss or None)."""
    moe = isinstance(model, MixtralForCausalLM)
    out = model(input_ids=batch[:, :-1], use_cache=False, **({"output_router_logits": model.training} if moe else {}))
    loss = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    return loss, getattr(out, "aux_loss", None)


@torch.no_grad()
def evaluate(model: PreTrainedModel, stream: torch.Tensor, seq_len: int, max_tokens: int | None,
             batch_size: int = 16) -> tuple[float, int]:
    """Mean next-token loss over the first max_tokens predictions (all if None); returns (loss, tokens)."""
    was_training = model.training
    model.eval()
    rows = chunks(stream, seq_len)
    if max_tokens is not None:
        rows = rows[: max(1, max_tokens // seq_len)]
    total = sum(next_token_loss(model, batch)[0].item() * batch[:, 1:].numel() for batch in rows.split(batch_size))
    model.train(was_training)
    return total / rows[:, 1:].numel(), rows[:, 1:].numel()


def _save_atomically(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_lm(out_dir: str | Path, tokenizer_dir: str | Path, config_overrides: dict[str, Any] | None = None,
             seed: int = 0, *, steps: int, corpus: Corpus | None = None, work_dir: str | Path | None = None,
             seq_len: int = 256, batch_size: int = 8, lr: float = 1.5e-3, min_lr_ratio: float = 0.1,
             warmup: int = 50, eval_tokens: int | None = 100_000, curve_every: int = 250,
             curve_eval_tokens: int = 20_000, checkpoint_every: int = 100, bf16: bool = False) -> dict[str, Any]:
    """Train exactly `steps` steps, save model + tokenizer to out_dir, return the report (also out_dir/train_report.json).

    With a work_dir the run checkpoints there and resumes from its checkpoint; a checkpoint written under other
    settings is refused, naming the setting. Every `curve_every` steps the held-out loss on the first
    `curve_eval_tokens` tokens joins the curve. `bf16` runs the forward under bfloat16 autocast (fp32 master weights
    and loss), which is much faster on CPUs with bf16 instructions.
    """
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    corpus = corpus or collect()
    tok = load_tokenizer(tokenizer_dir)
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    overrides = {"vocab_size": len(tok), **(config_overrides or {})}
    model = build_model(overrides, special)
    n_params = sum(p.numel() for p in model.parameters())
    train, heldout = encode_docs(tok, corpus.train), encode_docs(tok, corpus.heldout)
    settings = {"config": model.config.to_dict(), "steps": steps, "seed": seed, "seq_len": seq_len,
                "batch_size": batch_size, "lr": lr, "min_lr_ratio": min_lr_ratio, "warmup": warmup,
                "bf16": bf16, "train_tokens": len(train)}
    settings["config"].pop("transformers_version", None)

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    warmup = min(warmup, max(1, steps // 10))
    step, losses, curve, elapsed = 0, [], [], 0.0
    checkpoint = Path(work_dir) / CHECKPOINT_FILE if work_dir is not None else None
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        for key, value in settings.items():
            if state["settings"].get(key) != value:
                raise ValueError(f"cannot resume from {checkpoint}: its {key} differs from this run's "
                                 f"(delete {checkpoint.parent} to start over)")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, losses, curve, elapsed = state["step"], state["losses"], state["curve"], state["elapsed"]
        torch.set_rng_state(state["rng"])
    data = batches(train, seq_len, batch_size, torch.Generator().manual_seed(seed))
    for _ in range(step):  # the data order depends only on (seed, step)
        next(data)
    tokens_per_step = batch_size * seq_len

    def save_checkpoint() -> None:
        if checkpoint is not None:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            _save_atomically({"settings": settings, "model": model.state_dict(), "optimizer": opt.state_dict(),
                              "step": step, "losses": losses, "curve": curve, "elapsed": elapsed,
                              "rng": torch.get_rng_state()}, checkpoint)

    bar = tqdm(total=steps, initial=step, desc=f"train {out_dir.name}", unit="step", mininterval=5.0)
    model.train()
    t0 = time.perf_counter() - elapsed
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(step, steps, warmup, min_lr_ratio)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, aux = next_token_loss(model, next(data))
        (loss if aux is None else loss + model.config.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        if step % curve_every == 0 or step == steps:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                curve.append({"step": step, "train_loss": sum(losses[-50:]) / len(losses[-50:]),
                              "heldout_loss": evaluate(model, heldout, seq_len, curve_eval_tokens)[0]})
        elapsed = time.perf_counter() - t0
        if step % checkpoint_every == 0:
            save_checkpoint()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", tok_s=f"{step * tokens_per_step / elapsed:.0f}",
                        lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)
        bar.update()
    bar.close()
    save_checkpoint()

    fp32_loss, _ = evaluate(model, heldout, seq_len, eval_tokens)
    model.generation_config = GenerationConfig(**special)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    reloaded = type(model).from_pretrained(out_dir, dtype=torch.float32, local_files_only=True)
    heldout_loss, heldout_tokens = evaluate(reloaded, heldout, seq_len, eval_tokens)

    report = {
        "config": {k: v for k, v in settings["config"].items() if k in {*BASE_CONFIG, *overrides, *special}},
        "architecture": type(model).__name__,
        "params": n_params,
        "seed": seed,
        "steps": step,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "lr": lr,
        "warmup_steps": warmup,
        "bf16_autocast": bf16,
        "tokens_seen": step * tokens_per_step,
        "train_tokens": len(train),
        "epochs": step * tokens_per_step / len(train),
        "minutes": elapsed / 60,
        "tokens_per_s": step * tokens_per_step / elapsed,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "curve": curve,
        "heldout_tokens": heldout_tokens,
        "heldout_loss_fp32": fp32_loss,
        "heldout_loss": heldout_loss,
        "heldout_ppl": math.exp(heldout_loss),
        "weights_dtype": "bfloat16",
        "python": platform.python_version(),
        "stdlib_root": str(corpus.root),
        "heldout_modules": corpus.heldout_modules,
    }
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eyas.demo.lm", description=__doc__)
    p.add_argument("--out", required=True, help="output directory (model, tokenizer, train_report.json)")
    p.add_argument("--tokenizer", required=True, help="directory of a tokenizer saved by eyas.demo.tokenizer")
    p.add_argument("--preset", choices=sorted(PRESETS), default="target")
    p.add_argument("--config", type=json.loads, default={}, help='JSON config overrides, e.g. \'{"hidden_size": 128}\'')
    p.add_argument("--steps", type=int, required=True, help="training steps")
    p.add_argument("--work-dir", help="checkpoint here and resume from it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the forward (fp32 weights and loss)")
    args = p.parse_args(argv)
    report = train_lm(args.out, args.tokenizer, {**PRESETS[args.preset], **args.config}, args.seed, steps=args.steps,
                      work_dir=args.work_dir, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                      warmup=args.warmup, bf16=args.bf16)
    print(json.dumps({k: report[k] for k in ("params", "steps", "tokens_per_s", "final_train_loss", "heldout_ppl")}))


if __name__ == "__main__":
    main()
