"""The publish transaction (docs/round.md#publish), shared by the in-process engine and the coordinator.

After a verification the request's committed output advances first (it is the source of truth);
then the target keeps the KV of the accepted rows only and the drafter drops its tree rows and
queues the accepted rows' verified target features. The frontier token is emitted now but has
no KV or feature yet: it is the next tree's root.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .request import RequestState
from .verify import AcceptanceDecision


class TargetCommit(Protocol):
    def commit(self, version: int, accepted_rows: tuple[int, ...]) -> None: ...


class DraftReseed(Protocol):
    def reseed(self, version: int, features: torch.Tensor, tokens: list[int]) -> None: ...


def reseed_tokens(decision: AcceptanceDecision) -> list[int]:
    """The tokens that follow each accepted row: its accepted child, and the frontier token after the last."""
    return [*decision.accepted_tokens, decision.frontier_token]


def publish(
    request: RequestState,
    decision: AcceptanceDecision,
    features: torch.Tensor,
    target: TargetCommit,
    draft: DraftReseed,
) -> list[int]:
    """Commit one verified round to all three owners; returns the tokens emitted to the client.

    features: [len(accepted_rows), F] target features of the accepted rows, in path order.
    """
    if features.shape[0] != len(decision.accepted_rows):
        raise ValueError(f"features: {features.shape[0]} rows for {len(decision.accepted_rows)} accepted rows")
    version = request.version
    emitted = request.commit(version, reseed_tokens(decision))
    target.commit(version, decision.accepted_rows)
    draft.reseed(version, features, reseed_tokens(decision))
    return emitted
