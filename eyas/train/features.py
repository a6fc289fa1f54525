"""Teacher features: online (the frozen target runs inside the step) or cached to safetensors shards.

A cache is a labelled dataset, not reusable activations: it records the target fingerprint, the
feature address and a digest of the packed tokens, and a cache made for another target revision,
address or data is refused as stale.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..manifest import FeatureAddress
from ..runtime.kv import PassThroughKV
from ..target import TargetModel
from .data import Packed, segment_causal_mask

SHARD_SEQUENCES = 256
META_FILE = "cache.json"


class StaleFeatureCache(ValueError):
    """A feature cache was made for another target, address or dataset; `field` names which."""

    def __init__(self, field: str, cached: object, current: object):
        super().__init__(f"stale feature cache: {field} is {cached!r} in the cache but {current!r} now")
        self.field = field


def tokens_digest(data: Packed) -> str:
    digest = hashlib.sha256()
    for name in ("tokens", "valid", "segment", "supervise"):
        digest.update(getattr(data, name).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def teacher_features(
    target: TargetModel, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache-free forward of the frozen target: tokens, positions [B, S], mask [B, 1, S, S] bool.

    Returns (features [B, S, F] at the declared address, final-norm hidden states [B, S, d]).
    """
    out = target.runtime.forward(tokens, positions, PassThroughKV(), mask, target.taps)
    if not target.taps:
        return out.hidden, out.hidden
    return torch.cat(out.taps, dim=-1), out.hidden  # [B, S, d * taps]


class OnlineFeatures:
    """Run the frozen target (no grad) on the sequences of each step."""

    def __init__(self, target: TargetModel, data: Packed):
        self.target = target
        self.data = data

    def __call__(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.data.select(index)
        mask = segment_causal_mask(batch.valid, batch.segment)
        return teacher_features(self.target, batch.tokens, batch.position, mask)  # [b, S, F], [b, S, d]


def _meta(target: TargetModel, data: Packed) -> dict:
    return {
        "fingerprint": asdict(target.fingerprint),
        "address": {"kind": target.address.kind, "layers": list(target.address.layers)},
        "tokens": tokens_digest(data),
        "sequences": len(data),
        "seq_len": int(data.tokens.shape[1]),
    }


def build_cache(target: TargetModel, data: Packed, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write every sequence's features (and final hidden states when they differ) as shards."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    online = OnlineFeatures(target, data)
    for start in tqdm(range(0, len(data), SHARD_SEQUENCES), desc="caching features", unit="shard"):
        index = torch.arange(start, min(start + SHARD_SEQUENCES, len(data)))
        parts = [online(index[i : i + 16]) for i in range(0, len(index), 16)]
        tensors = {"features": torch.cat([f for f, _ in parts]).to(dtype)}
        if target.address.kind != "final_norm_output":
            tensors["hidden"] = torch.cat([h for _, h in parts]).to(dtype)
        save_file(tensors, str(path / f"shard-{start // SHARD_SEQUENCES:05d}.safetensors"))
    (path / META_FILE).write_text(json.dumps(_meta(target, data), indent=2))


class CachedFeatures:
    """Features read back from a cache that matches the target, its address and the packed data."""

    def __init__(self, target: TargetModel, data: Packed, path: str | Path):
        path = Path(path)
        meta = json.loads((path / META_FILE).read_text())
        current = _meta(target, data)
        for key, value in current["fingerprint"].items():
            if meta["fingerprint"].get(key) != value:
                raise StaleFeatureCache(f"target.{key}", meta["fingerprint"].get(key), value)
        if FeatureAddress(**meta["address"]) != FeatureAddress(**current["address"]):
            raise StaleFeatureCache("feature address", meta["address"], current["address"])
        for key in ("tokens", "sequences", "seq_len"):
            if meta[key] != current[key]:
                raise StaleFeatureCache(f"data {key}", meta[key], current[key])
        shards = [load_file(str(p)) for p in sorted(path.glob("shard-*.safetensors"))]
        self.features = torch.cat([s["features"] for s in shards])
        self.hidden = torch.cat([s["hidden"] for s in shards]) if "hidden" in shards[0] else self.features

    def __call__(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index].float(), self.hidden[index].float()


def feature_source(target: TargetModel, data: Packed, setting: str):
    """"online", or a cache directory (built on first use, checked for staleness afterwards)."""
    if setting == "online":
        return OnlineFeatures(target, data)
    if not (Path(setting) / META_FILE).exists():
        build_cache(target, data, setting)
    return CachedFeatures(target, data, setting)
