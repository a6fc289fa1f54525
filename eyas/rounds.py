"""The speculation round (docs/round.md), written once for every deployment.

`start` seeds (or rebuilds) a request's target and draft caches from its committed tokens;
`run_round` drafts a tree, verifies it and publishes the result. Both are operations
(`eyas.steps`): the in-process engine drives the rounds of many requests in lockstep over local
sessions, so their forwards batch; the coordinator runs each request's round alone over proxies of
remote workers, whose operations run no local forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .publish import publish
from .request import RequestState
from .sampling import SamplingParams
from .steps import Steps, run_alone
from .tree import DraftTree, FlattenedTree, TreePolicy
from .verify import AcceptanceDecision


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
    assumed: tuple[tuple[int, ...], int] | None = None  # drafted ahead: the (accepted tokens, bonus) it assumed
    assumed_rows: tuple[int, ...] | None = None  # drafted ahead: the rows of the tree before it that outcome accepts


@dataclass
class Verification:
    """What one tree verification yields: the decision, the accepted rows' target features, and costs."""

    decision: AcceptanceDecision
    features: torch.Tensor  # [len(accepted_rows), F], in accepted-row order; F = 0 where they stayed with a draft worker
    experts: frozenset[tuple[int, int]]
    branch_kv_bytes: int
    row_probs: torch.Tensor | None = None  # [N] conditional acceptance probability of every row (verify.decide)


class Drafting(Protocol):
    def start_steps(self, version: int, features: torch.Tensor, tokens: list[int]) -> Steps[None]: ...
    def propose_steps(self, version: int, root_token: int, policy: TreePolicy) -> Steps[Proposal]: ...
    def reseed(self, version: int, features: torch.Tensor, tokens: list[int]) -> None: ...


class Verifying(Protocol):
    def prefill_steps(self, version: int, tokens: list[int]) -> Steps[torch.Tensor]: ...
    def verify_steps(self, tree: FlattenedTree, version: int, params: SamplingParams) -> Steps[Verification]: ...
    def commit(self, version: int, accepted_rows: tuple[int, ...]) -> None: ...


@dataclass
class RoundRecord:
    """Everything one round produced and cost; the basis of stats, metrics and traces.

    `features` are the accepted rows' target features: with the decision, what the target sends back.
    """

    version: int
    tree: FlattenedTree
    decision: AcceptanceDecision
    emitted: list[int]
    nodes_expanded: int
    nodes_recorded: int
    draft_kv_bytes: int
    target_kv_bytes: int
    experts: frozenset[tuple[int, int]]
    seconds: dict[str, float] = field(default_factory=dict)
    features: torch.Tensor | None = None
    draft_tree: DraftTree | None = None  # all recorded nodes (in process only), for tree tuning
    row_nodes: list[int] | None = None  # draft-tree node of each flattened row
    row_probs: torch.Tensor | None = None  # [N] acceptance probability of each row given its parent
    policy: TreePolicy | None = None  # the tree policy this round drafted with
    pre_built: bool = False  # the tree was drafted ahead, during the previous verification


def start(request: RequestState, draft: Drafting, target: Verifying) -> None:
    """`start_steps` run alone."""
    run_alone(start_steps(request, draft, target))


def start_steps(request: RequestState, draft: Drafting, target: Verifying) -> Steps[None]:
    """Prefill every committed token but the append-required root and seed the drafter with their features (the
    drafter's own prefill: its KV of the prompt is written here, not in the first round)."""
    tokens = request.tokens
    features = yield from target.prefill_steps(request.version, tokens[:-1])  # [n - 1, F]
    yield from draft.start_steps(request.version, features, tokens[1:])


def run_round(request: RequestState, draft: Drafting, target: Verifying, policy: TreePolicy) -> RoundRecord:
    """`round_steps` run alone."""
    return run_alone(round_steps(request, draft, target, policy))


def round_steps(request: RequestState, draft: Drafting, target: Verifying, policy: TreePolicy) -> Steps[RoundRecord]:
    """Draft, verify and publish one round of `request`."""
    version = request.version
    t0 = time.perf_counter()
    proposal = yield from draft.propose_steps(version, request.root_token, policy)
    t1 = time.perf_counter()
    verification = yield from target.verify_steps(proposal.tree, version, request.sampling)
    t2 = time.perf_counter()
    emitted = publish(request, verification.decision, verification.features, target, draft)
    t3 = time.perf_counter()
    return RoundRecord(
        version=version,
        tree=proposal.tree,
        decision=verification.decision,
        emitted=emitted,
        nodes_expanded=proposal.nodes_expanded,
        nodes_recorded=proposal.nodes_recorded,
        draft_kv_bytes=proposal.draft_kv_bytes,
        target_kv_bytes=verification.branch_kv_bytes,
        experts=verification.experts,
        seconds={
            "draft": t1 - t0 - proposal.tree_seconds,
            "tree": proposal.tree_seconds,
            "verify": t2 - t1,
            "publish": t3 - t2,
        },
        features=verification.features,
        draft_tree=proposal.draft_tree,
        row_nodes=proposal.row_nodes,
        row_probs=verification.row_probs,
        policy=policy,
        pre_built=proposal.assumed is not None,
    )
