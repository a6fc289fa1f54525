"""Export an eyas drafter as a checkpoint vLLM's `speculative_config` loads (method eagle or eagle3).

vLLM 0.32 reads the official layouts with three differences that change what the drafter computes:
- EAGLE-1: its `fc` has no bias (a stored `fc.bias` is silently dropped), and a config `"bias": true`
  gives the layer's `o_proj` a bias the checkpoint never fills. The export sets `"bias": false` and
  folds `fc.bias` into a drafter-owned embedding: fc(cat(e, h)) + b = fc(cat(e + delta, h)) with
  W_e @ delta = b, so the target's embedding is needed whenever the bias is non-zero.
- EAGLE-3: vLLM taps each target layer at most once and in ascending order, so the fc column blocks are
  reordered (and duplicate taps summed) to match, and the taps go into the config as
  `eagle_aux_hidden_state_layer_ids` and `num_aux_hidden_states`. With a full draft vocabulary vLLM
  refuses a `d2t`, so the head's rows are put in target order instead.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.drafters.checkpoint import EMBED_KEY, WEIGHTS_FILE, CheckpointError, detect_kind, read_weights
from eyas.manifest import MANIFEST_FILE, FeatureAddress, Manifest, check_compatible, fingerprint_target

EXPORT_FILE = "eyas_export.json"
METHODS = {"eagle1": "eagle", "eagle3": "eagle3"}
FOLD_TOLERANCE = 1e-4  # largest acceptable |W_e @ delta - b| relative to |b| when folding fc.bias


@dataclass
class VllmExport:
    """What was written: the directory, the vLLM `method` to load it with, and what the export changed."""

    path: Path
    method: str
    kind: str
    notes: list[str] = field(default_factory=list)

    def speculative_config(self, num_speculative_tokens: int = 3) -> dict:
        """The `speculative_config` that loads this export in vLLM."""
        return {"method": self.method, "model": str(self.path), "num_speculative_tokens": num_speculative_tokens}


def export_for_vllm(
    drafter_dir: str | Path,
    out_dir: str | Path,
    target_dir: str | Path | None = None,
    allow_manifest_mismatch: bool = False,
) -> VllmExport:
    """Write `drafter_dir` to `out_dir` in the layout vLLM 0.32 loads; `target_dir` (checked against the
    drafter's manifest unless `allow_manifest_mismatch`) supplies the embedding an EAGLE-1 drafter with a
    non-zero fc bias needs."""
    drafter_dir, out_dir = Path(drafter_dir), Path(out_dir)
    if not (drafter_dir / "config.json").exists():
        raise CheckpointError(drafter_dir, ["no config.json"])
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / EXPORT_FILE).exists():
        raise ValueError(f"{out_dir} is not empty and holds no earlier export: choose a new or empty directory")
    config = json.loads((drafter_dir / "config.json").read_text())
    weights = read_weights(drafter_dir)
    kind = detect_kind(config, set(weights), drafter_dir)
    manifest = Manifest.load(drafter_dir)
    target_config = _checked_target(target_dir, manifest, allow_manifest_mismatch)
    weights.pop(EMBED_KEY, None)  # vLLM shares the target's embedding unless the export needs its own
    if kind == "eagle1":
        config, weights, notes = _eagle1(config, weights, manifest, target_dir)
    else:
        config, weights, notes = _eagle3(config, weights, manifest, target_config)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    if manifest is not None:
        shutil.copyfile(drafter_dir / MANIFEST_FILE, out_dir / MANIFEST_FILE)
    export = VllmExport(out_dir, METHODS[kind], kind, notes)
    record = {**asdict(export), "path": str(out_dir), "format": "vllm", "source": str(drafter_dir.resolve())}
    (out_dir / EXPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return export


def _checked_target(target_dir: str | Path | None, manifest: Manifest | None, allow_mismatch: bool) -> dict | None:
    """The target's config, after checking the drafter's manifest was made for this target."""
    if target_dir is None:
        return None
    path = Path(target_dir)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"target {path}: no config.json")
    config = json.loads((path / "config.json").read_text())
    if manifest is not None:
        check_compatible(manifest, replace(manifest, target=fingerprint_target(path, config)), allow_mismatch)
    return config.get("text_config") or config


def _eagle1(config: dict, weights: dict, manifest: Manifest | None, target_dir: str | Path | None):
    """EAGLE-1/HASS: no fc bias, config bias false, the bias folded into an embedding of its own."""
    if manifest is not None and manifest.feature.kind != "final_norm_output":
        raise ValueError(
            "vLLM's EAGLE feeds an EAGLE-1 drafter the target's final-norm output; "
            f"this drafter taps {manifest.feature}"
        )
    notes = []
    config = {**config, "bias": False}
    bias = weights.pop("fc.bias", None)
    if bias is not None and bool(bias.any()):
        if target_dir is None:
            raise ValueError(
                "this EAGLE-1 drafter has a non-zero fc.bias, which vLLM does not apply; exporting it folds the bias "
                "into a copy of the target's embedding, so pass the target directory (--target DIR)"
            )
        embed = _target_embedding(Path(target_dir))
        d = int(config["hidden_size"])
        if tuple(embed.shape) != (int(config["vocab_size"]), d):
            raise ValueError(
                f"the target's embedding is {tuple(embed.shape)}, the drafter needs ({config['vocab_size']}, {d})"
            )
        w_e = weights["fc.weight"][:, :d].double()  # fc input is cat(embedding, feature): embedding first
        delta = torch.linalg.lstsq(w_e, bias.double().unsqueeze(1)).solution.squeeze(1)
        residual = ((w_e @ delta - bias.double()).norm() / bias.double().norm()).item()
        if residual > FOLD_TOLERANCE:
            raise ValueError(
                f"cannot fold fc.bias into the embedding: the embedding half of fc.weight is near singular "
                f"(relative residual {residual:.2e} > {FOLD_TOLERANCE:g})"
            )
        weights[EMBED_KEY] = (embed.double() + delta).float()  # not the target's dtype: a bf16 copy would lose the bias
        notes.append(f"fc.bias folded into embed_tokens (relative residual {residual:.1e})")
    elif bias is not None:
        notes.append("fc.bias is zero: dropped")
    return config, weights, notes


def _eagle3(config: dict, weights: dict, manifest: Manifest | None, target_config: dict | None):
    """EAGLE-3: taps ascending and distinct, vocabulary map as vLLM reads it, no t2d."""
    hidden = int(config.get("target_hidden_size") or config["hidden_size"])
    fc = weights["fc.weight"]
    taps = fc.shape[1] // hidden
    if manifest is not None:
        if manifest.feature.kind != "layer_inputs":
            raise ValueError(f"an EAGLE-3 drafter must tap target layer inputs; this one taps {manifest.feature}")
        layers = list(manifest.feature.layers)
    else:
        num_layers = int((target_config or {}).get("num_hidden_layers", 0))
        if not num_layers:
            raise ValueError("EAGLE-3 drafter without an eyas manifest: pass --target so the tapped layers are known")
        layers = list(FeatureAddress.eagle3(num_layers).layers)
    if taps * hidden != fc.shape[1] or taps != len(layers):
        raise ValueError(f"fc.weight is {tuple(fc.shape)} but the drafter taps layers {layers} of width {hidden}")
    notes = []
    ids = sorted(set(layers))
    blocks = fc.split(hidden, dim=1)
    weights["fc.weight"] = torch.cat([sum(b for b, l in zip(blocks, layers) if l == i) for i in ids], dim=1)
    if ids != layers:
        notes.append(f"taps {layers} rewritten as vLLM's ascending distinct layers {ids} (fc blocks reordered/summed)")
    config = {**config, "eagle_aux_hidden_state_layer_ids": ids, "num_aux_hidden_states": len(ids)}

    vocab, draft_vocab = int(config["vocab_size"]), int(config.get("draft_vocab_size") or config["vocab_size"])
    weights.pop("t2d", None)
    d2t = weights.pop("d2t", None)
    if draft_vocab < vocab:
        if d2t is None:
            raise ValueError(f"draft vocabulary {draft_vocab} < target vocabulary {vocab} but the drafter has no d2t")
        weights["d2t"] = d2t.long()
    elif d2t is not None and bool(d2t.any()):
        target_ids = torch.arange(draft_vocab) + d2t.long()
        if not torch.equal(target_ids.sort().values, torch.arange(vocab)):
            raise ValueError("d2t of a full draft vocabulary must map draft ids one-to-one onto target ids")
        head = torch.empty_like(weights["lm_head.weight"])
        head[target_ids] = weights["lm_head.weight"]
        weights["lm_head.weight"] = head
        notes.append("full draft vocabulary: lm_head rows put in target order, d2t dropped")
    config["draft_vocab_size"] = draft_vocab
    return config, weights, notes


def _target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's input embedding matrix, read from its checkpoint files without building the model."""
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith(EMBED_KEY):
                    return f.get_tensor(name)
    for name, tensor in read_weights(target_dir).items():
        if name.endswith(EMBED_KEY):
            return tensor
    raise CheckpointError(target_dir, ["no *embed_tokens.weight in the target checkpoint"])
