"""A deterministic tiny world for the training-time-test comparison: a target, two drafters, one batch.

Every weight comes from a seeded generator of this file (not a library's initialiser), so the
same world can be rebuilt anywhere and fed to another implementation of the same objectives.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.drafters import build_drafter, drafter_config, save_drafter
from eyas.manifest import DRAFTER_ABI, FeatureAddress, Manifest
from eyas.target import TargetModel

# Written out rather than shared with tiny.py: the official numbers were computed on exactly this target.
# 8 layers: EAGLE-3 taps the inputs of layers 2, 4, 5, distinct and in layer order.
TARGET = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
DRAFT_VOCAB = 64
BATCH, SEQ = 2, 16
UNSUPERVISED = [(0, 5), (1, 9), (1, 10)]  # (item, source row) pairs with loss_mask 0


def fill(module: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter, in name order: norms 1 + 0.1 N(0, 1), the rest std N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.1 * noise if "norm" in name else std * noise)


def make_target(directory: Path) -> Path:
    model = LlamaForCausalLM(LlamaConfig(**TARGET))
    fill(model, seed=11, std=0.15)
    model.save_pretrained(directory)
    return directory


def make_drafter(directory: Path, target_dir: Path, kind: str) -> Path:
    target = TargetModel.from_pretrained(target_dir)
    extra = {"draft_vocab_size": DRAFT_VOCAB} if kind == "eagle3" else {}
    drafter = build_drafter(kind, drafter_config(kind, target.config, **extra))
    fill(drafter, seed=12 if kind == "eagle3" else 13, std=0.08)
    if kind == "eagle3":  # the draft head starts from the target head's rows, so that some drafts agree
        ids = torch.arange(TARGET["vocab_size"] - DRAFT_VOCAB, TARGET["vocab_size"])
        drafter.set_vocab_map(ids, TARGET["vocab_size"])
        with torch.no_grad():
            drafter.lm_head.weight.copy_(target.lm_head.weight[ids])
    save_drafter(drafter, directory)
    address = FeatureAddress.eagle3(target.num_layers) if kind == "eagle3" else FeatureAddress.eagle1()
    Manifest(target=target.fingerprint, feature=address, drafter_abi=DRAFTER_ABI[kind]).save(directory)
    return directory


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] token ids and [B, S] source-row supervision (the last row never has a successor)."""
    generator = torch.Generator().manual_seed(14)
    tokens = torch.randint(3, TARGET["vocab_size"], (BATCH, SEQ), generator=generator)
    supervise = torch.ones(BATCH, SEQ, dtype=torch.long)
    supervise[:, -1] = 0
    for item, row in UNSUPERVISED:
        supervise[item, row] = 0
    return tokens, supervise


def make_world(root: Path) -> dict[str, Path]:
    target = make_target(root / "target")
    return {
        "target": target,
        "eagle3": make_drafter(root / "eagle3", target, "eagle3"),
        "eagle1": make_drafter(root / "eagle1", target, "eagle1"),
    }
