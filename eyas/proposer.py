"""The draft side of a round: one request's draft KV and the EAGLE-2 tree it proposes.

Draft KV rows are committed only for verified target features (seed and reseed rows); the
rows a tree expansion adds are provisional and are dropped at the next reseed or proposal.
A committed draft row t holds (feature f_t, advanced token x_{t+1}) at position t, so the
committed draft length always equals the target's committed prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .drafters import Drafter, KVCache
from .errors import VersionError
from .tree import DraftTree, FlattenedTree, TreeError, TreePolicy, flatten


@dataclass
class Proposal:
    """A proposed tree and what it cost: nodes expanded (drafter rows run), nodes recorded, temporary KV bytes,
    and the seconds spent on tree bookkeeping (recording, reranking, flattening) outside drafter forwards."""

    tree: FlattenedTree
    nodes_expanded: int
    nodes_recorded: int
    draft_kv_bytes: int
    tree_seconds: float = 0.0
    draft_tree: DraftTree | None = None  # every recorded node, for tree tuning (not sent on the wire)
    row_nodes: list[int] | None = None  # draft-tree node of each flattened row


class DraftSession:
    """One request's drafter state: committed draft KV, pending seed rows, and the root's draft state."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.kv = KVCache()
        self.committed = 0
        self.version = 0
        self.pending_state: torch.Tensor | None = None  # [m, d] drafter inputs of verified rows not yet run
        self.pending_tokens: list[int] = []
        self.root_state: torch.Tensor | None = None  # [d] drafter output at the last committed row
        self.root_token: int | None = None
        self.last_reseed: tuple[int, tuple[int, ...]] | None = None

    @property
    def length(self) -> int:
        """Committed draft rows plus pending ones: the target prefix this session is seeded to."""
        return self.committed + len(self.pending_tokens)

    @torch.no_grad()
    def _queue(self, features: torch.Tensor, tokens: list[int]) -> None:
        """Drop tree rows; queue verified rows: features f_t [m, F] with the tokens x_{t+1} [m] that follow them."""
        if features.shape[0] != len(tokens):
            raise ValueError(f"features: {features.shape[0]} rows for {len(tokens)} tokens")
        self.kv.truncate(self.committed)
        if not tokens:
            return
        state = self.drafter.seed_hidden(features.to(self.drafter.dtype))  # [m, d]
        self.pending_state = state if self.pending_state is None else torch.cat([self.pending_state, state])
        self.pending_tokens += [int(t) for t in tokens]

    def start(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        """Seed an empty session from a prefill of the committed tokens, at the request's `version`."""
        if self.length or self.kv.keys is not None:
            raise RuntimeError("start runs once, on an empty draft session")
        self._queue(features, tokens)
        self.version = version

    def reseed(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        """Publish step for the draft side: drop tree rows, queue the accepted rows' target features.

        Idempotent per version: a retried reseed of the version just applied is a no-op.
        """
        if self.last_reseed == (version, tuple(tokens)) and self.version == version + 1:
            return
        if version != self.version:
            raise VersionError("draft cache", self.version, version)
        self._queue(features, tokens)
        self.version = version + 1
        self.last_reseed = (version, tuple(tokens))

    def _run_pending(self) -> None:
        """Run the queued verified rows causally on top of the committed draft KV; they become committed."""
        if self.pending_state is None:
            self.kv.truncate(self.committed)
            return
        m = len(self.pending_tokens)
        positions = torch.arange(self.committed, self.committed + m)
        mask = torch.ones(m, self.committed + m, dtype=torch.bool)
        mask[:, self.committed :] = torch.ones(m, m, dtype=torch.bool).tril()
        out = self.drafter.step(
            self.pending_state[None],
            torch.tensor(self.pending_tokens)[None],
            positions[None],
            self.kv,
            mask[None, None],
        )[0]  # [m, d]
        self.committed += m
        self.root_state = out[-1]
        self.root_token = self.pending_tokens[-1]
        self.pending_state = None
        self.pending_tokens = []

    @torch.no_grad()
    def propose(self, version: int, root_token: int, policy: TreePolicy) -> Proposal:
        """Build the EAGLE-2 tree rooted at the append-required token and flatten it for verification."""
        if version != self.version:
            raise VersionError("draft cache", self.version, version)
        seeded_root = self.pending_tokens[-1] if self.pending_tokens else self.root_token
        if seeded_root is not None and root_token != seeded_root:
            raise TreeError("root_token", f"{root_token} is not the last seeded token {seeded_root}")
        self._run_pending()
        prefix_len = self.committed
        tree = DraftTree(root_token)
        if self.root_state is None or policy.depth == 0 or policy.budget == 0:
            return Proposal(flatten(tree, [], prefix_len), 0, 1, 0, 0.0, tree, [0])

        states = {0: self.root_state}  # node -> drafter output predicting its children
        path_rows: dict[int, list[int]] = {0: []}  # expanded node -> provisional draft-KV rows of its path
        expanded_count = 0
        expanded = [0]
        tree_seconds = 0.0
        for depth in range(policy.depth):
            if depth > 0:
                expanded = tree.expandable(policy.top_k)
                out = self._expand(tree, expanded, states, path_rows, prefix_len)  # [Q, d]
                expanded_count += len(expanded)
                states.update(zip(expanded, out))
            tokens, probs = self.drafter.top_candidates(torch.stack([states[n] for n in expanded]), policy.top_k)
            start = time.perf_counter()
            parents = torch.tensor(expanded).repeat_interleave(tokens.shape[1])
            tree.add_expansion(expanded, parents, tokens.flatten(), probs.flatten())
            tree_seconds += time.perf_counter() - start
        start = time.perf_counter()
        selected = tree.select(policy.budget)
        flat = flatten(tree, selected, prefix_len)
        tree_seconds += time.perf_counter() - start
        return Proposal(flat, expanded_count, len(tree), self.kv.nbytes(expanded_count), tree_seconds, tree, [0, *selected])

    def _expand(
        self,
        tree: DraftTree,
        nodes: list[int],
        states: dict[int, torch.Tensor],
        path_rows: dict[int, list[int]],
        prefix_len: int,
    ) -> torch.Tensor:
        """Run the drafter on tree nodes: each sees the committed rows, its draft ancestors and itself."""
        base = len(self.kv)
        mask = torch.zeros(len(nodes), base + len(nodes), dtype=torch.bool)
        mask[:, : self.committed] = True
        for i, node in enumerate(nodes):
            path_rows[node] = path_rows[tree.parents[node]] + [base + i]
            mask[i, path_rows[node]] = True
        hidden = torch.stack([states[tree.parents[n]] for n in nodes])  # [Q, d]
        tokens = torch.tensor([tree.tokens[n] for n in nodes])
        positions = torch.tensor([prefix_len - 1 + tree.depths[n] for n in nodes])
        return self.drafter.step(hidden[None], tokens[None], positions[None], self.kv, mask[None, None])[0]
