"""Plain (non-speculative) decoding: the round run with a root-only tree and no drafter.

Verifying a tree that holds only the root is one target forward that emits one token, the target's own
pick at the next position: greedy argmax, or under sampling the token that position's seeded noise picks
(docs/sampling.md). Speculation on or off therefore gives the same text for the same seed.
"""

from __future__ import annotations

import torch

from .errors import VersionError
from .proposer import Proposal
from .steps import Steps, without_forwards
from .tree import DraftTree, TreePolicy, flatten

PLAIN_POLICY = TreePolicy(width=1, depth=0, budget=0)  # what a plain round records as its tree policy


class NoDraft:
    """The draft side of plain decoding: proposes the root alone and only counts the committed rows."""

    def __init__(self) -> None:
        self.committed = 0
        self.version = 0

    def start_steps(self, version: int, features: torch.Tensor, tokens: list[int]) -> Steps[None]:
        """`start` as an operation (it runs no forward)."""
        return without_forwards(self.start, version, features, tokens)

    def start(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        """Begin at `version` on a target prefix of features.shape[0] committed rows."""
        self.committed = features.shape[0]
        self.version = version

    def propose_steps(self, version: int, root_token: int, policy: TreePolicy) -> Steps[Proposal]:
        """`propose` as an operation (it runs no forward)."""
        return without_forwards(self.propose, version, root_token, policy)

    def propose(self, version: int, root_token: int, policy: TreePolicy) -> Proposal:
        """The tree of the append-required token alone, whatever `policy` asks."""
        if version != self.version:
            raise VersionError("plain draft", self.version, version)
        return Proposal(flatten(DraftTree(root_token), [], self.committed), 0, 1, 0)

    def reseed(self, version: int, features: torch.Tensor, tokens: list[int]) -> None:
        """Count the rows the round committed (features: [accepted rows, F])."""
        if version != self.version:
            raise VersionError("plain draft", self.version, version)
        self.committed += features.shape[0]
        self.version = version + 1

    def close(self) -> None:
        """Nothing to free: plain decoding holds no draft KV."""
