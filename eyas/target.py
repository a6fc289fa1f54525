"""The target on eyas's runtime: `TargetModel` (weights, feature taps, the KV pool) and `TargetSession` (one
request's slot, committed rows, version and provisional tree rows; docs/runtime.md, "The KV pool"). In a
tensor-parallel group rank 0 leads and the other ranks `follow` (docs/groups.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from .errors import VersionError
from .manifest import FeatureAddress, TargetFingerprint, fingerprint_target
from .rounds import Verification
from .runtime.batch import Packed, RowsCall, pack, padding_groups, split_rows
from .runtime.device import attention_dtype
from .runtime.graphs import Graphs
from .runtime.kv import TREE_HEADROOM, KVPool
from .runtime.linear import Linear, packs
from .runtime.model import CausalLM, ForwardOut
from .runtime.script import unoptimized
from .runtime.shard import RankSteps, Shard
from .sampling import SamplingParams
from .steps import Forward, Steps, run_alone
from .tree import FlattenedTree
from .verify import decide

DEFAULT_KV_SLOTS = 8


@dataclass
class TargetOutput:
    """One call's rows of a target forward: logits [N, V] (None when not requested), features [N, F], MoE experts."""

    logits: torch.Tensor | None
    features: torch.Tensor
    experts: frozenset[tuple[int, int]]


@dataclass
class TargetCall:
    rows: RowsCall
    with_logits: bool = True


class TargetModel:
    """A frozen target with feature taps at one declared address and the KV pool its sessions share."""

    def __init__(
        self,
        model: CausalLM,
        address: FeatureAddress,
        tokenizer=None,
        fingerprint: TargetFingerprint | None = None,
        path: str | None = None,
        generation_config: GenerationConfig | None = None,
        kv_slots: int = DEFAULT_KV_SLOTS,
        max_seq_len: int | None = None,
        graphs: bool | None = None,
    ):
        """`graphs`: the forwards as CUDA graphs (None: on CUDA for a whole, dense model; True on a CPU: the same
        fixed-shape batches, eagerly)."""
        self.runtime = model
        self.config = model.config
        self.num_layers = model.num_layers
        self.vocab_size = model.vocab_size
        self.hidden_size = model.hidden_size
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.path = path
        self.generation_config = generation_config
        self.window = model.sliding_window()
        self.address = self._check_address(address)
        self.taps = () if address.kind == "final_norm_output" else address.layers
        self.max_seq_len = max_seq_len or model.max_positions  # tokens one request may hold
        slot_len = self.max_seq_len + TREE_HEADROOM
        kv_dtype = attention_dtype(model.dtype, model.device)
        self.pool = KVPool(model.num_layers, model.kv_heads, model.head_dim, kv_slots, slot_len, kv_dtype, model.device, "target KV")
        self.bucketed = packs(model.dtype, model.device)  # batches padded to oneDNN's row buckets
        self.ranks = RankSteps(model.shard, {"run": self.run_local, "move": self.pool.move_rows})
        capturable = model.shard.size == 1 and not model.experts
        on_cuda = model.device.type == "cuda"
        if graphs is None:
            graphs = capturable and on_cuda
        elif graphs and not capturable:
            raise ValueError("graphs: a tensor-parallel rank or an MoE target runs its forwards eagerly")
        self.graphs = Graphs(self._hidden, model.device) if graphs else None

    @property
    def embed(self) -> torch.nn.Embedding:
        """The token embedding, for a drafter bound to this target (a whole model only)."""
        self._check_whole("embed")
        return torch.nn.Embedding.from_pretrained(self.runtime.embed, freeze=True)

    @property
    def lm_head(self) -> torch.nn.Linear:
        """The LM head, for a drafter bound to this target (a whole model only)."""
        self._check_whole("lm_head")
        head = torch.nn.Linear(self.hidden_size, self.vocab_size, bias=False, device=self.runtime.device, dtype=self.runtime.dtype)
        head.weight = torch.nn.Parameter(self.runtime.lm_head, requires_grad=False)
        return head

    @property
    def head(self) -> Linear:
        """The LM head as verification multiplies by it, for a drafter bound to this target in process to share."""
        self._check_whole("head")
        return self.runtime.head

    def _check_whole(self, what: str) -> None:
        if self.runtime.shard.size > 1:
            raise ValueError(f"{what}: rank {self.runtime.shard.rank} holds only a vocabulary shard of the target")

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        address: FeatureAddress | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_slots: int = DEFAULT_KV_SLOTS,
        max_seq_len: int | None = None,
        shard: Shard = Shard(),
        graphs: bool | None = None,
    ) -> "TargetModel":
        """Load a target directory (and its tokenizer when present) and fingerprint it; a group's rank loads its
        `shard`."""
        path = Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        config_dict = json.loads((path / "config.json").read_text())
        model = CausalLM.from_pretrained(path, dtype=dtype, device=device, shard=shard)
        tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
        generation = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").exists() else None
        return cls(
            model,
            address or FeatureAddress.eagle1(),
            tokenizer=tokenizer,
            fingerprint=fingerprint_target(path, config_dict),
            path=str(path),
            generation_config=generation,
            kv_slots=kv_slots,
            max_seq_len=max_seq_len,
            graphs=graphs,
        )

    def _check_address(self, address: FeatureAddress) -> FeatureAddress:
        for layer in address.layers:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"feature address layer {layer} is outside the target's {self.num_layers} layers")
        return address

    @property
    def feature_width(self) -> int:
        return self.address.width(self.hidden_size)

    def visible(self, rows_mask: torch.Tensor, positions: torch.Tensor, prefix_len: int) -> torch.Tensor:
        """[N, P + N] bool: every row sees the committed prefix (within the window) and the rows `rows_mask` allows."""
        n = rows_mask.shape[0]
        mask = torch.ones(n, prefix_len + n, dtype=torch.bool)
        mask[:, prefix_len:] = rows_mask
        if self.window is not None:
            key_positions = torch.cat([torch.arange(prefix_len), positions])
            mask &= (positions[:, None] - key_positions[None, :]) < self.window
        return mask

    def call(self, slot: int, prefix_len: int, tokens: torch.Tensor, positions: torch.Tensor, rows_mask: torch.Tensor, with_logits: bool = True) -> TargetCall:
        """N rows written right after a slot's `prefix_len` committed rows; tokens, positions [N], rows_mask [N, N]."""
        return TargetCall(RowsCall(slot, prefix_len, tokens, positions, self.visible(rows_mask, positions, prefix_len)), with_logits)

    def rows(self, call: TargetCall) -> int:
        """Rows `call` adds to a batch (its share of the row budget)."""
        return int(call.rows.tokens.shape[0])

    def run(self, calls: list[TargetCall]) -> list[TargetOutput]:
        """The rows of every call (each in its own slot) -> each call's logits, features, experts; on every rank."""
        return self.ranks.lead("run", calls)

    def move_rows(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move KV rows inside a slot (a commit), on every rank of a group."""
        self.ranks.lead("move", slot, src, dst)

    def follow(self) -> None:
        """A rank > 0 of a group: run rank 0's steps until it stops (raises GroupError if the group breaks)."""
        self.ranks.follow()

    def stop(self) -> None:
        """Rank 0 of a group: release the other ranks from `follow`."""
        self.ranks.stop()

    def _hidden(self, packed: Packed) -> list[torch.Tensor]:
        """The layers over a packed batch -> hidden [B, N, d] and the taps, each [B, N, d] (what a graph captures)."""
        out = self.runtime.forward(packed.tokens, packed.positions, packed.kv, packed.mask, self.taps)
        return [out.hidden, *out.taps]

    @torch.no_grad()
    @unoptimized
    def run_local(self, calls: list[TargetCall]) -> list[TargetOutput]:
        """`run` on this rank's shard: the layers over each group of calls that pads little (`padding_groups`), then
        one LM-head product over the rows of every call that wants logits."""
        by_call = {}
        for group in padding_groups([self.rows(c) for c in calls]):
            by_call.update(zip(group, self._layers([calls[i].rows for i in group])))
        outs = [by_call[i] for i in range(len(calls))]
        wanted = [hidden for c, (hidden, _, _) in zip(calls, outs) if c.with_logits]
        logits = iter(split_rows(self.runtime.logits(torch.cat(wanted)), [h.shape[0] for h in wanted]) if wanted else ())
        return [TargetOutput(next(logits) if c.with_logits else None, feats, experts) for c, (_, feats, experts) in zip(calls, outs)]

    def _layers(self, calls: list[RowsCall]) -> list[tuple[torch.Tensor, torch.Tensor, frozenset]]:
        """One forward over `calls` -> each call's hidden [N, d], features [N, F] and MoE experts."""
        shape = self.graphs.shape(calls, self.pool.slot_len) if self.graphs else None
        packed = pack(calls, self.pool, self.bucketed, shape)
        if shape is None:
            out = self.runtime.forward(packed.tokens, packed.positions, packed.kv, packed.mask, self.taps)
        else:
            hidden, *taps = self.graphs.run(packed)
            out = ForwardOut(hidden, taps, [])  # graphs run dense targets only: no experts routed
        hidden = packed.rows(out.hidden)  # [R, d]
        features = hidden if not self.taps else torch.cat([packed.rows(t) for t in out.taps], dim=-1)  # [R, F]
        routed = [packed.rows(r) for r in out.routed]  # per MoE layer [R, top_k]
        experts = []
        for b, n in enumerate(packed.lengths):
            start = sum(packed.lengths[:b])
            experts.append(frozenset((layer, int(e)) for layer, r in enumerate(routed) for e in r[start : start + n].unique().tolist()))
        return list(zip(split_rows(hidden, packed.lengths), split_rows(features, packed.lengths), experts))

    def kv_row_bytes(self) -> int:
        return self.pool.row_bytes


class TargetSession:
    """One request's target KV: a pool slot, committed rows, a version, and provisional tree rows until commit."""

    def __init__(self, model: TargetModel, wait: bool = False):
        self.model = model
        self.slot = model.pool.acquire(model.pool.slot_len, wait=wait)
        self.committed = 0
        self.version = 0
        self.provisional = 0
        self.last_commit: tuple[int, tuple[int, ...]] | None = None

    def __del__(self) -> None:
        self.close()  # a session dropped without close() still returns its slot

    def close(self) -> None:
        """Return the slot to the pool; the session is unusable afterwards."""
        if getattr(self, "slot", None) is not None:
            self.model.pool.release(self.slot)
            self.slot = None
            self.committed = self.provisional = 0

    def _check_version(self, version: int) -> None:
        if version != self.version:
            raise VersionError("target cache", self.version, version)

    def _ask(self, tokens: torch.Tensor, positions: torch.Tensor, rows_mask: torch.Tensor, with_logits: bool) -> Forward:
        self.model.pool.check_fits(self.committed + tokens.shape[0])
        return Forward(self.model, self.model.call(self.slot, self.committed, tokens, positions, rows_mask, with_logits))

    def prefill(self, version: int, tokens: list[int]) -> torch.Tensor:
        """`prefill_steps` run alone."""
        return run_alone(self.prefill_steps(version, tokens))

    def prefill_steps(self, version: int, tokens: list[int]) -> Steps[torch.Tensor]:
        """Commit the KV of `tokens` (everything before the next tree root) at `version` -> their features [n, F]."""
        if self.committed or self.provisional:
            raise RuntimeError("prefill runs once, on an empty target session")
        self.version = version
        if not tokens:
            return torch.empty(0, self.model.feature_width)
        n = len(tokens)
        out = yield self._ask(torch.tensor(tokens, dtype=torch.long), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), False)
        self.committed = n
        return out.features

    def verify(self, tree: FlattenedTree, version: int, params: SamplingParams) -> Verification:
        """`verify_steps` run alone."""
        return run_alone(self.verify_steps(tree, version, params))

    def verify_steps(self, tree: FlattenedTree, version: int, params: SamplingParams) -> Steps[Verification]:
        """Verify a tree built on `version` (trusted: a tree from outside passes `validate_tree` where it enters); its
        rows stay provisional until `commit`."""
        self._check_version(version)
        self.provisional = 0
        out = yield self._ask(tree.tokens, tree.positions, tree.mask, True)
        self.provisional = tree.num_rows
        logits = out.logits.cpu()
        decision, row_probs = decide(tree, logits, params)
        rows = torch.tensor(decision.accepted_rows, dtype=torch.long)
        return Verification(
            decision, out.features[rows.to(out.features.device)], out.experts, self.kv_bytes(tree.num_rows), row_probs
        )

    def commit(self, version: int, accepted_rows: tuple[int, ...]) -> None:
        """Keep the KV of the accepted rows (in path order), drop the other tree rows; idempotent per version."""
        accepted_rows = tuple(int(r) for r in accepted_rows)
        if self.last_commit == (version, accepted_rows) and self.version == version + 1:
            return
        self._check_version(version)
        if not accepted_rows or accepted_rows[0] != 0 or any(not 0 <= r < self.provisional for r in accepted_rows):
            raise ValueError(f"accepted_rows: {list(accepted_rows)} is not a path of the {self.provisional} verified rows")
        n = len(accepted_rows)
        if accepted_rows != tuple(range(n)):  # the path's rows move down behind the committed ones
            self.model.move_rows(self.slot, self.committed + torch.tensor(accepted_rows), torch.arange(self.committed, self.committed + n))
        self.committed += n
        self.provisional = 0
        self.version = version + 1
        self.last_commit = (version, accepted_rows)

    def kv_bytes(self, rows: int | None = None) -> int:
        """Bytes of target KV held for `rows` rows (committed plus provisional when None)."""
        return self.model.pool.row_bytes * (self.committed + self.provisional if rows is None else rows)
