"""The drafter trainer: one recipe, a frozen target, and EAGLE-1, HASS or EAGLE-3 objectives.

Everything random is a function of (seed, step), so a run resumed from a checkpoint continues
exactly as the uninterrupted run would; data-parallel workers normalise by global supervised
counts, so N workers on one global batch compute the same update as one.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..drafters import Eagle3Drafter, build_drafter, drafter_config, save_drafter
from ..drafters.checkpoint import read_weights
from ..manifest import DRAFTER_ABI, FeatureAddress, Manifest
from ..pairing import target_num_layers
from ..target import TargetModel
from .data import DataError, Packed, pack, read_documents
from .features import feature_source
from .objectives import Objective, feature_noise, rollout_loss, teacher_rows
from .recipe import Recipe, RecipeError
from .regenerate import regenerated
from .rows import compile_rows, gather_rows
from .vocab import draft_vocabulary

STATE_FILE = "trainer_state.pt"
LOG_FILE = "log.jsonl"


class Comm:
    """Data-parallel communication; the single-process default has one rank and reduces nothing."""

    rank = 0
    world = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class TorchComm(Comm):
    """torch.distributed (gloo on CPU) as set up by Ray Train."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        self.dist.all_reduce(tensor)
        return tensor


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup, then cosine decay to `min_ratio` of the peak at `total` steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def as_float32(features: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher tensors in float32, keeping "hidden is features" (EAGLE-1 taps the final hidden state itself)."""
    same = hidden is features
    features = features.float()
    return features, features if same else hidden.float()


def model_kind(recipe_kind: str) -> str:
    """HASS trains the EAGLE-1 architecture; only its objective differs."""
    return "eagle3" if recipe_kind == "eagle3" else "eagle1"


class Trainer:
    """Trains one drafter against a frozen target as a recipe describes."""

    def __init__(self, recipe: Recipe, comm: Comm | None = None, resume_from: str | Path | None = None):
        self.recipe = recipe
        self.comm = comm or Comm()
        self.objective = Objective.preset(recipe.recipe, **recipe.objective)
        kind = model_kind(recipe.recipe)
        layers = tuple(recipe.feature_layers) if recipe.feature_layers else None
        address = FeatureAddress.eagle1() if kind == "eagle1" else FeatureAddress.eagle3(target_num_layers(recipe.target), layers)
        self.target = TargetModel.from_pretrained(recipe.target, address, kv_slots=0)
        if self.target.tokenizer is None:
            raise DataError(f"{recipe.target}: the target has no tokenizer to encode training text with")
        self.train_data = self._load(recipe.data)
        if recipe.regeneration():
            self.train_data = regenerated(
                recipe.target, self.target, self.train_data, recipe.regeneration(), recipe.regeneration_cache(), self.comm.rank == 0
            )
        if self.train_data.supervised_tokens == 0:
            raise DataError("the training data has no supervised tokens after masking")
        self.eval_data = self._load(recipe.eval_data) if recipe.eval_data else None

        overrides = dict(recipe.drafter)
        if kind == "eagle3":
            overrides["draft_vocab_size"] = recipe.draft_vocab_size or self.target.vocab_size
        torch.manual_seed(recipe.seed)
        self.drafter = build_drafter(kind, drafter_config(kind, self.target.config, **overrides))
        self._init_weights()
        self.drafter.bind_target(self.target.embed, self.target.lm_head).train()
        self.manifest = Manifest(self.target.fingerprint, address, DRAFTER_ABI[kind])

        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(), lr=recipe.lr, betas=tuple(recipe.betas), weight_decay=recipe.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(recipe.warmup_steps, recipe.max_steps, recipe.min_lr_ratio)
        )
        self.step = 0
        self.skipped = 0
        if resume_from is not None:
            self.load_state(resume_from)
        self.features = feature_source(self.target, self.train_data, recipe.features)
        self.output = Path(recipe.output)

    def _load(self, sources: list[str]) -> Packed:
        docs = read_documents(sources, self.target.tokenizer)
        too_big = [t for d in docs for t in d.tokens if t >= self.target.vocab_size]
        if too_big:
            raise DataError(
                f"the tokenizer produced id {too_big[0]} but the target's vocabulary has {self.target.vocab_size} "
                "entries: tokenizer and target do not match"
            )
        if not docs:
            raise DataError(f"no documents in {sources}")
        return pack(docs, self.recipe.seq_len, self.target.tokenizer.eos_token_id)

    def _init_weights(self) -> None:
        """Small normal init; an EAGLE-3 head starts from the target head's rows of the draft vocabulary."""
        for module in self.drafter.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
        if isinstance(self.drafter, Eagle3Drafter):
            ids = draft_vocabulary(self.train_data, self.drafter.draft_vocab_size, self.target.vocab_size)
            self.drafter.set_vocab_map(ids, self.target.vocab_size)
            with torch.no_grad():
                self.drafter.lm_head.weight.copy_(self.target.lm_head.weight[ids])
                self.drafter.norm.weight.copy_(self.target.runtime.norm)

    # -- one step ---------------------------------------------------------------------------

    def batch_index(self, step: int, data: Packed | None = None) -> torch.Tensor:
        """Global batch of `step`: a fresh permutation of the data each epoch, seeded by (seed, epoch)."""
        n = len(data or self.train_data)
        b = self.recipe.batch_size
        positions = torch.arange(step * b, (step + 1) * b)
        index = torch.empty(b, dtype=torch.long)
        for epoch in positions.div(n, rounding_mode="floor").unique().tolist():
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.recipe.seed * 100_003 + epoch))
            chosen = positions.div(n, rounding_mode="floor") == epoch
            index[chosen] = order[positions[chosen] % n]
        return index

    def local(self, index: torch.Tensor) -> torch.Tensor:
        share = len(index) // self.comm.world
        return index[self.comm.rank * share : (self.comm.rank + 1) * share]

    def losses(
        self, batch: Packed, feats: torch.Tensor, hidden: torch.Tensor, step: int | None, distributed: bool
    ) -> tuple[torch.Tensor | None, dict]:
        """Loss and metrics of one local batch; None when no row (on any worker) is supervised.

        feats: [b, S, F] teacher features, hidden: [b, S, d] final-norm hidden states; `step` seeds the
        feature noise (None: no noise, for evaluation).
        """
        reduce = self.comm.all_reduce if distributed else (lambda t: t)
        plan = compile_rows(batch.valid, batch.segment, batch.position, batch.supervise)
        if float(reduce(torch.tensor(float(plan.num_soft)))) == 0:
            return None, {}
        rows = gather_rows(plan, batch.tokens, feats)
        hidden_next = rows["target_feature"] if hidden is feats else gather_rows(plan, batch.tokens, hidden)["target_feature"]
        teacher = teacher_rows(self.drafter, rows, hidden_next)
        noise = None
        if step is not None and self.objective.noise != "none":
            generator = torch.Generator().manual_seed(self.recipe.seed * 1_000_003 + step)
            full = torch.Size((self.recipe.batch_size, *feats.shape[1:]))
            share = feats.shape[0]
            local_noise = feature_noise(full, self.objective, self.recipe.seq_len, generator)[
                self.comm.rank * share : (self.comm.rank + 1) * share
            ]
            noise = gather_rows(plan, batch.tokens, local_noise)["source_feature"]
        world = self.comm.world if distributed else 1
        with self.autocast():
            return rollout_loss(
                self.drafter, plan, teacher, self.objective, noise, lambda mask: float(reduce(mask.sum().double())) / world
            )

    def autocast(self) -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.recipe.bf16)

    def train_step(self) -> dict:
        """One optimizer step (or a skip when the batch has no supervised row: no update, no weight decay)."""
        index = self.local(self.batch_index(self.step))
        with self.autocast():
            feats, hidden = as_float32(*self.features(index))
        loss, metrics = self.losses(self.train_data.select(index), feats, hidden, self.step, distributed=True)
        self.step += 1
        if loss is None:
            self.skipped += 1
            return {"step": self.step, "skipped": True}
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        if self.comm.world > 1:
            for p in params:
                p.grad = self.comm.all_reduce(p.grad) / self.comm.world
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.recipe.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        total = float(self.comm.all_reduce(loss.detach())) / self.comm.world
        return {"step": self.step, "loss": total, "lr": lr, "grad_norm": float(grad_norm), **metrics}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean metrics over the first eval_batches batches of the eval data (or of the training data)."""
        data = self.eval_data or self.train_data
        source = feature_source(self.target, data, "online") if self.eval_data is not None else self.features
        totals: dict[str, float] = {}
        batches = 0
        b = self.recipe.batch_size
        self.drafter.eval()
        for i in range(min(self.recipe.eval_batches, -(-len(data) // b))):
            index = torch.arange(i * b, min((i + 1) * b, len(data)))
            with self.autocast():
                feats, hidden = as_float32(*source(index))
            loss, metrics = self.losses(data.select(index), feats, hidden, None, distributed=False)
            if loss is None:
                continue
            for key, value in {"loss": float(loss), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + value
            batches += 1
        self.drafter.train()
        return {k: v / batches for k, v in totals.items()} if batches else {}

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Drafter in the official layout plus manifest, and the trainer state needed to resume exactly."""
        directory = Path(directory)
        save_drafter(self.drafter, directory)
        self.manifest.save(directory)
        state = {
            "recipe": self.recipe.to_dict(),
            "objective": asdict(self.objective),
            "step": self.step,
            "skipped": self.skipped,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, directory / STATE_FILE)
        return directory

    def load_state(self, directory: str | Path) -> None:
        """Resume from a checkpoint of the same recipe kind, refusing any other before training starts."""
        directory = Path(directory)
        if not (directory / STATE_FILE).exists():
            raise RecipeError(f"{directory}: not a training checkpoint (no {STATE_FILE})")
        state = torch.load(directory / STATE_FILE, weights_only=True)
        saved = state["recipe"]
        for key in ("recipe", "target", "seq_len", "batch_size", "seed"):
            if saved[key] != getattr(self.recipe, key):
                raise RecipeError(
                    f"cannot resume: the checkpoint's {key} is {saved[key]!r}, this recipe's is {getattr(self.recipe, key)!r}"
                )
        if state["objective"] != asdict(self.objective):
            raise RecipeError("cannot resume: the checkpoint was trained with other objective settings")
        self.drafter.load_state_dict(read_weights(directory))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        self.skipped = state["skipped"]

    # -- the loop ------------------------------------------------------------------------------

    def _truncate_log(self) -> None:
        """Drop log records past the step this run starts from, so that a resumed run logs each step once."""
        path = self.output / LOG_FILE
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line).get("step", 0) <= self.step]
            path.write_text("".join(line + "\n" for line in kept))

    def fit(self, progress: bool = True) -> Path:
        """Train to max_steps with logging, periodic evaluation and checkpoints; returns the final checkpoint."""
        lead = self.comm.rank == 0
        self.output.mkdir(parents=True, exist_ok=True)
        if lead:
            self._truncate_log()
        log = (self.output / LOG_FILE).open("a") if lead else None
        bar = tqdm(total=self.recipe.max_steps, initial=self.step, disable=not (progress and lead), unit="step")
        tokens_per_step = self.recipe.batch_size * self.recipe.seq_len
        started, started_cpu, done_at_start = time.perf_counter(), time.process_time(), self.step
        while self.step < self.recipe.max_steps:
            record = self.train_step()
            elapsed = time.perf_counter() - started
            record["tokens_per_s"] = (self.step - done_at_start) * tokens_per_step / max(elapsed, 1e-9)
            record["cpu_s"] = time.process_time() - started_cpu  # this run's processor time: compute on a shared machine
            bar.update(1)
            if "loss" in record:
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if lead and (self.step % self.recipe.log_every == 0 or record.get("skipped")):
                log.write(json.dumps(record) + "\n")
                log.flush()
            if lead and self.step % self.recipe.eval_every == 0:
                log.write(json.dumps({"step": self.step, "eval": self.evaluate()}) + "\n")
                log.flush()
            if lead and self.step % self.recipe.save_every == 0:
                self.save(self.output / f"checkpoint-{self.step}")
        bar.close()
        final = self.output / "final"
        if lead:
            log.write(json.dumps({"step": self.step, "eval": self.evaluate(), "final": True}) + "\n")
            log.close()
            self.save(final)
            from .plots import plot_log

            plot_log(self.output / LOG_FILE, self.output / "training.png")
        return final
