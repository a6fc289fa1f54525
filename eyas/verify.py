"""Exact acceptance of a verified tree (docs/sampling.md): greedy and seeded sampling.

Pure functions of the flattened tree, the target logits of its rows and the sampling options;
they decide which root-to-node path is accepted and which frontier token the target emits. Under
sampling the target's token at each position is the one its position-keyed noise picks, and a draft
child is accepted exactly when it is that token, so a seed fixes the text whatever the tree.
"""

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
    """From the root, follow the child whose token is the target's pick at its parent row; stop where no child is.

    Returns the accepted rows (root first) and the target's pick at the last of them: the frontier token.
    """
    tokens, parents, draft_probs = tree.tokens.tolist(), tree.parents.tolist(), tree.draft_probs.tolist()
    rows = [0]
    while True:
        chosen = pick(rows[-1])
        match = [c for c in children(parents, draft_probs, rows[-1]) if tokens[c] == chosen]
        if not match:
            return rows, chosen
        rows.append(match[0])


def greedy_decision(tree: FlattenedTree, logits: torch.Tensor) -> tuple[AcceptanceDecision, torch.Tensor]:
    """Longest path whose every token is the target argmax at its parent, plus the argmax after it.

    logits: [N, V], row i is the target's next-token logits after the path to row i. Also returns the [N]
    float64 conditional acceptance of every row: 1 where its token is the argmax at its parent (root: 1).
    The target probabilities the decision reports (every node's token, the frontier token) are informational
    under greedy: a log-normaliser for each row that needs one (the parents, the last accepted row), from float32
    exponentials summed in float64. The arithmetic runs in numpy, whose row reductions cost a tenth of torch's at
    this size (a round's own time).
    """
    scores = logits.detach().float().cpu().numpy()  # [N, V]
    best = scores.argmax(axis=-1).tolist()  # [N]
    rows, frontier = accepted_path(tree, best.__getitem__)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    at, picked = [*parents[1:], rows[-1]], [*tokens[1:], frontier]  # each node's parent row and token, then the frontier's
    normed = sorted(set(at))
    block = scores[normed]  # [P, V]
    top = block.max(axis=-1, keepdims=True)  # [P, 1]
    log_norm = top[:, 0] + np.log(np.exp(block - top).sum(axis=-1, dtype=np.float64))  # [P] float64
    norm_of = dict(zip(normed, log_norm.tolist()))
    probs = [math.exp(float(scores[r, t]) - norm_of[r]) for r, t in zip(at, picked)]  # [N]
    decision = AcceptanceDecision(tuple(rows), tuple(tokens[r] for r in rows[1:]), frontier, probs[-1], (1.0, *probs[:-1]))
    matches = [1.0, *(float(best[p] == t) for p, t in zip(parents[1:], tokens[1:]))]
    return decision, torch.tensor(matches, dtype=torch.float64)


def sampled_decision(tree: FlattenedTree, log_probs: torch.Tensor, seed: int) -> tuple[AcceptanceDecision, torch.Tensor]:
    """At each row of the path, the target's token is the one the seed's noise of the next position picks from
    the row's distribution; the child carrying that token is accepted, and where none does it is the frontier.

    Child x of a reached row is thus accepted with probability p(x), as under the sequential rule (try the
    children in order, accept with the residual probability, renormalise on rejection; docs/sampling.md), and
    every emitted token is distributed exactly as the target's. log_probs: [N, V] float64 target log-distributions.
    Also returns the [N] float64 conditional acceptance of every row: p(token | parent row) (root: 1).
    """
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
    """The acceptance decision of a round, greedy or sampled per `params`, and every row's conditional acceptance.

    The second value ([N] float64) is the probability that each row's token is accepted given its parent row
    was; a node's path product is its chance to be on the accepted path (the tree tuner's input).
    """
    if params.greedy:
        return greedy_decision(tree, logits)
    return sampled_decision(tree, target_log_probs(logits, params), params.seed)
