"""The draft side of a round: one request's draft KV and the EAGLE-2 tree it proposes (docs/runtime.md, "The KV
pool"; "Drafting ahead"). A committed draft row t holds (feature f_t, advanced token x_{t+1}) at position t."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .drafters import Drafter
from .drafters.base import best_candidates
from .drafters.eagle1 import Eagle1Drafter, Eagle1Layer
from .drafters.eagle3 import Eagle3Drafter, Eagle3Layer, draft_to_target_ids
from .drafters.layers import MLP, Attention, RMSNorm, frozen_product, rms_norm, rotary_tables
from .errors import VersionError
from .outcomes import Calibration, grown_together, likeliest_outcomes, observed_acceptance
from .rounds import Proposal
from .runtime.batch import BACKGROUND, CANCELLED, FOREGROUND, Cancelled, Packed, RowsCall, pack, padding_groups, split_rows
from .runtime.device import attention_dtype
from .runtime.graphs import Graphs
from .runtime.kv import TREE_HEADROOM, KVCapacityError, KVPool, Writes
from .runtime.linear import Linear, PackedLinear, linear, pack_linears, packs
from .runtime.model import AttentionInputs, AttentionWeights, MLPWeights, activation, residual_layer
from .runtime.script import script, unoptimized
from .steps import Forward, Steps, run_alone
from .tree import DraftTree, RecordedTree, TreeError, TreePolicy, flatten, flatten_many, log_values
from .treerows import path_to

# runs a session's drafting ahead beside the round, given its priority (`eyas.runtime.batch.Operation`)
AheadRunner = Callable[[Steps[None], Callable[[], str]], Future]


@dataclass
class DraftRows:
    """A drafter call's result: next states [N, d]; top-k target token ids and probabilities [N, k] when asked."""

    states: torch.Tensor
    tokens: torch.Tensor | None = None
    probs: torch.Tensor | None = None


def served_weights(attn: Attention, mlp: MLP, post_norm: RMSNorm) -> tuple[AttentionWeights, MLPWeights]:
    """Frozen copies of a drafter layer's weights for the runtime's blocks, q/k/v and gate/up fused."""
    qkv = Linear(*frozen_product([attn.q_proj, attn.k_proj, attn.v_proj]))
    o = Linear(*frozen_product([attn.o_proj]))
    gate_up = Linear(*frozen_product([mlp.gate_proj, mlp.up_proj]))
    down = Linear(*frozen_product([mlp.down_proj]))
    attention = AttentionWeights(None, qkv.weight, qkv.bias, qkv.packed, None, o.weight, o.packed, o.bias)
    return attention, MLPWeights(post_norm.weight.detach().clone(), gate_up.weight, gate_up.packed, down.weight, down.packed)


@script
def eagle1_step(
    states: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, fc_weight: torch.Tensor, fc_bias: Optional[torch.Tensor],
    fc_packed: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, kv: Optional[torch.Tensor], writes: Optional[Writes],
    attention: AttentionWeights, mlp: MLPWeights, heads: int, kv_heads: int, act: str, eps: float,
) -> torch.Tensor:
    """`Eagle1Drafter.step`, bitwise: states [B, N, d], tokens [B, N] -> fc over [embedding; state] [B, N, 2d] -> the
    decoder layer over the pool -> [B, N, d]."""
    x = linear(torch.cat([F.embedding(tokens, embed), states], dim=-1), fc_weight, fc_bias, fc_packed)  # [B, N, d]
    at = AttentionInputs(cos[positions].unsqueeze(2), sin[positions].unsqueeze(2), mask, kv, writes)  # tables [P, hd] -> [B, N, 1, hd]
    return residual_layer(x, x, attention, mlp, heads, kv_heads, act, eps, at, 0)


@script
def eagle3_step(
    states: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, input_norm: torch.Tensor, hidden_norm: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, kv: Optional[torch.Tensor], writes: Optional[Writes],
    attention: AttentionWeights, mlp: MLPWeights, heads: int, kv_heads: int, act: str, eps: float,
) -> torch.Tensor:
    """`Eagle3Drafter.step`, bitwise: states [B, N, d], tokens [B, N] -> the state + attention over [normed
    embedding; normed state] [B, N, 2d], then + MLP -> [B, N, d]."""
    x = torch.cat([rms_norm(F.embedding(tokens, embed), input_norm, eps), rms_norm(states, hidden_norm, eps)], dim=-1)  # [B, N, 2d]
    at = AttentionInputs(cos[positions].unsqueeze(2), sin[positions].unsqueeze(2), mask, kv, writes)  # tables [P, hd] -> [B, N, 1, hd]
    return residual_layer(x, states, attention, mlp, heads, kv_heads, act, eps, at, 0)


@script
def eagle1_candidates(
    states: torch.Tensor, head_weight: torch.Tensor, head_bias: Optional[torch.Tensor], head_packed: Optional[torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-1's top-k next tokens: states [Q, d] through the target's LM head -> ids, probabilities [Q, k]."""
    return best_candidates(linear(states, head_weight, head_bias, head_packed), k)


@script
def eagle3_candidates(
    states: torch.Tensor, norm: torch.Tensor, eps: float, head_weight: torch.Tensor, head_bias: Optional[torch.Tensor], head_packed: Optional[torch.Tensor],
    d2t: torch.Tensor, k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's top-k next tokens: states [Q, d] through its norm and draft-vocabulary head -> target ids (draft id +
    d2t), probabilities [Q, k]."""
    ids, probs = best_candidates(linear(rms_norm(states, norm, eps), head_weight, head_bias, head_packed), k)
    return draft_to_target_ids(ids, d2t), probs


def decoder_layer(drafter: Drafter) -> Eagle1Layer | Eagle3Layer | None:
    """The decoder layer of an EAGLE-1 (or HASS) or EAGLE-3 drafter, which a `ServedStep` runs; None for another."""
    if isinstance(drafter, Eagle3Drafter):
        return drafter.midlayer
    return drafter.layers[0] if isinstance(drafter, Eagle1Drafter) else None


def layer_products(layer: Eagle1Layer | Eagle3Layer | None) -> frozenset[int]:
    """The ids of a decoder layer's linear layers (a `ServedStep` multiplies by fused copies of them)."""
    if layer is None:
        return frozenset()
    attn, mlp = layer.self_attn, layer.mlp
    return frozenset(id(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj))


class ServedStep:
    """A drafter's step and its top-k candidates as one scripted call each, over fused copies of its decoder layer's
    weights: bitwise its own `step` and `top_candidates`, which a drafter of another kind runs instead."""

    def __init__(self, drafter: Drafter, positions: int):
        """`drafter`: bound and packed (`pack_linears`, its decoder layer left out); `positions`: the slot length."""
        self.drafter = drafter
        self.layer = layer = decoder_layer(drafter)
        if layer is None:
            return
        attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        self.attention, self.mlp = served_weights(attn, mlp, norm)
        self.heads, self.kv_heads, self.act, self.eps = attn.heads, attn.kv_heads, activation(mlp.act_name), norm.eps
        self.embed = drafter.embed.weight.detach()
        self.cos, self.sin = (t.to(device=drafter.device, dtype=drafter.dtype) for t in rotary_tables(drafter.rotary.inner, positions))  # [P, hd]
        self.eagle3 = isinstance(layer, Eagle3Layer)
        if self.eagle3:
            self.norms = layer.input_layernorm.weight.detach().clone(), layer.hidden_norm.weight.detach().clone()
            self.head = drafter.lm_head.linear
            self.head_norm, self.head_eps, self.d2t = drafter.norm.weight.detach().clone(), drafter.norm.eps, drafter.d2t
        else:
            self.fc, self.head = drafter.fc.linear, drafter.target_head.linear

    def __call__(self, packed: Packed) -> torch.Tensor:
        """The drafter pass over `packed` -> next states [B, N, d]."""
        if self.layer is None:
            return self.drafter.step(packed.states, packed.tokens, packed.positions, packed.kv, packed.mask)
        head = (packed.states, packed.tokens, packed.positions, self.embed)
        tail = (self.cos, self.sin, packed.mask, *packed.kv.scripted(), self.attention, self.mlp, self.heads, self.kv_heads, self.act, self.eps)
        if self.eagle3:
            return eagle3_step(*head, *self.norms, *tail)
        return eagle1_step(*head, self.fc.weight, self.fc.bias, self.fc.packed, *tail)

    @unoptimized
    def candidates(self, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Q, d] states -> (target token ids [Q, k], conditional probabilities [Q, k] float64), best first."""
        if self.layer is None:
            return self.drafter.top_candidates(states, k)
        head = self.head
        if self.eagle3:
            return eagle3_candidates(states, self.head_norm, self.head_eps, head.weight, head.bias, head.packed, self.d2t, k)
        return eagle1_candidates(states, head.weight, head.bias, head.packed, k)


class DraftModel:
    """A drafter on one device with the KV pool its sessions share; `run` expands rows of many sessions at once."""

    def __init__(
        self,
        drafter: Drafter,
        kv_slots: int,
        max_seq_len: int,
        ahead_trees: int = 0,
        ahead_runner: AheadRunner | None = None,
        graphs: bool | None = None,
        target_head: Linear | None = None,
    ):
        """`ahead_trees`: trees each session drafts ahead for the likeliest outcomes of the round being verified, run
        by `ahead_runner` (default: a background thread); `graphs`: CUDA graphs (None: on CUDA; True on a CPU: the
        same fixed-shape batches, eagerly); `target_head`: the in-process target's LM head, whose packed copy a
        drafter bound to it shares."""
        if type(ahead_trees) is not int or ahead_trees < 0:
            raise ValueError(f"ahead_trees: must be a nonnegative integer, got {ahead_trees!r}")
        # inference only from here: every product on prepacked weights, the decoder layer's as fused copies
        pack_linears(drafter, skip=layer_products(decoder_layer(drafter)))
        if drafter.bound:
            drafter.bind_target(drafter.embed, PackedLinear(drafter.target_head, target_head))
        slot_len = max_seq_len + TREE_HEADROOM
        self.served = ServedStep(drafter, slot_len)
        self.drafter = drafter
        self.ahead_trees = ahead_trees
        self.ahead_curve: tuple[list[int], list[float]] | None = None  # the drafter's step seconds by rows, once measured
        # how often the target accepts this drafter's nodes, by drafter probability (about the last 200 rounds)
        self.calibration = Calibration(decay=0.995)
        self._background = None if ahead_runner else ThreadPoolExecutor(1, thread_name_prefix="eyas-ahead")
        self.ahead_runner = ahead_runner or self._run_in_background
        attn = drafter.attention
        kv_dtype = attention_dtype(drafter.dtype, drafter.device)
        self.pool = KVPool(1, attn.kv_heads, attn.head_dim, kv_slots, slot_len, kv_dtype, drafter.device, "draft KV")
        # batches padded to oneDNN's row buckets, for a drafter with products (the timed models' has none)
        self.bucketed = self.served.layer is not None and packs(drafter.dtype, drafter.device)
        on_cuda = drafter.device.type == "cuda"
        self.graphs = Graphs(self._step, drafter.device) if (on_cuda if graphs is None else graphs) else None

    def rows(self, call: RowsCall) -> int:
        """Rows `call` adds to a batch (its share of the row budget)."""
        return int(call.tokens.shape[0])

    def _seeded(self, calls: list[RowsCall]) -> list[RowsCall]:
        """`calls` with target features turned into drafter input states, in one `seed_hidden` product for all."""
        seeding = [i for i, c in enumerate(calls) if c.features is not None]
        if not seeding:
            return calls
        lengths = [int(calls[i].features.shape[0]) for i in seeding]
        states = self.drafter.seed_hidden(torch.cat([calls[i].features for i in seeding]))  # [sum m, F] -> [sum m, d]
        calls = list(calls)
        for i, s in zip(seeding, split_rows(states, lengths)):
            calls[i] = replace(calls[i], states=s, features=None)
        return calls

    def _run_in_background(self, steps: Steps[None], priority: Callable[[], str]) -> Future:
        """The drafting ahead alone on a thread of its own (the reseed waits for it)."""
        return self._background.submit(run_alone, steps)

    def _step(self, packed: Packed) -> list[torch.Tensor]:
        """The drafter pass over a packed batch -> [next states [B, N, d]] (what a graph captures)."""
        return [self.served(packed)]

    def _states(self, calls: list[RowsCall]) -> list[torch.Tensor]:
        """One drafter pass over `calls` -> each call's next states [N, d]."""
        shape = self.graphs.shape(calls, self.pool.slot_len) if self.graphs else None
        packed = pack(calls, self.pool, self.bucketed, shape)
        (out,) = self.graphs.run(packed) if shape else self._step(packed)  # [B, N, d]
        return split_rows(packed.rows(out), packed.lengths)

    @torch.no_grad()
    @unoptimized
    def run(self, calls: list[RowsCall]) -> list[DraftRows]:
        """The drafter over every call's rows -> each call's next states [N, d] and, where asked, its rows' top-k
        candidates (one LM-head pass for all)."""
        calls = self._seeded(calls)
        by_call = {}
        for group in padding_groups([self.rows(c) for c in calls]):
            by_call.update(zip(group, self._states([calls[i] for i in group])))
        states = [by_call[i] for i in range(len(calls))]
        results = [DraftRows(s) for s in states]
        asking = [i for i, c in enumerate(calls) if c.top_k]
        if asking:
            k = max(calls[i].top_k for i in asking)
            rows = [states[i][-1:] if calls[i].top_k_last else states[i] for i in asking]
            tokens, probs = self.served.candidates(torch.cat(rows), k)  # [R', k]
            lengths = [r.shape[0] for r in rows]
            for i, t, p in zip(asking, split_rows(tokens, lengths), split_rows(probs, lengths)):
                results[i].tokens, results[i].probs = t[:, : calls[i].top_k], p[:, : calls[i].top_k]
        return results


class Grown:
    """A grown tree's proposal with the drafter states and draft-KV rows of its nodes (what drafting ahead extends),
    read out (`nodes`) only when asked: a tree of a forest has them in the forest's arrays (`_grow_forest`)."""

    def __init__(self, proposal: Proposal, end: int, nodes: Callable[[], tuple[dict[int, torch.Tensor], dict[int, list[int]]]]):
        self.proposal = proposal
        self.end = end  # the session's written rows once it was grown
        self._nodes = nodes

    @cached_property
    def _read(self) -> tuple[dict[int, torch.Tensor], dict[int, list[int]]]:
        return self._nodes()

    @property
    def states(self) -> dict[int, torch.Tensor]:
        """Expanded node -> the drafter output predicting its children."""
        return self._read[0]

    @property
    def path_rows(self) -> dict[int, list[int]]:
        """Expanded node -> the draft-KV rows of its path, its own last."""
        return self._read[1]


@dataclass
class Seed:
    """One tree of a forest (`DraftSession._grow_forest`): its root token and state [d], the draft rows the root sees
    (its own last), its target prefix, the root's top-width children ([1, width] ids, probabilities) and when it
    stops growing."""

    token: int
    state: torch.Tensor
    base_rows: list[int]
    prefix_len: int
    candidates: tuple[torch.Tensor, torch.Tensor] | None  # None: a policy that drafts nothing
    stop: Callable[[], bool]


def forest_nodes(
    seed: Seed, tree_index: int, tree: DraftTree, levels: list[tuple[np.ndarray, np.ndarray]], rows: np.ndarray,
    states: torch.Tensor, shift: int,
) -> tuple[dict[int, torch.Tensor], dict[int, list[int]]]:
    """A forest tree's expanded nodes as `DraftSession._grow` keeps them: each one's state and the draft rows of its
    path. `levels`: each level's expanded (tree, node) pairs; `rows`: the tree's node -> its index among the forest's
    roots and then drafted rows (`states` [.., d]); a drafted row's index plus `shift` is its draft-KV row."""
    node_states, path_rows = {0: seed.state}, {0: list(seed.base_rows)}
    for trees, nodes in levels:
        for node in nodes[trees == tree_index].tolist():
            index = int(rows[node])
            node_states[node] = states[index]
            path_rows[node] = path_rows[tree.parents[node]] + [index + shift]
    return node_states, path_rows


def ahead_key(version: int, accepted: Sequence[int], bonus: int, policy: TreePolicy) -> tuple:
    """`DraftSession.ahead`'s key of the `version` tree drafted for the outcome (`accepted` tokens, then `bonus`) of
    the round before it."""
    return (version, tuple(accepted), bonus, policy)


class DraftSession:
    """One request's drafter state: a draft KV slot (verified rows [0, committed), a round's tree rows up to
    `written`), the verified rows not yet run, and the root's state."""

    def __init__(self, model: DraftModel, wait: bool = False):
        self.model = model
        self.drafter = model.drafter
        self.slot = model.pool.acquire(model.pool.slot_len, wait=wait)
        self.written = 0
        self.committed = 0
        self.version = 0
        self.pending_features: list[torch.Tensor] = []  # [m_i, F] blocks: target features of verified rows not yet run
        self.pending_tokens: list[int] = []
        self.root_state: torch.Tensor | None = None  # [d] drafter output at the last committed row
        self.root_token: int | None = None
        self.last_reseed: tuple[int, tuple[int, ...]] | None = None
        self.ahead: dict[tuple, Grown] = {}  # (version, accepted tokens, bonus, policy) -> tree drafted ahead
        self.ahead_built = 0
        self.ahead_hits = 0
        self.proposed: tuple[int, DraftTree, list[int]] | None = None  # version, recorded tree, verified nodes
        self._ahead_job: Future | None = None
        self._ahead_stop = False  # set once the next round has come: drafting ahead stops
        self._decided: tuple[tuple[int, ...], int] | None = None  # the outcome it guessed at, once known
        self._ahead_from: tuple[int, Grown, TreePolicy] | None = None  # a proposed tree's drafting ahead, not started
        self._starting = threading.Lock()  # `start_ahead` against `close`

    def __del__(self) -> None:
        self.close()  # a session dropped without close() still returns its slot

    def close(self, wait: bool = True) -> None:
        """Return the slot to the pool; the session is unusable afterwards. A drafting ahead in flight stops at its
        next drafter step; without `wait` the slot returns then, from the thread that runs it (a caller on that thread
        would wait for ever)."""
        with getattr(self, "_starting", threading.Lock()):
            self._ahead_from = None
            job = getattr(self, "_ahead_job", None)
        if job is not None:
            self.interrupt_ahead()
            if not wait and not job.done():
                job.add_done_callback(lambda _: self._return_slot())
                return
            self._settle_ahead()
        self._return_slot()

    def _return_slot(self) -> None:
        if getattr(self, "slot", None) is not None:
            self.model.pool.release(self.slot)
            self.slot = None

    def decide_ahead(self, accepted_tokens: tuple[int, ...], bonus: int) -> None:
        """The verification drafting ahead guesses at has decided (a draft worker relays it): the guesses stop at their
        next drafter step but the one for this outcome, which is then what the next round waits for. Safe from any
        thread."""
        self._decided = (tuple(int(t) for t in accepted_tokens), int(bonus))

    def _ahead_priority(self) -> str:
        """The drafting ahead's priority on a worker's compute thread (`eyas.runtime.batch.Operation`)."""
        if self._decided is not None:
            return FOREGROUND  # it finishes the decided outcome's tree, or ends at once
        return CANCELLED if self._ahead_stop else BACKGROUND

    def _growing(self, outcome: tuple[tuple[int, ...], int]) -> bool:
        """Whether a tree drafted ahead for `outcome` goes on growing: as a guess until the decision or an interrupt,
        after the decision only if it is the decided outcome's."""
        return outcome == self._decided if self._decided is not None else not self._ahead_stop

    def interrupt_ahead(self) -> None:
        """What the drafting ahead guesses at is decided: it stops at its next drafter step, keeping the trees already
        built. Safe from any thread."""
        self._ahead_stop = True

    @property
    def ahead_job(self) -> Future | None:
        """The drafting ahead in flight for this session, if any."""
        return self._ahead_job

    def kv_bytes(self) -> int:
        """Bytes of draft KV held: every written row of the slot."""
        return self.model.pool.row_bytes * self.written

    @property
    def length(self) -> int:
        """Committed draft rows plus pending ones: the target prefix this session is seeded to."""
        return self.committed + len(self.pending_tokens)

    @torch.no_grad()
    def _queue(self, features: torch.Tensor, tokens: list[int]) -> None:
        """Drop tree rows; queue verified rows: features f_t [m, F] with the tokens x_{t+1} [m] that follow them."""
        if features.shape[0] != len(tokens):
            raise ValueError(f"features: {features.shape[0]} rows for {len(tokens)} tokens")
        self.written = self.committed
        if not tokens:
            return
        # [m, F] in the dtype they came in (the drafter casts them as it reads them), seeded by its next pass
        self.pending_features.append(features)  # joined once, when they run: a streak of reseeds copies each block once
        self.pending_tokens += [int(t) for t in tokens]

    def start(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        """`start_steps` run alone."""
        run_alone(self.start_steps(version, features, tokens))

    @torch.no_grad()
    def start_steps(self, version: int, features: torch.Tensor, tokens: list[int]) -> Steps[None]:
        """Seed an empty session from a prefill of the committed tokens, at the request's `version`: the drafter's
        prefill, which writes their draft KV."""
        if self.length or self.written:
            raise RuntimeError("start runs once, on an empty draft session")
        self._queue(features, tokens)
        self.version = version
        yield from self._run_pending()

    def reseed(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        """Publish step for the draft side: drop tree rows, queue the accepted rows' target features.

        Idempotent per version: a retried reseed of the version just applied is a no-op.
        """
        self._settle_ahead()
        if self.last_reseed == (version, tuple(tokens)) and self.version == version + 1:
            return
        if version != self.version:
            raise VersionError("draft cache", self.version, version)
        if self.proposed is not None and self.proposed[0] == version and tokens:  # what the target made of the tree
            _, tree, nodes = self.proposed
            self.model.calibration.add(tree, observed_acceptance(tree, nodes, tuple(tokens[:-1])))
        self.proposed = None
        self._queue(features, tokens)
        self.version = version + 1
        self.last_reseed = (version, tuple(tokens))

    def _run_pending(self, top_k: int = 0) -> Steps[tuple[torch.Tensor, torch.Tensor] | None]:
        """Run the queued verified rows causally on top of the committed draft KV; they become committed. With
        `top_k`, returns the new root's top-k children candidates ([1, k] ids and probabilities) from the same pass,
        None when nothing was pending."""
        self.written = self.committed
        if not self.pending_features:
            return None
        m = len(self.pending_tokens)
        visible = torch.ones(m, self.committed + m, dtype=torch.bool)
        visible[:, self.committed :] = torch.ones(m, m, dtype=torch.bool).tril()
        positions = torch.arange(self.committed, self.committed + m)
        tokens = torch.tensor(self.pending_tokens)
        features = torch.cat(self.pending_features) if len(self.pending_features) > 1 else self.pending_features[0]  # [m, F]
        out = yield from self._run(RowsCall(self.slot, self.committed, tokens, positions, visible, None, top_k, True, features))
        self.committed += m
        self.root_state = out.states[-1]
        self.root_token = self.pending_tokens[-1]
        self.pending_features = []
        self.pending_tokens = []
        return None if out.tokens is None else (out.tokens, out.probs)

    def propose(self, version: int, root_token: int, policy: TreePolicy) -> Proposal:
        """`propose_steps` run alone."""
        return run_alone(self.propose_steps(version, root_token, policy))

    @torch.no_grad()
    def propose_steps(self, version: int, root_token: int, policy: TreePolicy, start_ahead: bool = True) -> Steps[Proposal]:
        """The EAGLE-2 tree rooted at the append-required token, flattened for verification: a tree drafted ahead for
        exactly the outcome the last reseed published, else a fresh one; then, with drafting ahead on, the next
        round's trees start beside this round (without `start_ahead`, at `start_ahead()`)."""
        self._settle_ahead()
        if version != self.version:
            raise VersionError("draft cache", self.version, version)
        seeded_root = self.pending_tokens[-1] if self.pending_tokens else self.root_token
        if seeded_root is not None and root_token != seeded_root:
            raise TreeError("root_token", f"{root_token} is not the last seeded token {seeded_root}")
        ahead, self.ahead = self.ahead, {}
        hit = None
        if self.last_reseed is not None and self.last_reseed[0] == version - 1:
            hit = ahead.get(ahead_key(version, self.last_reseed[1][:-1], root_token, policy))
        if hit is not None:  # its rows (and the path rows it sees) stay until the next reseed
            self.ahead_hits += hit.proposal.assumed is not None  # else the decided outcome's (`draft_decided`)
            self.written = hit.end
            grown = hit
        else:
            grown = yield from self._draft_fresh(root_token, policy)
        if self.model.ahead_trees and grown.proposal.nodes_expanded:
            self.proposed = (version, grown.proposal.draft_tree, grown.proposal.row_nodes)
            self._ahead_stop, self._decided = False, None
            self._ahead_from = (version + 1, grown, policy)
            if start_ahead:
                self.start_ahead()
        return grown.proposal

    def start_ahead(self) -> None:
        """Start drafting the next round's trees beside the verification of the tree just proposed (a caller that sends
        the tree first starts it once the tree has left). Safe from any thread; a closed session starts none."""
        with self._starting:
            if self._ahead_from is not None:
                (version, grown, policy), self._ahead_from = self._ahead_from, None
                self._ahead_job = self.model.ahead_runner(self._draft_ahead(version, grown, policy), self._ahead_priority)

    def draft_decided(self, version: int, features: torch.Tensor, tokens: list[int], policy: TreePolicy) -> Steps[None]:
        """The next round's tree for the outcome a verification of `version` decided, drafted before the word on it:
        the reseed the word will name (which it then finds applied) and the tree `propose_steps` would draft after it,
        which the next round finds among the trees ahead."""
        self.reseed(version, features, tokens)
        self.ahead[ahead_key(version + 1, tokens[:-1], tokens[-1], policy)] = yield from self._draft_fresh(tokens[-1], policy)

    def has_ahead(self, version: int, tokens: tuple[int, ...], policy: TreePolicy) -> bool:
        """Whether a tree for the next round after the outcome `tokens` (accepted tokens, then the bonus) of `version`
        is ready."""
        return ahead_key(version + 1, tokens[:-1], tokens[-1], policy) in self.ahead

    def _draft_fresh(self, root_token: int, policy: TreePolicy) -> Steps["Grown"]:
        """Run the verified rows queued since the last round, then grow a tree from the new root's state."""
        drafting = policy.depth > 0 and policy.budget > 0
        candidates = yield from self._run_pending(policy.width if drafting else 0)
        return (yield from self._grow(root_token, self.root_state, [], self.committed, policy, candidates))

    def _grow(
        self,
        root_token: int,
        root_state: torch.Tensor | None,
        base_rows: list[int],
        prefix_len: int,
        policy: TreePolicy,
        root_candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Steps["Grown | None"]:
        """Expand a tree from `root_state` whose nodes also see the draft rows `base_rows`, for a target prefix of
        `prefix_len` rows; the expansion rows are scratch after `written`. `root_candidates`: the root's top-width
        children ([1, width] ids, probabilities) when the pass that made `root_state` already gave them. None when
        `stop` says so before one of the drafter steps."""
        tree = DraftTree(root_token)
        states = {0: root_state}  # node -> drafter output predicting its children
        path_rows: dict[int, list[int]] = {0: list(base_rows)}  # expanded node -> draft-KV rows of its path
        if root_state is None or policy.depth == 0 or policy.budget == 0:
            return Grown(Proposal(flatten(tree, [], prefix_len), 0, 1, 0, 0.0, tree, [0]), self.written, lambda: (states, path_rows))
        expanded_count = 0
        expanded = [0]
        tree_seconds = 0.0
        for depth in range(policy.depth):
            if depth == 0:
                tokens, probs = root_candidates or self.model.served.candidates(root_state[None], policy.width)  # [1, width]
            else:
                if stop is not None and stop():
                    return None
                expanded = tree.expandable(policy.width, policy.stop)
                if not expanded:  # every frontier node's value is under the policy's floor
                    break
                out = yield from self._expand(tree, expanded, states, path_rows, prefix_len, policy.width)
                expanded_count += len(expanded)
                states.update(zip(expanded, out.states))
                tokens, probs = out.tokens, out.probs  # [Q, width]
            start = time.perf_counter()
            parents = [node for node in expanded for _ in range(tokens.shape[1])]  # each node's candidates in order
            tree.add_expansion(expanded, parents, tokens.flatten().tolist(), probs.flatten().tolist(), top_k=True)
            tree_seconds += time.perf_counter() - start
        start = time.perf_counter()
        selected = tree.select(policy.budget)
        flat = flatten(tree, selected, prefix_len)
        tree_seconds += time.perf_counter() - start
        draft_kv_bytes = self.model.pool.row_bytes * expanded_count
        proposal = Proposal(flat, expanded_count, len(tree), draft_kv_bytes, tree_seconds, tree, [0, *selected])
        return Grown(proposal, self.written, lambda: (states, path_rows))

    @torch.no_grad()
    def _draft_ahead(self, version: int, grown: "Grown", policy: TreePolicy) -> Steps[None]:
        """While the tree of `version - 1` is verified, grow the `version` trees of its likeliest outcomes (an accepted
        path and the bonus token after it; `likeliest_outcomes`), each on the drafter's own states along its path."""
        try:
            proposal, states, path_rows = grown.proposal, grown.states, grown.path_rows
            tree, nodes, prefix_len = proposal.draft_tree, proposal.row_nodes, proposal.tree.prefix_len
            if self._ahead_stop or self._decided is not None:
                return
            leaves = [n for n in nodes if n not in states]
            if leaves:
                states.update(zip(leaves, (yield from self._expand(tree, leaves, states, path_rows, prefix_len)).states))
            # enough candidates per node that `ahead_trees` remain besides its verified children
            width = policy.width + self.model.ahead_trees
            tokens, probs = self.model.served.candidates(torch.stack([states[n] for n in nodes]), width)
            outcomes = likeliest_outcomes(tree, nodes, tokens.cpu().numpy(), probs.double().cpu().numpy(), self.model.calibration, self.model.ahead_trees)
            if not outcomes or self._ahead_stop or self._decided is not None:
                return
            # the bonus rows: each bonus b as a child of its node n, one drafter step (and one head pass) for all
            base = self.written
            roots = yield from self._run_rows(
                [path_rows[n] for _, n, _ in outcomes],
                [b for _, _, b in outcomes],
                [prefix_len + tree.depths[n] for _, n, _ in outcomes],
                torch.stack([states[n] for _, n, _ in outcomes]),
                policy.width if policy.depth > 0 and policy.budget > 0 else 0,
            )  # states [T, d], each root's candidates [T, width]
            routes = [path_to(tree.parents, n) for _, n, _ in outcomes]  # each outcome's accepted nodes, root first
            paths = [tuple(tree.tokens[m] for m in route[1:]) for route in routes]
            row_of = {node: row for row, node in enumerate(nodes)}
            seeds = [
                Seed(
                    b, roots.states[i], path_rows[n] + [base + i], prefix_len + tree.depths[n] + 1,
                    None if roots.tokens is None else (roots.tokens[i : i + 1], roots.probs[i : i + 1]),
                    lambda outcome=(paths[i], b): not self._growing(outcome),
                )
                for i, (_, n, b) in enumerate(outcomes)
            ]
            # the likeliest trees grow first, as many as a drafter step takes for about the cost of one tree's (one
            # alone unless the drafter's measured curve says so), so that they are done when a decision arrives
            # mid-way (trees grown together finish together, unless the decision stops the others); then the others
            together = grown_together(*self.model.ahead_curve, policy.width, len(outcomes)) if self.model.ahead_curve else 1
            for first, last in ((0, together), (together, len(outcomes))):
                built_trees = yield from self._grow_forest(seeds[first:last], policy)
                for i, built in enumerate(built_trees, first):
                    if built is not None:  # None: stopped, another outcome was decided
                        built.proposal.assumed = outcome = (paths[i], outcomes[i][2])
                        built.proposal.assumed_rows = tuple(row_of[m] for m in routes[i])
                        self.ahead[ahead_key(version, *outcome, policy)] = built
                        self.ahead_built += 1
                if self._decided is not None:
                    return
        except KVCapacityError:
            pass  # no scratch rows left in this slot: no tree drafted ahead this round
        except Cancelled:
            pass  # ended at its next forward: the trees built stay

    def _grow_forest(self, seeds: list[Seed], policy: TreePolicy) -> Steps[list["Grown | None"]]:
        """Grow the trees of `seeds` as `_grow` grows each (the same nodes, ranks and rows), each level of all of them
        in one drafter call and their records in arrays, so that a tree costs the host a few array rows a level
        rather than its own pass of bookkeeping (docs/runtime.md, "Drafting ahead"). A tree whose `stop` says so
        before a drafter step is None."""
        if not seeds or policy.depth == 0 or policy.budget == 0:  # no drafting: each tree is its root
            grown = []
            for seed in seeds:
                grown.append((yield from self._grow(seed.token, seed.state, seed.base_rows, seed.prefix_len, policy)))
            return grown
        n_trees, width, committed, first_row = len(seeds), policy.width, self.committed, self.written
        size = 1 + width + (policy.depth - 1) * width * width  # nodes of a full tree
        tokens = np.zeros((n_trees, size), np.int64)
        parents = np.full((n_trees, size), -1, np.int64)
        depths = np.zeros((n_trees, size), np.int64)
        confidences = np.ones((n_trees, size))
        values = np.zeros((n_trees, size))  # log path values
        tokens[:, 0] = [seed.token for seed in seeds]
        prefix = np.array([seed.prefix_len for seed in seeds], dtype=np.int64)
        count, first_new = np.ones(n_trees, np.int64), np.zeros(n_trees, np.int64)  # nodes so far; the last level's first
        # each tree's root, then each drafted row (in row order): the draft rows it sees, by column `row - committed`
        most = n_trees * width * (policy.depth - 1)
        seen = np.zeros((n_trees + most, first_row - committed + most), dtype=bool)
        for t, seed in enumerate(seeds):
            seen[t, np.asarray(seed.base_rows, dtype=np.int64) - committed] = True
        row = np.zeros((n_trees, size), np.int64)  # expanded node -> its index in `seen` and among the states
        row[:, 0] = np.arange(n_trees)
        level_states = [torch.stack([seed.state for seed in seeds])]  # [T, d], then each level's [Q, d]
        levels: list[tuple[np.ndarray, np.ndarray]] = []  # each level's expanded (tree, node) pairs [Q], tree by tree
        bookkeeping = 0.0

        def add_children(tt: np.ndarray, nn: np.ndarray, ids: torch.Tensor, probs: torch.Tensor) -> None:
            """Each expanded node's (tree `tt`, node `nn` [Q], tree by tree) top-width candidates (ids, probs [Q, width])
            as its children, in `DraftTree.add_expansion`'s order and with its values (`log_values`)."""
            q = probs.double().cpu().numpy()  # [Q, width]
            if not (q.min() >= 0.0 and q.max() <= 1.0):  # NaN fails the comparison too
                raise TreeError("confidence", f"must be a finite probability, got {q[~((q >= 0.0) & (q <= 1.0))][0]!r}")
            counts = np.bincount(tt, minlength=n_trees)  # [T]
            rank = np.arange(len(tt)) - np.searchsorted(tt, tt)  # [Q]: each node's place among its tree's (`tt` is sorted)
            at = tt[:, None], (count[tt] + rank * width)[:, None] + np.arange(width)  # [Q, 1], [Q, width]: after its tree's last
            tokens[at] = ids.cpu().numpy()
            parents[at] = nn[:, None]
            depths[at] = depths[tt, nn][:, None] + 1
            confidences[at] = q
            values[at] = values[tt, nn][:, None] + log_values(q)
            first_new[counts > 0] = count[counts > 0]
            count[:] += counts * width

        start = time.perf_counter()
        root_ids, root_probs = (torch.cat(c) for c in zip(*(seed.candidates for seed in seeds)))  # [T, width]
        add_children(np.arange(n_trees), np.zeros(n_trees, np.int64), root_ids, root_probs)
        bookkeeping += time.perf_counter() - start
        trees, stopped = list(range(n_trees)), set()  # the trees still growing; those told to stop
        floor = math.log(policy.stop) if policy.stop > 0.0 else None
        done = n_trees  # rows in `seen` and among the states so far
        for _ in range(1, policy.depth):
            stopped.update(t for t in trees if seeds[t].stop())
            by_frontier: dict[tuple[int, int], list[int]] = {}
            for t in trees:
                if t not in stopped:
                    by_frontier.setdefault((int(first_new[t]), int(count[t])), []).append(t)
            picked = []
            for (first, end), group in by_frontier.items():  # `DraftTree.expandable`: the best, ties to the earlier node
                best = first + np.argsort(-values[group, first:end], axis=1, kind="stable")[:, :width]  # [G, <= width]
                keep = values[np.asarray(group)[:, None], best] >= floor if floor is not None else np.ones(best.shape, bool)
                picked.append((np.repeat(group, keep.sum(axis=1)), best[keep]))
            tt, nn = (np.concatenate(x) for x in zip(*picked)) if picked else (np.zeros(0, np.int64),) * 2
            order = np.argsort(tt, kind="stable")  # tree by tree, each tree's best first
            tt, nn = tt[order], nn[order]
            trees = np.flatnonzero(np.bincount(tt, minlength=n_trees)).tolist()  # a tree with nothing to expand is done
            if not trees:
                break
            base, n_rows = self.written, len(tt)
            parent_rows = row[tt, parents[tt, nn]]  # [Q]
            view = seen[parent_rows]  # [Q, columns]: each parent's view, then the row itself
            view[np.arange(n_rows), base - committed + np.arange(n_rows)] = True
            seen[done : done + n_rows] = view
            visible = np.empty((n_rows, base + n_rows), dtype=bool)
            visible[:, :committed] = True
            visible[:, committed:] = view[:, : base + n_rows - committed]
            last = level_states[-1]  # every parent was expanded at the level before (or is a root)
            hidden = last.index_select(0, torch.from_numpy(parent_rows - (done - len(last))).to(last.device))  # [Q, d]
            row[tt, nn] = done + np.arange(n_rows)
            levels.append((tt, nn))
            call = RowsCall(
                self.slot, base, torch.from_numpy(tokens[tt, nn]), torch.from_numpy(prefix[tt] - 1 + depths[tt, nn]),
                torch.from_numpy(visible), hidden, width,
            )
            out = yield from self._run(call)
            start = time.perf_counter()
            level_states.append(out.states)
            done += n_rows
            add_children(tt, nn, out.tokens, out.probs)
            bookkeeping += time.perf_counter() - start
        start = time.perf_counter()
        states = torch.cat(level_states)  # [roots + drafted rows, d]
        expanded = np.bincount(np.concatenate([tt for tt, _ in levels] or [np.zeros(0, np.int64)]), minlength=n_trees)
        grown: list[Grown | None] = [None] * n_trees
        by_size: dict[int, list[int]] = {}  # trees of as many nodes, flattened together
        for t in range(n_trees):
            if t not in stopped:
                by_size.setdefault(int(count[t]), []).append(t)
        for n, group in by_size.items():
            # `DraftTree.select`: the best `budget` nodes, ties to the earlier node
            selected = 1 + np.argsort(-values[group, 1:n], axis=1, kind="stable")[:, : policy.budget]  # [G, B]
            rows = np.concatenate([np.zeros((len(group), 1), np.int64), selected], axis=1)
            flats = flatten_many(tokens[group], parents[group], depths[group], confidences[group], rows, prefix[group].tolist())
            for t, flat, chosen in zip(group, flats, selected.tolist()):
                tree = RecordedTree(
                    tokens[t, :n], parents[t, :n], depths[t, :n], confidences[t, :n], values[t, :n], list(range(int(first_new[t]), n))
                )
                kv_bytes = self.model.pool.row_bytes * int(expanded[t])
                proposal = Proposal(flat, int(expanded[t]), n, kv_bytes, 0.0, tree, [0, *chosen])
                read = lambda t=t, tree=tree: forest_nodes(seeds[t], t, tree, levels, row[t], states, first_row - n_trees)
                grown[t] = Grown(proposal, self.written, read)
        built = [g for g in grown if g is not None]
        for g in built:  # each tree's share of the host's bookkeeping
            g.proposal.tree_seconds = (bookkeeping + time.perf_counter() - start) / len(built)
        return grown

    def _settle_ahead(self) -> None:
        """Wait for the drafting ahead in flight."""
        job, self._ahead_job = self._ahead_job, None
        if job is not None:
            job.result()

    def _expand(
        self,
        tree: DraftTree,
        nodes: list[int],
        states: dict[int, torch.Tensor],
        path_rows: dict[int, list[int]],
        prefix_len: int,
        top_k: int = 0,
    ) -> Steps[DraftRows]:
        """Run the drafter on tree nodes: each sees the committed rows, its draft ancestors and itself; with `top_k`,
        also each node's top-k children candidates."""
        base = self.written
        ancestors = [path_rows[tree.parents[n]] for n in nodes]
        for i, node in enumerate(nodes):
            path_rows[node] = ancestors[i] + [base + i]
        hidden = torch.stack([states[tree.parents[n]] for n in nodes])  # [Q, d]
        positions = [prefix_len - 1 + tree.depths[n] for n in nodes]
        return (yield from self._run_rows(ancestors, [tree.tokens[n] for n in nodes], positions, hidden, top_k))

    def _run_rows(
        self, ancestors: list[list[int]], tokens: list[int], positions: list[int], hidden: torch.Tensor, top_k: int = 0
    ) -> Steps[DraftRows]:
        """Run the drafter on new rows after `written` (hidden [Q, d]): row i sees the committed rows, the draft rows
        `ancestors[i]` and itself."""
        base = self.written
        visible = np.zeros((len(tokens), base + len(tokens)), dtype=bool)  # built in numpy: a tensor's indexing costs more here
        visible[:, : self.committed] = True
        owners = np.repeat(np.arange(len(tokens)), [len(rows) + 1 for rows in ancestors])
        # each row's path, itself last
        paths = np.fromiter((row for i, rows in enumerate(ancestors) for row in (*rows, base + i)), dtype=np.int64)
        visible[owners, paths] = True
        call = RowsCall(self.slot, base, torch.tensor(tokens), torch.tensor(positions), torch.from_numpy(visible), hidden, top_k)
        return (yield from self._run(call))

    def _run(self, call: RowsCall) -> Steps[DraftRows]:
        """Write `call`'s rows into this session's slot and return their drafter outputs."""
        end = call.start + call.tokens.shape[0]
        self.model.pool.check_fits(end)
        self.written = end  # reserved as asked
        try:
            return (yield Forward(self.model, call))
        except Exception:  # the forward failed: its rows were not written
            self.written = call.start
            raise
