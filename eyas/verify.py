"""Exact acceptance of a verified tree, greedy and seeded (docs/sampling.md): pure functions of the flattened
tree, its rows' target logits and the sampling options -> the accepted path and the frontier token."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from .keyed import keyed_token, target_log_probs
from .treerows import AcceptanceDecision, children
from .sampling import SamplingParams
from .tree import FlattenedTree


def accepted_path(tree: FlattenedTree, pick: Callable[[int], int]) -> tuple[list[int], int]:
    """From the root, follow the child whose token is `pick(parent row)` -> accepted rows (root first) and the pick
    after the last of them (the frontier token)."""
    tokens, parents, draft_probs = tree.tokens.tolist(), tree.parents.tolist(), tree.draft_probs.tolist()
    rows = [0]
    while True:
        chosen = pick(rows[-1])
        match = [c for c in children(parents, draft_probs, rows[-1]) if tokens[c] == chosen]
        if not match:
            return rows, chosen
        rows.append(match[0])


def greedy_decision(tree: FlattenedTree, logits: torch.Tensor) -> tuple[AcceptanceDecision, torch.Tensor]:
    """The longest path of target argmaxes, and the argmax after it. logits [N, V] (row i: after the path to row i)
    -> the decision and each row's conditional acceptance [N] float64 (1 where its token is its parent's argmax).
    The probabilities the decision reports are informational under greedy."""
    scores = logits.detach().float().cpu().numpy()  # [N, V]; numpy's row reductions cost a tenth of torch's here
    best = scores.argmax(axis=-1).tolist()  # [N]
    rows, frontier = accepted_path(tree, best.__getitem__)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    at, picked = [*parents[1:], rows[-1]], [*tokens[1:], frontier]  # each node's parent row and token, then the frontier's
    normed = sorted(set(at))
    block = scores[normed]  # [P, V]
    top = block.max(axis=-1, keepdims=True)  # [P, 1]
    log_norm = top[:, 0] + np.log(np.exp(block - top).sum(axis=-1, dtype=np.float64))  # [P] float64 log-normalisers
    norm_of = dict(zip(normed, log_norm.tolist()))
    probs = [math.exp(float(scores[r, t]) - norm_of[r]) for r, t in zip(at, picked)]  # [N]
    decision = AcceptanceDecision(tuple(rows), tuple(tokens[r] for r in rows[1:]), frontier, probs[-1], (1.0, *probs[:-1]))
    matches = [1.0, *(float(best[p] == t) for p, t in zip(parents[1:], tokens[1:]))]
    return decision, torch.tensor(matches, dtype=torch.float64)


def sampled_decision(tree: FlattenedTree, log_probs: torch.Tensor, seed: int) -> tuple[AcceptanceDecision, torch.Tensor]:
    """At each row the target's token is the one the seed's noise of the next position picks from log_probs [N, V]
    float64; the child carrying it is accepted, else it is the frontier (docs/sampling.md). Also returns each row's
    conditional acceptance p(token | parent row) [N] float64."""
    positions = tree.positions.tolist()
    rows, frontier = accepted_path(tree, lambda row: keyed_token(log_probs[row], seed, positions[row] + 1))
    tokens = tree.tokens.tolist()
    acceptance = torch.cat(
        [torch.ones(1, dtype=torch.float64), log_probs[tree.parents[1:], tree.tokens[1:]].exp().cpu()]
    )  # [N]
    decision = AcceptanceDecision(
        tuple(rows),
        tuple(tokens[r] for r in rows[1:]),
        frontier,
        log_probs[rows[-1], frontier].exp().item(),
        tuple(acceptance.tolist()),
    )
    return decision, acceptance


def decide(tree: FlattenedTree, logits: torch.Tensor, params: SamplingParams) -> tuple[AcceptanceDecision, torch.Tensor]:
    """A round's decision, greedy or sampled per `params`, and each row's acceptance given its parent's [N] float64."""
    if params.greedy:
        return greedy_decision(tree, logits)
    return sampled_decision(tree, target_log_probs(logits, params), params.seed)
