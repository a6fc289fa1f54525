"""The immutable feature-drafting manifest (docs/manifest.md).

A drafter is portable only to the target whose fingerprint (config + weights + tokenizer) and
feature address it was trained on. The manifest carries both, plus dtype policy and ABI versions;
`check_compatible` refuses a pairing and names the first field that differs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .digests import tokenizer_digest
from .tree import TREE_ABI_VERSION

MANIFEST_FILE = "eyas_manifest.json"
DRAFTER_ABI = {"eagle1": "eagle1/1", "eagle3": "eagle3/1"}
# Config keys that describe how a checkpoint was saved or run, not what the model computes.
VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache", "output_router_logits"}


class ManifestMismatch(ValueError):
    """A drafter's manifest does not match the target it is paired with; `field` names the difference."""

    def __init__(self, field: str, expected: object, actual: object):
        super().__init__(
            f"manifest mismatch in {field}: the drafter was built for {expected!r}, the target has {actual!r} "
            "(override explicitly with allow_manifest_mismatch / --allow-manifest-mismatch to run anyway; "
            "the override is then recorded in the manifest)"
        )
        self.field = field


@dataclass(frozen=True)
class FeatureAddress:
    """Where the drafter's features are tapped from the target.

    kind "final_norm_output": the last hidden state after the final norm (EAGLE-1).
    kind "layer_inputs": the inputs of the listed decoder layers, concatenated in order (EAGLE-3),
    i.e. Hugging Face `hidden_states[l]` for each listed l.
    """

    kind: str
    layers: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.kind not in ("final_norm_output", "layer_inputs"):
            raise ValueError(f"feature address kind must be final_norm_output or layer_inputs, got {self.kind!r}")
        if self.kind == "layer_inputs" and not self.layers:
            raise ValueError("a layer_inputs feature address needs at least one layer")
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))

    @classmethod
    def eagle1(cls) -> "FeatureAddress":
        return cls("final_norm_output")

    @classmethod
    def eagle3(cls, num_layers: int, layers: tuple[int, ...] | None = None) -> "FeatureAddress":
        """Default EAGLE-3 taps: inputs of decoder layers 2, N//2 and N-3."""
        return cls("layer_inputs", layers or (2, num_layers // 2, num_layers - 3))

    def width(self, hidden_size: int) -> int:
        return hidden_size * max(1, len(self.layers))


@dataclass(frozen=True)
class TargetFingerprint:
    """What identifies a target: digests of its config, weights and tokenizer, plus readable shape facts."""

    config_digest: str
    weight_digest: str
    tokenizer_digest: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int


@dataclass(frozen=True)
class Manifest:
    """Stored with every drafter (`eyas_manifest.json`); its `id` names it on the wire."""

    target: TargetFingerprint
    feature: FeatureAddress
    drafter_abi: str
    tree_abi: int = TREE_ABI_VERSION
    dtype_policy: dict = field(default_factory=lambda: {"compute": "float32", "softmax_and_loss": "float32"})
    overrides: tuple[str, ...] = ()

    @functools.cached_property
    def id(self) -> str:
        """Content digest of the manifest: equal ids mean an identical contract. Computed once (a manifest is frozen):
        workers check it on every call, and digesting the whole manifest there took about 8% of a draft worker's Python
        time under 8 concurrent requests."""
        return _digest_json(self.to_dict())[:16]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["feature"]["layers"] = list(self.feature.layers)
        data["overrides"] = list(self.overrides)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        return cls(
            target=TargetFingerprint(**data["target"]),
            feature=FeatureAddress(**{**data["feature"], "layers": tuple(data["feature"].get("layers", ()))}),
            drafter_abi=data["drafter_abi"],
            tree_abi=int(data.get("tree_abi", TREE_ABI_VERSION)),
            dtype_policy=dict(data.get("dtype_policy", {})),
            overrides=tuple(data.get("overrides", ())),
        )

    def save(self, directory: str | Path) -> None:
        Path(directory, MANIFEST_FILE).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "Manifest | None":
        path = Path(directory, MANIFEST_FILE)
        return cls.from_dict(json.loads(path.read_text())) if path.exists() else None


def _digest_json(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_digest(config_dict: dict) -> str:
    """Digest of the semantic part of a Hugging Face config."""
    return _digest_json({k: v for k, v in config_dict.items() if k not in VOLATILE_CONFIG_KEYS})


def weight_digest(directory: str | Path) -> str:
    """Digest over every stored tensor (name, dtype, shape, bytes), independent of sharding and file metadata."""
    from safetensors import safe_open

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    digest = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    if files:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
    else:
        for path in sorted(directory.glob("*.bin")):
            tensors.update(torch.load(path, map_location="cpu", weights_only=True))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors or *.bin weights in {directory}")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def fingerprint_target(directory: str | Path, config_dict: dict) -> TargetFingerprint:
    """Fingerprint a target checkpoint directory."""
    text = config_dict.get("text_config") or config_dict
    return TargetFingerprint(
        config_digest=config_digest(config_dict),
        weight_digest=weight_digest(directory),
        tokenizer_digest=tokenizer_digest(directory),
        model_type=str(config_dict.get("model_type", "")),
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
    )


def check_compatible(stored: Manifest, runtime: Manifest, allow_mismatch: bool = False) -> Manifest:
    """Compare a drafter's stored manifest with the one the runtime pairing implies.

    Returns the manifest to run under; with `allow_mismatch` a difference is recorded in its overrides.
    """
    pairs = [(f"target.{k}", v, getattr(runtime.target, k)) for k, v in asdict(stored.target).items()]
    pairs += [
        ("feature", stored.feature, runtime.feature),
        ("drafter_abi", stored.drafter_abi, runtime.drafter_abi),
        ("tree_abi", stored.tree_abi, runtime.tree_abi),
    ]
    differing = [(name, a, b) for name, a, b in pairs if a != b]
    if not differing:
        return replace(stored, dtype_policy=runtime.dtype_policy)
    if not allow_mismatch:
        raise ManifestMismatch(*differing[0])
    notes = tuple(f"override {name}: drafter {a!r} != target {b!r}" for name, a, b in differing)
    warnings.warn("; ".join(notes), stacklevel=2)
    return replace(runtime, overrides=stored.overrides + notes)
