"""Train a small Llama causal LM on the demo corpus on CPU (fp32 weights, optional bf16 autocast); saved in bfloat16.

On a machine shared with other jobs, run with OMP_WAIT_POLICY=PASSIVE in the environment: with spinning OpenMP
threads a two-thread step can become ten times slower as soon as another process takes a core.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eyas.demo.corpus import Corpus, Doc, collect
from eyas.demo.tokenizer import load_tokenizer

BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=256, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=768, max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, rms_norm_eps=1e-5,
)
PRESETS: dict[str, dict[str, Any]] = {"target": {}, "draft-lm": {"num_hidden_layers": 2, "tie_word_embeddings": True}}


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


def lr_factor(step: int, total: int | None, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to min_ratio at step `total`."""
    if step < warmup or total is None:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, max_tokens: int | None,
             batch_size: int = 16) -> tuple[float, int]:
    """Mean next-token loss over the first max_tokens predictions (all if None); returns (loss, tokens)."""
    model.eval()
    rows = chunks(stream, seq_len)
    if max_tokens is not None:
        rows = rows[: max(1, max_tokens // seq_len)]
    total = 0.0
    for batch in rows.split(batch_size):
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
    return total / rows[:, 1:].numel(), rows[:, 1:].numel()


def train_lm(out_dir: str | Path, tokenizer_dir: str | Path, config_overrides: dict[str, Any] | None = None,
             minutes: float | None = None, seed: int = 0, *, steps: int | None = None, corpus: Corpus | None = None,
             seq_len: int = 256, batch_size: int = 8, lr: float = 1.5e-3, min_lr_ratio: float = 0.1,
             warmup: int = 50, probe_steps: int = 10, eval_tokens: int | None = 100_000,
             bf16: bool = False) -> dict[str, Any]:
    """Train for `minutes` of wall time (or exactly `steps`), save model + tokenizer to out_dir, return the report.

    With a time budget, the first `probe_steps` steps measure the step time, which fixes the total number of steps
    so that the cosine schedule ends with the budget. `bf16` runs the forward under bfloat16 autocast (fp32 master
    weights and loss), which is much faster on CPUs with bf16 instructions.
    """
    if (minutes is None) == (steps is None):
        raise ValueError("give exactly one of minutes and steps")
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    corpus = corpus or collect()
    tok = load_tokenizer(tokenizer_dir)
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = LlamaConfig(**{**BASE_CONFIG, "vocab_size": len(tok), **(config_overrides or {}), **special})
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    train, heldout = encode_docs(tok, corpus.train), encode_docs(tok, corpus.heldout)

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    data = batches(train, seq_len, batch_size, torch.Generator().manual_seed(seed))
    total = steps
    warmup = min(warmup, max(1, steps // 10)) if steps else max(warmup, probe_steps)
    tokens_per_step = batch_size * seq_len
    losses: list[float] = []
    bar = tqdm(total=total, desc=f"train {out_dir.name}", unit="step", mininterval=5.0)
    model.train()
    t0 = time.perf_counter()
    step_times = []
    step = 0
    while total is None or step < total:
        t_step = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(step, total, warmup, min_lr_ratio)
        batch = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_times.append(time.perf_counter() - t_step)
        step += 1
        if total is None and step == probe_steps:
            step_time = statistics.median(step_times[1:])  # step 0 is slow (allocator warmup)
            total = max(probe_steps, round(minutes * 60 / step_time))
            warmup = min(warmup, max(probe_steps, total // 10))
            bar.total = total
        elapsed = time.perf_counter() - t0
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", tok_s=f"{step * tokens_per_step / elapsed:.0f}",
                        lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)
        bar.update()
    bar.close()
    train_seconds = time.perf_counter() - t0

    fp32_loss, _ = evaluate(model, heldout, seq_len, eval_tokens)
    model.generation_config = GenerationConfig(**special)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    reloaded = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True)
    heldout_loss, heldout_tokens = evaluate(reloaded, heldout, seq_len, eval_tokens)

    report = {
        "config": {k: config.to_dict()[k] for k in [*BASE_CONFIG, *special]},
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
        "minutes": train_seconds / 60,
        "tokens_per_s": step * tokens_per_step / train_seconds,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
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
    p.add_argument("--config", type=json.loads, default={}, help='JSON LlamaConfig overrides, e.g. \'{"hidden_size": 128}\'')
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, help="training wall-time budget")
    budget.add_argument("--steps", type=int, help="train exactly this many steps instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the forward (fp32 weights and loss)")
    args = p.parse_args(argv)
    report = train_lm(args.out, args.tokenizer, {**PRESETS[args.preset], **args.config}, args.minutes, args.seed,
                      steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                      bf16=args.bf16)
    print(json.dumps({k: report[k] for k in ("params", "steps", "tokens_per_s", "final_train_loss", "heldout_ppl")}))


if __name__ == "__main__":
    main()
