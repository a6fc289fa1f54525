"""The Llama-family forward eyas serves with (docs/runtime.md, "The forward"): Llama, Qwen2, Qwen3, Mistral and
Mixtral from a local Hugging Face directory, weights fused at load, each layer TorchScript blocks, feature taps as
return values; with a `Shard`, one rank of a tensor-parallel group (docs/groups.md)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..drafters.layers import rms_norm, rotate, rotary_tables
from .kv import TREE_HEADROOM, Writes, attend, write_rows
from .linear import Linear, linear
from .script import script
from .shard import Shard, check_shardable, dims, shard_selection
from .weights import WeightsError, load_state, router_name, take, take_experts, take_optional

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "mixtral")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")  # the MLP activations `activate` computes, by config name
# No `from __future__ import annotations` here: TorchScript reads the NamedTuples' field types at run time.


def activation(name: str) -> str:
    """A config's `hidden_act`, refused unless `activate` computes it."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not one of {ACTIVATIONS}")
    return name


def activate(x: torch.Tensor, name: str) -> torch.Tensor:
    """The MLP activation a config names (one of ACTIVATIONS), as Hugging Face computes it."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.relu(x)


class AttentionWeights(NamedTuple):
    """`attention_block`'s weights: input norm (None: x comes normed), q/k/v [(H + 2 KVH) hd, in] with bias and
    oneDNN copy, Qwen3's q/k norms [H + KVH, hd], o [d, H hd] with copy and bias (None: added after the ranks' sum)."""

    norm: Optional[torch.Tensor]
    qkv_weight: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    qkv_packed: Optional[torch.Tensor]
    qk_norm: Optional[torch.Tensor]
    o_weight: torch.Tensor
    o_packed: Optional[torch.Tensor]
    o_bias: Optional[torch.Tensor]


class MLPWeights(NamedTuple):
    """`mlp_block`'s weights: post-attention norm (None: x comes normed), gate/up [2I, d] and down [d, I], each with
    its oneDNN copy."""

    norm: Optional[torch.Tensor]
    gate_up_weight: torch.Tensor
    gate_up_packed: Optional[torch.Tensor]
    down_weight: torch.Tensor
    down_packed: Optional[torch.Tensor]


class AttentionInputs(NamedTuple):
    """What a forward's rows attend with in every layer: cos, signed sin [B, N, 1, hd]; the mask [B, 1, N, K], bool
    or additive; the pool kv [L, 2, S, KVH, T, hd] that `writes` addresses, or None to attend to the new rows alone."""

    cos: torch.Tensor
    sin: torch.Tensor
    bias: torch.Tensor
    kv: Optional[torch.Tensor]
    writes: Optional[Writes]


@script
def attention_block(x: torch.Tensor, w: AttentionWeights, heads: int, kv_heads: int, eps: float, at: AttentionInputs, index: int) -> torch.Tensor:
    """x [B, N, in], layer `index` -> o's product [B, N, d] (a tensor-parallel rank's part: the ranks' sum follows)."""
    b, n = x.shape[0], x.shape[1]
    hd = w.qkv_weight.shape[0] // (heads + 2 * kv_heads)
    if w.norm is not None:
        x = rms_norm(x, w.norm, eps)
    qkv = linear(x, w.qkv_weight, w.qkv_bias, w.qkv_packed).view(b, n, heads + 2 * kv_heads, hd)
    qk, v = qkv.split([heads + kv_heads, kv_heads], dim=2)  # q and k rotate together
    qk_norm = w.qk_norm
    if qk_norm is not None:
        qk = rms_norm(qk, None, eps) * qk_norm
    q, k = rotate(qk, at.cos, at.sin).transpose(1, 2).split([heads, kv_heads], dim=1)  # [B, H, N, hd], [B, KVH, N, hd]
    v = v.transpose(1, 2)  # [B, KVH, N, hd]
    kv, writes = at.kv, at.writes
    gqa = kv_heads != heads
    if kv is None or writes is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=at.bias, enable_gqa=gqa)  # [B, H, N, hd]
    else:
        layer_kv = kv[index]
        write_rows(layer_kv, writes, k, v)
        if q.dtype != layer_kv.dtype:
            q = q.to(layer_kv.dtype)  # the pool's attention dtype (float32 on CPU, see attention_dtype)
        out = attend(q, layer_kv, writes, at.bias, gqa)  # [B, H, N, hd]
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return linear(out.transpose(1, 2).reshape(b, n, heads * hd), w.o_weight, w.o_bias, w.o_packed)


@script
def mlp_block(x: torch.Tensor, w: MLPWeights, act: str, eps: float) -> torch.Tensor:
    """x [B, N, d] -> the dense MLP's output [B, N, d] (a rank's part)."""
    if w.norm is not None:
        x = rms_norm(x, w.norm, eps)
    gate, up = linear(x, w.gate_up_weight, None, w.gate_up_packed).chunk(2, dim=-1)
    return linear(activate(gate, act) * up, w.down_weight, None, w.down_packed)


@script
def residual_layer(
    x: torch.Tensor, residual: torch.Tensor, attention: AttentionWeights, mlp: MLPWeights, heads: int, kv_heads: int, act: str, eps: float, at: AttentionInputs, index: int
) -> torch.Tensor:
    """A dense layer: `residual` [B, N, d] + attention over `x` [B, N, in] (x itself in a decoder layer), then + MLP."""
    h = residual + attention_block(x, attention, heads, kv_heads, eps, at, index)
    return h + mlp_block(h, mlp, act, eps)


@script
def dense_layers(
    x: torch.Tensor, attention: list[AttentionWeights], mlp: list[MLPWeights], heads: int, kv_heads: int, act: str, eps: float, at: AttentionInputs, taps: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every layer of a dense model on one rank: x [B, N, d] -> the last layer's output [B, N, d] and the inputs of
    the layers in `taps`, in layer order."""
    tapped: list[torch.Tensor] = []
    for index in range(len(attention)):
        if index in taps:
            tapped.append(x)
        x = residual_layer(x, x, attention[index], mlp[index], heads, kv_heads, act, eps, at, index)
    return x, tapped


@dataclass
class Layer:
    """One decoder layer's fused weights."""

    input_norm: torch.Tensor
    qkv: Linear  # [(H + 2 KVH) hd, d], with the q/k/v biases where the model has them
    o: Linear  # [d, H hd]
    o_bias: torch.Tensor | None  # [d], added once after the ranks' partial sums
    qk_norm: torch.Tensor | None  # [H + KVH, hd]: Qwen3's q_norm on every q head, k_norm on every k head
    post_norm: torch.Tensor
    gate_up: Linear | torch.Tensor  # dense [2I, d], or experts [E, 2I, d] (sliced per call)
    down: Linear | torch.Tensor  # dense [d, I], or experts [E, d, I]
    router: torch.Tensor | None = None  # [E, d] (Mixtral)

    def __post_init__(self) -> None:
        # the blocks' weights (o's bias is added after the ranks' sum, outside the block)
        qkv, o = self.qkv, self.o
        self.attention_weights = AttentionWeights(self.input_norm, qkv.weight, qkv.bias, qkv.packed, self.qk_norm, o.weight, o.packed, None)
        self.mlp_weights = None
        if isinstance(self.gate_up, Linear):
            self.mlp_weights = MLPWeights(self.post_norm, self.gate_up.weight, self.gate_up.packed, self.down.weight, self.down.packed)


@dataclass
class ForwardOut:
    hidden: torch.Tensor  # [B, N, d] after the final norm
    taps: list[torch.Tensor]  # inputs of the requested layers, each [B, N, d]
    routed: list[torch.Tensor]  # MoE: chosen experts per layer, each [B, N, top_k]


class CausalLM:
    """A frozen Llama-family decoder with fused weights on one device; `forward` runs packed rows over a KV batch.
    With a `shard` of N > 1 ranks it holds one rank's part (`heads`, `kv_heads`, `local_experts` are this rank's)."""

    def __init__(self, config, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, shard: Shard = Shard()):
        check_shardable(config, shard.size)
        self.config = config
        self.shard = shard
        self.model_type = config.model_type
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        self.dtype, self.device = dtype, device
        self.vocab_size = int(config.vocab_size)
        self.hidden_size = d = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        heads, kv_heads, hd = dims(config)
        self.heads, self.kv_heads, self.head_dim = heads // shard.size, kv_heads // shard.size, hd  # this rank's
        self.eps = float(config.rms_norm_eps)
        self.act = activation(str(config.hidden_act))
        self.experts = int(getattr(config, "num_local_experts", 0) or 0)
        self.local_experts = shard.span(self.experts)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        inner = int(config.intermediate_size)
        inner_local = inner if self.experts else inner // shard.size  # experts stay whole (expert parallel)
        vocab_local = self.vocab_size // shard.size
        qkv_rows = (self.heads + 2 * self.kv_heads) * hd

        def fetch(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            return take(state, name, shape).to(device)

        def fetch_optional(name: str) -> torch.Tensor | None:
            tensor = take_optional(state, name)
            return None if tensor is None else tensor.to(device)

        self.embed = fetch("embed_tokens.weight", (vocab_local, d))
        self.layers: list[Layer] = []
        for i in range(self.num_layers):
            p = f"layers.{i}"
            qkv = torch.cat([take(state, f"{p}.self_attn.{x}_proj.weight") for x in "qkv"])  # [(H + 2 KVH) hd, d]
            if qkv.shape != (qkv_rows, d):
                raise WeightsError(f"{p}.self_attn: fused q/k/v has shape {tuple(qkv.shape)}, expected {(qkv_rows, d)}")
            biases = [take_optional(state, f"{p}.self_attn.{x}_proj.bias") for x in "qkv"]
            qkv_bias = torch.cat(biases).to(device) if all(b is not None for b in biases) else None
            if self.experts:
                router = fetch(router_name(state, p), (self.experts, d))
                gate_up, down = (w.to(device) for w in take_experts(state, p, self.local_experts, d, inner))
            else:
                router = None
                gate_up = Linear(torch.cat([take(state, f"{p}.mlp.{x}_proj.weight", (inner_local, d)) for x in ("gate", "up")]).to(device))  # [2I, d]
                down = Linear(fetch(f"{p}.mlp.down_proj.weight", (d, inner_local)))
            self.layers.append(
                Layer(
                    input_norm=fetch(f"{p}.input_layernorm.weight", (d,)),
                    qkv=Linear(qkv.to(device), qkv_bias),
                    o=Linear(fetch(f"{p}.self_attn.o_proj.weight", (d, self.heads * hd))),
                    o_bias=fetch_optional(f"{p}.self_attn.o_proj.bias"),
                    qk_norm=self._qk_norm(fetch_optional(f"{p}.self_attn.q_norm.weight"), fetch_optional(f"{p}.self_attn.k_norm.weight")),
                    post_norm=fetch(f"{p}.post_attention_layernorm.weight", (d,)),
                    gate_up=gate_up,
                    down=down,
                    router=router,
                )
            )
        self.norm = fetch("norm.weight", (d,))
        # one scripted call for every layer where nothing runs between the blocks: one rank, dense MLPs, no o bias
        self.whole_layers = shard.size == 1 and not self.experts and all(layer.o_bias is None for layer in self.layers)
        self.attention_weights = [layer.attention_weights for layer in self.layers]  # what `dense_layers` multiplies by
        self.mlp_weights = [layer.mlp_weights for layer in self.layers]
        head = take_optional(state, "lm_head.weight")
        if head is None:
            if not getattr(config, "tie_word_embeddings", False):
                raise WeightsError("missing tensor lm_head.weight and the embeddings are not tied")
            self.lm_head = self.embed
        else:
            self.lm_head = head.to(device)
        self.head = Linear(self.lm_head)  # what `logits` multiplies by; `lm_head` stays a tensor for the drafter to bind
        cos, sin = rotary_tables(LlamaRotaryEmbedding(config), max(self.max_positions, 1) + TREE_HEADROOM)  # [P, hd]
        self.cos, self.signed_sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    def _qk_norm(self, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None) -> torch.Tensor | None:
        """Qwen3's q and k norm weights [hd] laid out over the q and k heads [H + KVH, hd], so one product scales both."""
        if q_norm is None and k_norm is None:
            return None
        if q_norm is None or k_norm is None:
            raise WeightsError("q_norm and k_norm come together: one of them is missing")
        return torch.cat([q_norm.expand(self.heads, -1), k_norm.expand(self.kv_heads, -1)])

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", shard: Shard = Shard()
    ) -> "CausalLM":
        """Load a local Hugging Face directory (config.json + safetensors) onto `device` in `dtype`; a rank of a
        tensor-parallel group reads only its `shard` of each tensor."""
        path = Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{path}: model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        config = AutoConfig.from_pretrained(path).get_text_config(decoder=True)
        check_shardable(config, shard.size)
        state = load_state(path, dtype, lambda name: shard_selection(name, config, shard))
        return cls(config, state, dtype, torch.device(device), shard)

    def sliding_window(self) -> int | None:
        """The attention window every layer applies, or None for full attention."""
        window = getattr(self.config, "sliding_window", None)
        types = set(getattr(self.config, "layer_types", None) or [])
        if window is None or types == {"full_attention"} or getattr(self.config, "use_sliding_window", True) is False:
            return None
        if len(types) > 1:
            raise ValueError("hybrid sliding/full attention layers are not supported by tree verification")
        return int(window)

    def attention(self, layer: Layer, index: int, x: torch.Tensor, at: AttentionInputs) -> torch.Tensor:
        """x [B, N, d] (the residual stream) -> the attention's output [B, N, d], summed over the ranks."""
        out = attention_block(x, layer.attention_weights, self.heads, self.kv_heads, self.eps, at, index)
        out = self.shard.all_reduce(out)  # [B, N, d], summed over the ranks' heads
        return out if layer.o_bias is None else out + layer.o_bias

    def mlp(self, layer: Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, N, d] (the residual stream) -> the MLP's output [B, N, d], and the experts each row chose (MoE)."""
        if layer.mlp_weights is not None:
            return self.shard.all_reduce(mlp_block(x, layer.mlp_weights, self.act, self.eps)), None
        flat = rms_norm(x, layer.post_norm, self.eps).reshape(-1, x.shape[-1])  # [R, d]
        probs = F.softmax(F.linear(flat, layer.router).float(), dim=-1)  # [R, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [R, top_k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for expert in chosen.unique().tolist():
            if expert not in self.local_experts:
                continue  # another rank's expert: its rows arrive through the all-reduce
            rows, slot = torch.where(chosen == expert)
            local = expert - self.local_experts.start
            gate, up = F.linear(flat[rows], layer.gate_up[local]).chunk(2, dim=-1)
            y = F.linear(activate(gate, self.act) * up, layer.down[local]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return self.shard.all_reduce(out).view_as(x), chosen.view(*x.shape[:-1], self.top_k)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv, mask: torch.Tensor, taps: tuple[int, ...] = ()) -> ForwardOut:
        """tokens, positions [B, N]; mask [B, 1, N, K] bool over the K slot positions `kv` reads."""
        x = self.shard.embed(tokens, self.embed)  # [B, N, d]
        cos, sin = self.cos[positions][:, :, None], self.signed_sin[positions][:, :, None]  # [B, N, 1, hd]
        bias = torch.zeros(mask.shape, dtype=kv.dtype or self.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        at = AttentionInputs(cos, sin, bias, *kv.scripted())
        if self.whole_layers:
            x, tapped = dense_layers(x, self.attention_weights, self.mlp_weights, self.heads, self.kv_heads, self.act, self.eps, at, list(taps))
            routed = []
        else:
            x, tapped, routed = self._layers(x, at, taps)
        return ForwardOut(rms_norm(x, self.norm, self.eps), [tapped[sorted(set(taps)).index(i)] for i in taps], routed)

    def _layers(self, x: torch.Tensor, at: AttentionInputs, taps: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The layers block by block, with a group's all-reduces, o's bias and MoE routing between them: x [B, N, d]
        -> the last layer's output, the tapped inputs and each MoE layer's chosen experts."""
        tapped, routed = [], []
        for index, layer in enumerate(self.layers):
            if index in taps:
                tapped.append(x)
            x = x + self.attention(layer, index, x, at)
            y, chosen = self.mlp(layer, x)
            x = x + y
            if chosen is not None:
                routed.append(chosen)
        return x, tapped, routed

    def tensors(self) -> list[torch.Tensor]:
        """Every weight tensor (each once), e.g. to count the bytes the model holds."""
        held = [self.embed, self.norm, self.lm_head, *self.head.tensors()]
        for value in (v for layer in self.layers for v in vars(layer).values()):
            if isinstance(value, Linear):
                held += value.tensors()
            elif isinstance(value, torch.Tensor):
                held.append(value)
        unique = {id(t): t for t in held}
        return list(unique.values())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] final hidden states -> [..., V] float32 logits (every rank of a group takes part)."""
        return self.shard.gather_last(self.head(hidden).float())
