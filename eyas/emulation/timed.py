"""Timed models: a target and a drafter whose forwards hold an emulated device for the time a cost profile gives
(the host thread sleeps, as it waits on a GPU kernel) and return the synthetic law's outputs (docs/emulation.md).

Everything around them is the real code: the KV pool (it holds each row's token and position), packing, sessions,
trees, verification and publish, in the engine and in the workers alike.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from ..manifest import FeatureAddress, Manifest, TargetFingerprint
from ..runtime.batch import pack, split_rows
from ..runtime.kv import SlotBatch
from ..runtime.shard import Shard
from ..target import DEFAULT_KV_SLOTS, TargetCall, TargetModel, TargetOutput
from .law import context_hashes, draft_candidates, target_logits
from .profile import ForwardCost, Law, Profile

LAST = np.iinfo(np.int64).max
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmulatedDevice:
    """One emulated accelerator: a forward holds it for its cost, so forwards on one device run one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.busy_seconds = 0.0

    @contextmanager
    def hold(self, seconds: float) -> Iterator[None]:
        """Hold the device for `seconds`: the host's own work inside counts towards them, the rest is slept."""
        with self._lock:
            start = time.perf_counter()
            yield
            left = start + seconds - time.perf_counter()
            if left > 0:
                time.sleep(left)
            self.busy_seconds += time.perf_counter() - start


def emulated_manifest(profile: Profile) -> Manifest:
    """The manifest both timed models serve under: the law and the features fingerprint the synthetic target."""
    law = json.dumps({"law": asdict(profile.law), "features": [profile.feature_width, profile.feature_dtype]}, sort_keys=True)
    fingerprint = TargetFingerprint(
        config_digest=hashlib.sha256(law.encode()).hexdigest(),
        weight_digest="synthetic",
        tokenizer_digest="",
        model_type="synthetic",
        num_layers=1,
        hidden_size=profile.feature_width,
        vocab_size=profile.law.vocab,
    )
    return Manifest(fingerprint, FeatureAddress("final_norm_output", dtype=profile.feature_dtype), "synthetic/1")


def row_hashes(tokens: torch.Tensor, positions: torch.Tensor, kv: SlotBatch, mask: torch.Tensor, context: int) -> np.ndarray:
    """Write a batch's tokens and positions [B, N] into its KV (as k and v), then hash each row's context, as `mask`
    [B, 1, N, K] lets it see -> [B, N] (pad rows: any value)."""
    n = tokens.shape[1]
    one_head = lambda x: x.float()[:, None, :, None]  # [B, 1, N, 1]: one head of width one
    keys, places = (x[:, 0, :, 0].numpy().astype(np.int64) for x in kv.append(one_head(tokens), one_head(positions)))  # [B, K]
    positions = positions.numpy()
    lengths = np.array(kv.lengths)
    ends = np.array(kv.starts) + lengths
    real = np.arange(n) < lengths[:, None]  # [B, N]
    first = np.where(real, positions, LAST).min(axis=1)  # [B]
    low = np.maximum(first - context + 1, 0)  # a row's context lies at or after its entry's lowest row's
    seen = mask[:, 0].numpy()  # [B, N, K]
    found = [np.nonzero(seen[b, :, low[b] : ends[b]]) for b in range(len(low))]  # each entry's window: (row, key) [P_b]
    entry = np.repeat(np.arange(len(low)), [len(r) for r, _ in found])  # [P]
    row = np.concatenate([r for r, _ in found])
    key = np.concatenate([k for _, k in found]) + low[entry]
    return context_hashes(keys, places, (entry, row, key), positions, context)


class SyntheticLM:
    """What `TargetModel` reads of a runtime model, for a timed target: a KV of one head of width one (a row's token
    and position), the law's vocabulary and the profile's feature width."""

    def __init__(self, profile: Profile):
        self.config = {"model_type": "synthetic", "profile": profile.name}
        self.num_layers, self.kv_heads, self.head_dim = 1, 1, 1
        self.vocab_size = profile.law.vocab
        self.hidden_size = profile.feature_width
        self.max_positions = profile.max_positions
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.shard = Shard()
        self.experts = 0
        self.head = None

    def sliding_window(self) -> None:
        return None

    def tensors(self) -> list[torch.Tensor]:
        """No weights."""
        return []


class TimedTarget(TargetModel):
    """A target whose forward holds `device` for the profile's target cost and returns the law's logits; features are
    zeros of the profile's width and dtype (what the wire carries), materialised only for the rows taken."""

    def __init__(self, profile: Profile, device: EmulatedDevice, kv_slots: int = DEFAULT_KV_SLOTS, max_seq_len: int | None = None):
        super().__init__(SyntheticLM(profile), FeatureAddress.eagle1(), kv_slots=kv_slots, max_seq_len=max_seq_len, graphs=False)
        self.fingerprint = emulated_manifest(profile).target
        self.law, self.cost, self.device = profile.law, profile.target, device
        self.feature_dtype = WIRE_DTYPES[profile.feature_dtype]
        self.bucketed = False

    @torch.no_grad()
    def run_local(self, calls: list[TargetCall]) -> list[TargetOutput]:
        rows = [c.rows for c in calls]
        lengths = [int(r.tokens.shape[0]) for r in rows]
        with self.device.hold(self.cost.seconds(sum(lengths), [r.start + n for r, n in zip(rows, lengths)])):
            packed = pack(rows, self.pool)
            hashes = torch.from_numpy(row_hashes(packed.tokens, packed.positions, packed.kv, packed.mask, self.law.context))  # [B, N]
            hashes = split_rows(packed.rows(hashes), lengths)
            zero = torch.zeros((), dtype=self.feature_dtype)
            return [
                TargetOutput(torch.from_numpy(target_logits(h.numpy(), self.law)) if c.with_logits else None, zero.expand(len(h), self.hidden_size), frozenset())
                for c, h in zip(calls, hashes)
            ]


@dataclass(frozen=True)
class HeadLayout:
    """The KV layout a drafter's pool is sized by: one head of width one (a row's token and position)."""

    kv_heads: int = 1
    head_dim: int = 1


class SyntheticDrafter(nn.Module):
    """A drafter whose step holds `device` for `cost` and whose state is each row's context hash: the law's
    candidates follow from it. It reads no target features (they only cross the wire). A step draws its rows'
    candidates inside its hold, as a drafter's head runs inside its step on the device (docs/emulation.md); a step of
    no time (`null`) leaves them to be drawn when asked for."""

    bound = False
    attention = HeadLayout()
    dtype = torch.float32
    device = torch.device("cpu")
    hidden_size = 1  # the state: a context hash, exact in float32

    def __init__(self, law: Law, cost: ForwardCost, device: EmulatedDevice):
        super().__init__()
        self.law, self.cost, self.emulated = law, cost, device
        self.embed = nn.Embedding(law.vocab, 1).requires_grad_(False)  # its vocabulary, for code that reads it there
        self._drawn = (np.empty(0, dtype=np.int64), None, None)  # the last step's hashes (sorted) and candidates

    def seed_hidden(self, target_features: torch.Tensor) -> torch.Tensor:
        """[m, F] -> [m, 1] states (a step's state is its row's hash, whatever the input)."""
        return torch.zeros(target_features.shape[0], 1)

    @torch.no_grad()
    def step(self, states: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, kv: SlotBatch, mask: torch.Tensor) -> torch.Tensor:
        """Tokens and positions [B, N] over `kv`, what rows see `mask` [B, 1, N, K] -> each row's hash [B, N, 1]."""
        keys = [s + n for s, n in zip(kv.starts, kv.lengths)]
        seconds = self.cost.seconds(sum(kv.lengths), keys)
        with self.emulated.hold(seconds):
            hashes = row_hashes(tokens, positions, kv, mask, self.law.context)  # [B, N]
            if seconds > 0:  # in the device's time (a step of no time leaves them to `top_candidates`)
                drawn = np.unique(hashes)  # sorted
                self._drawn = (drawn, *draft_candidates(drawn, self.law, self.law.ranked))
            return torch.from_numpy(hashes.astype(np.float32))[..., None]  # exact: hashes < 2^24

    def top_candidates(self, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Q, 1] states -> the law's k likeliest tokens [Q, k] and their probabilities [Q, k] float64 (drawn by the
        last step of some device time when it made them all)."""
        h = states[:, 0].numpy().astype(np.int64)
        drawn, tokens, probs = self._drawn
        if len(drawn):
            at = np.searchsorted(drawn, h).clip(max=len(drawn) - 1)
            if (drawn[at] == h).all():
                return torch.from_numpy(tokens[at, :k]), torch.from_numpy(probs[at, :k])
        tokens, probs = draft_candidates(h, self.law, k)
        return torch.from_numpy(tokens), torch.from_numpy(probs)
