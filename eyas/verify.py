"""Exact acceptance of a verified tree (facts.md section 3): greedy and distribution-preserving sampling.

Pure functions of the flattened tree, the target logits of its rows and the round's draws;
they decide which root-to-node path is accepted and which frontier token the target emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, round_draws, target_probs
from .tree import FlattenedTree


@dataclass(frozen=True)
class AcceptanceDecision:
    """Accepted flat rows (root first, one root-to-node path), their tokens after the root, and the frontier token.

    `draws` are the uniforms the sampler consumed, in order (empty for greedy), so a round replays bit for bit.
    `frontier_prob` is the target probability of the frontier token under the distribution it was drawn from.
    `token_probs[i]` is the target probability of row i's token under its parent row's distribution (1 for the
    root), so a recorded round shows how much the target liked every node it was offered.
    """

    accepted_rows: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    frontier_token: int
    frontier_prob: float
    draws: tuple[float, ...] = ()
    token_probs: tuple[float, ...] = ()

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted this round (the root is not a draft)."""
        return len(self.accepted_tokens)


def node_probs(tree: FlattenedTree, probs: torch.Tensor) -> tuple[float, ...]:
    """Target probability of each row's token under its parent row's distribution (1 for the root); probs: [N, V]."""
    return (1.0, *probs[tree.parents[1:], tree.tokens[1:]].tolist())


def node_probs_from_logits(tree: FlattenedTree, logits: torch.Tensor) -> tuple[float, ...]:
    """`node_probs` of the softmax of [N, V] logits, normalising only the rows that are parents (cheap for greedy)."""
    parents = tree.parents[1:]
    rows, index = torch.unique(parents, return_inverse=True)
    log_norm = torch.logsumexp(logits[rows].to(torch.float64), dim=-1)
    return (1.0, *(logits[parents, tree.tokens[1:]].to(torch.float64) - log_norm[index]).exp().tolist())


def greedy_decision(tree: FlattenedTree, logits: torch.Tensor) -> AcceptanceDecision:
    """Longest path whose every token is the target argmax at its parent, plus the argmax after it.

    logits: [N, V], row i is the target's next-token logits after the path to row i.
    """
    best = logits.argmax(dim=-1).tolist()  # [N]
    tokens = tree.tokens.tolist()
    rows = [0]
    while True:
        match = [c for c in tree.children(rows[-1]) if tokens[c] == best[rows[-1]]]
        if not match:
            break
        rows.append(match[0])
    frontier = best[rows[-1]]
    prob = torch.softmax(logits[rows[-1]].to(torch.float64), dim=-1)[frontier].item()
    return AcceptanceDecision(
        tuple(rows), tuple(tokens[r] for r in rows[1:]), frontier, prob, (), node_probs_from_logits(tree, logits)
    )


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw of one token from a [V] distribution with the uniform `u`."""
    cdf = torch.cumsum(probs, dim=0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=cdf.dtype), right=True))
    last_nonzero = int(probs.nonzero().max())
    return min(index, last_nonzero)


def sampled_decision(tree: FlattenedTree, probs: torch.Tensor, draws: torch.Tensor) -> AcceptanceDecision:
    """Walk the tree from the root; at each node try its children in draft order.

    Child x is accepted with probability p'(x), where p' is the node's target distribution with the
    already rejected siblings zeroed and renormalised; if all children are rejected the frontier
    token is drawn from p'. This keeps every emitted token distributed exactly as the target's.
    probs: [N, V] float64 target distributions per row; draws: [>= N] uniforms.
    """
    tokens = tree.tokens.tolist()
    used: list[float] = []
    rows = [0]
    while True:
        residual = probs[rows[-1]].clone()
        accepted = None
        for child in tree.children(rows[-1]):
            u = draws[len(used)].item()
            used.append(u)
            x = tokens[child]
            if u < residual[x].item():
                accepted = child
                break
            residual[x] = 0.0
            residual = residual / residual.sum()
        if accepted is None:
            u = draws[len(used)].item()
            used.append(u)
            frontier = sample_from(residual, u)
            prob = residual[frontier].item()
            break
        rows.append(accepted)
    accepted = tuple(tokens[r] for r in rows[1:])
    return AcceptanceDecision(tuple(rows), accepted, frontier, prob, tuple(used), node_probs(tree, probs))


def row_acceptance(tree: FlattenedTree, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N] float64: the probability that each row's token is accepted given its parent row was.

    Greedy: 1 where the token is the target argmax at its parent, else 0. Sampling: the target's
    probability of the token at its parent, which is exactly its acceptance probability under
    `sampled_decision`. The root is 1. A node's path product is its chance to be on the accepted path.
    """
    rows, tokens = tree.parents[1:], tree.tokens[1:]
    if params.greedy:
        conditional = (logits.argmax(dim=-1)[rows] == tokens).to(torch.float64)
    else:
        conditional = target_probs(logits[rows], params).gather(1, tokens[:, None])[:, 0]
    return torch.cat([torch.ones(1, dtype=torch.float64), conditional])


def decide(
    tree: FlattenedTree, logits: torch.Tensor, params: SamplingParams, version: int, draws: torch.Tensor | None = None
) -> AcceptanceDecision:
    """The acceptance decision of the round building on `version`, greedy or sampled per `params`.

    `draws` replaces the round's own uniforms (a trace replay passes the recorded ones); at least N of them.
    """
    if params.greedy:
        return greedy_decision(tree, logits)
    if draws is None:
        draws = round_draws(params.seed, version, tree.num_rows)
    return sampled_decision(tree, target_probs(logits, params), draws)
