"""Tiny random Hugging Face targets and EAGLE drafters, built on disk by the tests that need them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from eyas.drafters import build_drafter, drafter_config, save_drafter
from eyas.manifest import DRAFTER_ABI, FeatureAddress, Manifest
from eyas.target import TargetModel
from eyas.tree import DraftTree, FlattenedTree, flatten

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
EXTRA = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
}


def make_target(directory: Path, model_type: str = "llama", seed: int = 0, init_std: float = 0.1, **overrides) -> Path:
    """Save a random target of `model_type`; a larger init_std gives peaked, tie-free next-token distributions."""
    config = AutoConfig.for_model(model_type, **{**COMMON, **EXTRA[model_type], **overrides})
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(directory)
    return Path(directory)


def make_drafter(
    directory: Path,
    target_dir: Path,
    kind: str = "eagle1",
    seed: int = 1,
    std: float = 0.05,
    embedding: torch.dtype | None = None,
    **overrides,
) -> Path:
    """Save a random drafter of `kind` for the target in `target_dir`, with its manifest; `embedding` also stores a
    copy of the target's embedding in that dtype (`embed_tokens.weight`, as official EAGLE-1 checkpoints do)."""
    target = TargetModel.from_pretrained(target_dir)
    address = FeatureAddress.eagle1() if kind == "eagle1" else FeatureAddress.eagle3(target.num_layers)
    torch.manual_seed(seed)
    drafter = build_drafter(kind, drafter_config(kind, target.config, **overrides))
    for p in drafter.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
    save_drafter(drafter, directory)
    if embedding is not None:
        weights = load_file(str(directory / "model.safetensors"))
        weights["embed_tokens.weight"] = target.embed.weight.detach().to(embedding).contiguous()
        save_file(weights, str(directory / "model.safetensors"))
    Manifest(target=target.fingerprint, feature=address, drafter_abi=DRAFTER_ABI[kind]).save(directory)
    return Path(directory)


def write_word_text(path: Path, docs: int, lengths: tuple[int, int], seed: int = 0) -> Path:
    """A JSONL file of `docs` {"text": "w5 w17 ..."} documents of random lengths, for targets with add_tokenizer's words."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(f"w{rng.randint(5, 95)}" for _ in range(rng.randint(*lengths)))}) + "\n")
    return Path(path)


def add_tokenizer(directory: Path, vocab_size: int = 96, shift: int = 0) -> None:
    """Save a word-level tokenizer over tokens "w0".."w{n-1}" (ids rotated by `shift`) into a model directory."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": (i + shift) % vocab_size for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"unk_token": "w0", "eos_token": "w2"}  # whole words only: "w20" must not split into "w2" "0"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, **{k: AddedToken(v, single_word=True) for k, v in special.items()}
    )
    tokenizer.save_pretrained(directory)


def random_tree(root: int, prefix_len: int, seed: int = 0) -> FlattenedTree:
    """A random three-level tree of 10 rows (3 children per expanded node) on a committed prefix."""
    generator = torch.Generator().manual_seed(seed)
    tree = DraftTree(root)
    expanded = [0]
    for depth in range(3):
        if depth:
            expanded = tree.expandable(3)
        children = []
        for node in expanded:
            tokens = torch.randperm(90, generator=generator)[:3].tolist()
            children += [(node, t, 0.3) for t in tokens]
        tree.add_children(expanded, children)
    return flatten(tree, tree.select(10), prefix_len)
