"""Drafter checkpoints in the official EAGLE layouts (docs/drafters.md#checkpoints): config.json + safetensors.

Loading checks every key against the architecture the config describes and reports missing,
unexpected and mis-shaped keys together; it refuses a reduced draft vocabulary without d2t and a
stored embedding that differs from the target's beyond the rounding of the two dtypes. A `.bin` is
read only with weights_only=True.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from .base import Drafter
from .eagle1 import Eagle1Drafter
from .eagle3 import Eagle3Drafter

WEIGHTS_FILE = "model.safetensors"
ARCHITECTURES = {"eagle1": "LlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}
EMBED_KEY = "embed_tokens.weight"


@dataclass
class LoadReport:
    """What loading found besides the expected keys; `problems()` lists what makes the checkpoint unusable."""

    kind: str = ""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    misshaped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        return (
            [f"missing key {k}" for k in self.missing]
            + [f"unexpected key {k}" for k in self.unexpected]
            + [f"mis-shaped key {k}" for k in self.misshaped]
        )


class CheckpointError(ValueError):
    """A drafter checkpoint cannot be used as is; the message lists every problem found."""

    def __init__(self, path: str | Path, problems: list[str], report: LoadReport | None = None):
        super().__init__(f"drafter checkpoint {path}: " + "; ".join(problems))
        self.problems = problems
        self.report = report


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: safetensors files, else .bin files loaded with weights_only."""
    files = sorted(path.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            weights.update(load_file(str(f)))
        return weights
    for f in sorted(path.glob("*.bin")):
        weights.update(torch.load(f, map_location="cpu", weights_only=True))
    if not weights:
        raise CheckpointError(path, ["no *.safetensors or *.bin weights found"])
    return weights


def detect_kind(config: dict, keys: set[str], path: str | Path = "") -> str:
    """EAGLE-3 checkpoints have a midlayer (or declare a draft vocabulary); EAGLE-1 ones have layers.0.

    A full causal LM (a target: model.layers.*, no fc; its LM head may be tied to the embedding) is refused by
    name, not key by key.
    """
    if "fc.weight" not in keys and any(k.startswith("model.layers.") for k in keys):
        raise CheckpointError(path, ["this is a target model (a full causal LM with model.layers.*), not a drafter"])
    if any(k.startswith("midlayer.") for k in keys) or "draft_vocab_size" in config:
        return "eagle3"
    return "eagle1"


def build_drafter(kind: str, config: LlamaConfig) -> Drafter:
    """An untrained drafter of the given kind for a Llama-style config."""
    if kind == "eagle1":
        return Eagle1Drafter(config)
    if kind == "eagle3":
        return Eagle3Drafter(config)
    raise ValueError(f"drafter kind must be eagle1 or eagle3, got {kind!r}")


def load_drafter(path: str | Path, embed: torch.nn.Embedding, lm_head: torch.nn.Linear) -> tuple[Drafter, LoadReport]:
    """Load a drafter directory and bind it to the target's frozen embedding and LM head."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(path, ["no config.json"])
    config_dict = json.loads((path / "config.json").read_text())
    weights = read_weights(path)
    kind = detect_kind(config_dict, set(weights), path)
    report = LoadReport(kind=kind)
    config = LlamaConfig(**{k: v for k, v in config_dict.items() if k != "architectures"})
    drafter = build_drafter(kind, config)
    problems: list[str] = []

    if kind == "eagle1" and drafter.fc.bias is None and "fc.bias" in weights:
        weights.pop("fc.bias")
        report.ignored.append("fc.bias (config says bias: false)")
    if kind == "eagle3":
        problems += _complete_vocab_map(drafter, weights, int(lm_head.out_features))
    stored_embed = weights.pop(EMBED_KEY, None)

    expected = drafter.state_dict()
    report.missing = sorted(set(expected) - set(weights))
    report.unexpected = sorted(set(weights) - set(expected))
    report.misshaped = sorted(
        f"{k} (expected {tuple(expected[k].shape)}, got {tuple(weights[k].shape)})"
        for k in set(expected) & set(weights)
        if expected[k].shape != weights[k].shape
    )
    problems += report.problems()
    problems += _check_target_shapes(drafter, embed, lm_head)
    if stored_embed is not None and stored_embed.shape == embed.weight.shape:
        if not same_up_to_rounding(stored_embed, embed.weight.detach()):
            diff = (stored_embed.double() - embed.weight.detach().double()).abs().max().item()
            problems.append(
                f"{EMBED_KEY} differs from the target's embedding beyond the rounding of {stored_embed.dtype} and "
                f"{embed.weight.dtype} (max abs difference {diff:.3g})"
            )
    elif stored_embed is not None:
        problems.append(f"{EMBED_KEY} has shape {tuple(stored_embed.shape)}, the target's is {tuple(embed.weight.shape)}")
    if problems:
        raise CheckpointError(path, problems, report)
    drafter.load_state_dict(weights)
    drafter.eval().requires_grad_(False)
    return drafter.bind_target(embed, lm_head), report


def same_up_to_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two floating-point copies of one tensor agree within one unit in the last place of each one's dtype
    (e.g. a float32 embedding stored with a drafter, and the target's bound in bfloat16)."""
    scale = torch.maximum(a.double().abs(), b.double().abs())
    ulps = torch.finfo(a.dtype).eps + torch.finfo(b.dtype).eps
    tiny = torch.finfo(a.dtype).tiny + torch.finfo(b.dtype).tiny  # subnormals carry no relative precision
    return bool(((a.double() - b.double()).abs() <= ulps * scale + tiny).all())


def _complete_vocab_map(drafter: Eagle3Drafter, weights: dict[str, torch.Tensor], vocab_size: int) -> list[str]:
    """Fill d2t/t2d for a full draft vocabulary; refuse a reduced one that lacks d2t."""
    if "d2t" not in weights:
        if drafter.draft_vocab_size != vocab_size:
            return [
                f"d2t is missing but the draft vocabulary ({drafter.draft_vocab_size}) is smaller than the "
                f"target's ({vocab_size}): draft ids cannot be mapped to target ids"
            ]
        weights["d2t"] = torch.zeros(vocab_size, dtype=torch.long)
    if "t2d" not in weights:
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[torch.arange(weights["d2t"].numel()) + weights["d2t"].long()] = True
        weights["t2d"] = t2d
    return []


def _check_target_shapes(drafter: Drafter, embed: torch.nn.Embedding, lm_head: torch.nn.Linear) -> list[str]:
    """The drafter's widths and vocabulary must fit the target it is bound to."""
    problems = []
    vocab, target_d = embed.weight.shape
    if int(drafter.config.vocab_size) != vocab:
        problems.append(f"vocab_size {drafter.config.vocab_size} differs from the target's {vocab}")
    if drafter.hidden_size != target_d:
        problems.append(f"hidden_size {drafter.hidden_size} differs from the target embedding width {target_d}")
    if isinstance(drafter, Eagle3Drafter) and drafter.target_hidden_size != target_d:
        problems.append(f"target_hidden_size {drafter.target_hidden_size} differs from the target's {target_d}")
    if isinstance(drafter, Eagle1Drafter) and lm_head.in_features != drafter.hidden_size:
        problems.append(f"target lm_head reads width {lm_head.in_features}, the drafter emits {drafter.hidden_size}")
    return problems


def drafter_config(kind: str, target_config, **overrides) -> LlamaConfig:
    """A one-layer Llama config for a drafter of `kind` sized to the target (used when training a new one)."""
    base = {
        "vocab_size": target_config.vocab_size,
        "hidden_size": target_config.hidden_size,
        "intermediate_size": target_config.intermediate_size,
        "num_attention_heads": target_config.num_attention_heads,
        "num_key_value_heads": target_config.num_key_value_heads,
        "head_dim": getattr(target_config, "head_dim", None)
        or target_config.hidden_size // target_config.num_attention_heads,
        "rms_norm_eps": target_config.rms_norm_eps,
        "max_position_embeddings": target_config.max_position_embeddings,
        "rope_parameters": dict(target_config.rope_parameters),
        "hidden_act": target_config.hidden_act,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    if kind == "eagle1":
        base.update(bias=True, qkv_bias=False)
    else:
        base.update(draft_vocab_size=target_config.vocab_size, target_hidden_size=target_config.hidden_size)
    base.update(overrides)
    return LlamaConfig(**base)


def save_drafter(drafter: Drafter, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json and model.safetensors in the official layout of the drafter's kind."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = drafter.config.to_dict()
    config["architectures"] = [ARCHITECTURES[drafter.kind]]
    config["num_hidden_layers"] = 1
    if isinstance(drafter, Eagle1Drafter):
        config["bias"] = drafter.fc.bias is not None
    if isinstance(drafter, Eagle3Drafter):
        config["draft_vocab_size"] = drafter.draft_vocab_size
        config["target_hidden_size"] = drafter.target_hidden_size
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {}
    for name, tensor in drafter.state_dict().items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
