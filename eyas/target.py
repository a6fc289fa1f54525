"""The target adapter: a frozen Hugging Face causal LM that prefills, verifies trees and commits KV rows.

`TargetModel` owns the weights and the feature taps; `TargetSession` owns one request's target KV,
its committed length and version, and the provisional branch rows of the tree being verified.
Row maps come from the flattened tree's metadata, never from token equality.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .errors import VersionError
from .manifest import FeatureAddress, TargetFingerprint, fingerprint_target
from .sampling import SamplingParams
from .tree import FlattenedTree, validate_tree
from .verify import AcceptanceDecision, decide, row_acceptance

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "mixtral")


@dataclass
class TargetOutput:
    """One target forward: logits [N, V] (None when not requested), features [N, F], MoE experts routed."""

    logits: torch.Tensor | None
    features: torch.Tensor
    experts: frozenset[tuple[int, int]]


class TargetModel:
    """A frozen target with feature taps at one declared address, shared by all its sessions."""

    def __init__(
        self,
        model: torch.nn.Module,
        address: FeatureAddress,
        tokenizer=None,
        fingerprint: TargetFingerprint | None = None,
        path: str | None = None,
    ):
        model.eval().requires_grad_(False)
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        if self.config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        self.decoder = model.get_decoder()
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.num_layers = len(self.decoder.layers)
        self.vocab_size = int(self.lm_head.out_features)
        self.hidden_size = int(self.config.hidden_size)
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.path = path
        self.window = self._sliding_window()
        self.address = self._check_address(address)
        self._taps: dict[int, torch.Tensor] = {}
        self._routed: list[torch.Tensor] = []
        self._experts = self._hook_routers()
        for index in set(self.address.layers):
            self.decoder.layers[index].register_forward_pre_hook(self._tap_hook(index), with_kwargs=True)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, address: FeatureAddress | None = None, dtype: torch.dtype = torch.float32
    ) -> "TargetModel":
        """Load a target checkpoint directory (with its tokenizer when present) and fingerprint it."""
        path = Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        config_dict = json.loads((path / "config.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
        return cls(
            model,
            address or FeatureAddress.eagle1(),
            tokenizer=tokenizer,
            fingerprint=fingerprint_target(path, config_dict),
            path=str(path),
        )

    def _sliding_window(self) -> int | None:
        """The attention window applied through the explicit mask, or None for full attention."""
        window = getattr(self.config, "sliding_window", None)
        types = set(getattr(self.config, "layer_types", None) or [])
        if window is None or types == {"full_attention"}:
            return None
        if len(types) > 1:
            raise ValueError("hybrid sliding/full attention layers are not supported by tree verification")
        return int(window)

    def _check_address(self, address: FeatureAddress) -> FeatureAddress:
        for layer in address.layers:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"feature address layer {layer} is outside the target's {self.num_layers} layers")
        return address

    def _tap_hook(self, index: int):
        def hook(module, args, kwargs):
            self._taps[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _hook_routers(self) -> bool:
        """Record the experts each MoE router picks, so a verification can report their union (0x09A)."""
        found = False
        for index, layer in enumerate(self.decoder.layers):
            mlp = getattr(layer, "mlp", None)
            gate = getattr(mlp, "gate", None)
            if gate is None or not hasattr(mlp, "experts"):
                continue
            found = True
            top_k = int(self.config.num_experts_per_tok)

            def hook(module, args, output, index=index, top_k=top_k):
                chosen = output[-1] if isinstance(output, tuple) else torch.topk(output, top_k, dim=-1).indices
                self._routed.append(torch.stack(torch.broadcast_tensors(torch.tensor(index), chosen.flatten()), -1))

            gate.register_forward_hook(hook)
        return found

    @property
    def feature_width(self) -> int:
        return self.address.width(self.hidden_size)

    def attention_mask(self, rows_mask: torch.Tensor, positions: torch.Tensor, prefix_len: int) -> torch.Tensor:
        """[1, 1, N, P + N] bool: every row sees the committed prefix and the rows `rows_mask` allows."""
        n = rows_mask.shape[0]
        mask = torch.ones(n, prefix_len + n, dtype=torch.bool)
        mask[:, prefix_len:] = rows_mask
        if self.window is not None:
            key_positions = torch.cat([torch.arange(prefix_len), positions])
            mask &= (positions[:, None] - key_positions[None, :]) < self.window
        return mask[None, None]

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows_mask: torch.Tensor,
        cache: DynamicCache,
        with_logits: bool = True,
    ) -> TargetOutput:
        """Run N rows on top of the cache (which grows by N rows); tokens, positions: [N], rows_mask: [N, N]."""
        prefix_len = cache.get_seq_length()
        self._taps.clear()
        self._routed.clear()
        out = self.decoder(
            input_ids=tokens[None],
            position_ids=positions[None],
            attention_mask=self.attention_mask(rows_mask, positions, prefix_len),
            past_key_values=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state[0]  # [N, d], after the final norm
        if self.address.kind == "final_norm_output":
            features = hidden  # [N, d]
        else:
            features = torch.cat([self._taps[i][0] for i in self.address.layers], dim=-1)  # [N, d * taps]
        logits = self.lm_head(hidden).float() if with_logits else None  # [N, V]
        experts = frozenset(map(tuple, torch.cat(self._routed).tolist())) if self._routed else frozenset()
        return TargetOutput(logits, features, experts)


    @torch.no_grad()
    def teacher(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training-time forward without a cache: tokens, positions [B, S], mask [B, 1, S, S] bool.

        Returns (features [B, S, F] at the declared address, final-norm hidden states [B, S, d]).
        """
        self._taps.clear()
        out = self.decoder(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False)
        hidden = out.last_hidden_state  # [B, S, d]
        if self.address.kind == "final_norm_output":
            return hidden, hidden
        return torch.cat([self._taps[i] for i in self.address.layers], dim=-1), hidden  # [B, S, d * taps]


def keep_cache_rows(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep only the cache rows listed in `keep` (in that order) in every layer."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(2, keep)
        layer.values = layer.values.index_select(2, keep)


@dataclass
class Verification:
    """What one tree verification yields: the decision, the accepted rows' target features, and costs."""

    decision: AcceptanceDecision
    features: torch.Tensor  # [len(accepted_rows), F], in accepted-row order
    experts: frozenset[tuple[int, int]]
    branch_kv_bytes: int
    row_probs: torch.Tensor | None = None  # [N] conditional acceptance probability of every row (verify.row_acceptance)


class TargetSession:
    """One request's target KV: committed rows, a version, and provisional tree rows until commit."""

    def __init__(self, model: TargetModel):
        self.model = model
        self.cache = DynamicCache()
        self.committed = 0
        self.version = 0
        self.provisional = 0
        self.last_commit: tuple[int, tuple[int, ...]] | None = None

    def _check_version(self, version: int) -> None:
        if version != self.version:
            raise VersionError("target cache", self.version, version)

    def _drop_provisional(self) -> None:
        if self.provisional:
            self.cache.crop(-self.provisional)
            self.provisional = 0

    def prefill(self, version: int, tokens: list[int]) -> torch.Tensor:
        """Commit the KV of `tokens` (everything before the next tree root) at the request's `version`.

        Returns their features [n, F]. Also rebuilds a lost session from a request's committed tokens.
        """
        if self.committed or self.provisional:
            raise RuntimeError("prefill runs once, on an empty target session")
        self.version = version
        if not tokens:
            return torch.empty(0, self.model.feature_width)
        n = len(tokens)
        out = self.model.forward(
            torch.tensor(tokens, dtype=torch.long),
            torch.arange(n),
            torch.ones(n, n, dtype=torch.bool).tril(),
            self.cache,
            with_logits=False,
        )
        self.committed = n
        return out.features

    def verify(
        self, tree: FlattenedTree, version: int, params: SamplingParams, draws: torch.Tensor | None = None
    ) -> Verification:
        """Verify a tree built on `version`: its rows stay provisional until `commit`.

        `draws` replaces the round's own uniforms, as a trace replay does with the recorded ones.
        """
        self._check_version(version)
        validate_tree(tree, vocab_size=self.model.vocab_size, prefix_len=self.committed)
        self._drop_provisional()
        out = self.model.forward(tree.tokens, tree.positions, tree.mask, self.cache)
        self.provisional = tree.num_rows
        decision = decide(tree, out.logits, params, version, draws)
        rows = torch.tensor(decision.accepted_rows, dtype=torch.long)
        return Verification(
            decision, out.features[rows], out.experts, self.kv_bytes(tree.num_rows), row_acceptance(tree, out.logits, params)
        )

    def commit(self, version: int, accepted_rows: tuple[int, ...]) -> None:
        """Keep the KV of the accepted rows (in path order), drop the other branch rows; idempotent per version."""
        accepted_rows = tuple(int(r) for r in accepted_rows)
        if self.last_commit == (version, accepted_rows) and self.version == version + 1:
            return
        self._check_version(version)
        if not accepted_rows or accepted_rows[0] != 0 or any(not 0 <= r < self.provisional for r in accepted_rows):
            raise ValueError(f"accepted_rows: {list(accepted_rows)} is not a path of the {self.provisional} verified rows")
        keep = torch.cat([torch.arange(self.committed), self.committed + torch.tensor(accepted_rows)])
        keep_cache_rows(self.cache, keep)
        self.committed += len(accepted_rows)
        self.provisional = 0
        self.version = version + 1
        self.last_commit = (version, accepted_rows)

    def kv_bytes(self, rows: int | None = None) -> int:
        """Bytes of target KV held for `rows` rows (all rows when None)."""
        total = 0
        for layer in self.cache.layers:
            if layer.keys is None or not layer.keys.numel():
                continue
            per_row = (layer.keys[:, :, :1].numel() + layer.values[:, :, :1].numel()) * layer.keys.element_size()
            total += per_row * (layer.keys.shape[2] if rows is None else rows)
        return total
