"""Pairing a drafter with a target: which features to tap, and the manifest the pair runs under.

Used by the in-process engine and by both kinds of worker, so every path applies the same
manifest rules: the stored manifest's address is tapped unless the caller names another, and
a stored manifest that disagrees with the runtime target is refused (or, with an explicit
override, recorded).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .drafters.checkpoint import detect_kind, read_weights
from .manifest import DRAFTER_ABI, FeatureAddress, Manifest, TargetFingerprint, check_compatible


@dataclass(frozen=True)
class DrafterPlan:
    """What a drafter directory asks of its target before any model is loaded."""

    kind: str
    address: FeatureAddress
    stored: Manifest | None

    def manifest(self, fingerprint: TargetFingerprint, allow_mismatch: bool = False) -> Manifest:
        """The manifest the pair runs under; refuses a mismatch unless `allow_mismatch` (then records it)."""
        runtime = Manifest(target=fingerprint, feature=self.address, drafter_abi=DRAFTER_ABI[self.kind])
        if self.stored is None:
            warnings.warn("drafter has no stored manifest: the target fingerprint cannot be checked", stacklevel=2)
            return Manifest(
                target=fingerprint,
                feature=self.address,
                drafter_abi=DRAFTER_ABI[self.kind],
                overrides=("no manifest stored with the drafter",),
            )
        return check_compatible(self.stored, runtime, allow_mismatch)


def _weight_keys(path: Path) -> set[str]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return set(read_weights(path))
    keys: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def plan_drafter(drafter_dir: str | Path, num_target_layers: int, layers: tuple[int, ...] | None = None) -> DrafterPlan:
    """Read a drafter directory's kind and manifest and decide the feature address to tap."""
    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / "config.json").exists():
        raise FileNotFoundError(f"{drafter_dir} is not a drafter directory (no config.json)")
    config = json.loads((drafter_dir / "config.json").read_text())
    kind = detect_kind(config, _weight_keys(drafter_dir), drafter_dir)
    stored = Manifest.load(drafter_dir)
    if layers is not None:
        address = FeatureAddress("layer_inputs", tuple(layers)) if kind == "eagle3" else FeatureAddress.eagle1()
    elif stored is not None:
        address = stored.feature
    elif kind == "eagle3":
        address = FeatureAddress.eagle3(num_target_layers)
    else:
        address = FeatureAddress.eagle1()
    return DrafterPlan(kind, address, stored)


def target_num_layers(target_dir: str | Path) -> int:
    config = json.loads(Path(target_dir, "config.json").read_text())
    return int((config.get("text_config") or config)["num_hidden_layers"])


def load_embedding_and_head(target_dir: str | Path) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """Only the target's token embedding and LM head (frozen), for a draft worker that holds no target layers."""
    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    wanted = {"model.embed_tokens.weight", "lm_head.weight"}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for key in wanted & set(handle.keys()):
                tensors[key] = handle.get_tensor(key).float()
    if "model.embed_tokens.weight" not in tensors:
        raise FileNotFoundError(f"{target_dir}: no model.embed_tokens.weight in the target's safetensors")
    head = tensors.get("lm_head.weight")
    if head is None and config.get("tie_word_embeddings", False):
        head = tensors["model.embed_tokens.weight"]
    if head is None:
        raise FileNotFoundError(f"{target_dir}: no lm_head.weight and the embeddings are not tied")
    embed = torch.nn.Embedding.from_pretrained(tensors["model.embed_tokens.weight"], freeze=True)
    lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    return embed, lm_head
