"""Invariant checks on every record of a trace, without any model.

Tree structure is checked by the engine's own receipt checks (`check_tree`, `check_decision`, no torch);
this module adds what only a whole request shows: the prefix and root each tree builds on, the
versions, the sampling options, and the output the rounds committed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import WireError
from ..request import make_sampling
from ..treerows import TreeError, check_decision, check_tree
from .messages import decode_round
from .store import TracedRequest

INVARIANTS = {
    "request": "a request record opens every traced request",
    "messages": "the recorded tree and decision decode and name their request",
    "parents": "parents precede children",
    "mask": "mask is the ancestry closure",
    "positions": "positions are the committed prefix plus depth",
    "budget": "the tree respects the verify budget",
    "tree": "the tree's other fields are well formed (tokens, depths, retrieve map, draft probabilities)",
    "path": "accepted rows form one root-to-node path carrying the accepted tokens",
    "decision": "the frontier token and the probabilities are valid",
    "output": "accepted tokens and frontier token are consistent with the committed output",
    "versions": "versions increase by one",
    "sampling": "every round samples with the request's options (seed included), and they are valid",
    "manifest": "every message names the request's manifest",
}
TREE_FIELDS = {"parents": "parents", "mask": "mask", "positions": "positions", "prefix_len": "positions"}
DECISION_FIELDS = {"decision.accepted_rows": "path", "decision.accepted_tokens": "path"}
UNBOUNDED_VOCAB = 2**62


@dataclass(frozen=True)
class Violation:
    request: str
    round: int | None
    invariant: str
    detail: str
    offset: int = -1

    def __str__(self) -> str:
        where = f"request {self.request}" + (f", round {self.round}" if self.round is not None else "")
        return f"{where}: {INVARIANTS[self.invariant]}: {self.detail} (byte {self.offset})"


def check_request(request: TracedRequest) -> list[Violation]:
    """Every broken invariant of one traced request, in record order."""
    out: list[Violation] = []
    start = request.start
    if start is None:
        out.append(Violation(request.key, None, "request", "rounds without a request record"))
    vocab = _vocab_size(start.manifest if start is not None else None)
    output: list[int] = []
    version = 0
    for index, rnd in enumerate(request.rounds):
        last = index == len(request.rounds) - 1

        def bad(invariant: str, detail: str) -> None:
            out.append(Violation(request.key, rnd.round, invariant, detail, rnd.offset))

        if rnd.version != version:
            bad("versions", f"round at version {rnd.version}, expected {version}")
        version = rnd.version + 1
        committed = output[:]
        output += rnd.emitted
        try:
            tree, decision, tree_msg, decision_msg = decode_round(rnd)
        except WireError as exc:
            bad("messages", str(exc))
            continue
        for name, ref in (("tree", tree_msg.ref), ("decision", decision_msg.ref)):
            if ref.request_id != rnd.request:
                bad("messages", f"the {name} names request {ref.request_id!r}")
            if ref.version != rnd.version:
                bad("versions", f"the {name} names version {ref.version}, the round is at {rnd.version}")
            if ref.manifest_id != rnd.manifest_id or (start is not None and ref.manifest_id != start.manifest_id):
                bad("manifest", f"the {name} names manifest {ref.manifest_id!r}")
        budget = rnd.policy.get("budget")
        if type(budget) is not int:
            bad("budget", f"the recorded policy has no integer budget ({budget!r})")
        elif tree.num_rows - 1 > budget:
            bad("budget", f"{tree.num_rows - 1} candidate rows exceed the budget {budget}")
        if start is not None:
            tokens = start.prompt_ids + committed
            if tree.prefix_len != len(tokens) - 1:
                bad("positions", f"the tree sits on prefix {tree.prefix_len}, {len(tokens) - 1} tokens are committed")
            if tree.num_rows and tree.tokens[0] != tokens[-1]:
                bad("output", f"the root token {tree.tokens[0]} is not the last committed token {tokens[-1]}")
        try:
            check_tree(tree, vocab_size=vocab)
        except TreeError as exc:
            bad(TREE_FIELDS.get(exc.field, "tree"), str(exc))
            continue
        try:
            check_decision(decision, tree, vocab)
        except WireError as exc:
            bad(DECISION_FIELDS.get(exc.field, "decision"), str(exc))
            continue
        full = [*decision.accepted_tokens, decision.frontier_token]
        if not rnd.emitted or rnd.emitted != full[: len(rnd.emitted)]:
            bad("output", f"emitted {rnd.emitted}, the decision gives {full}")
        elif len(rnd.emitted) < len(full) and not last:
            bad("output", f"a stop cut the round's tokens {full} to {rnd.emitted}, yet the request went on")
        if start is not None and rnd.sampling != start.sampling:
            bad("sampling", f"the round samples with {rnd.sampling}, the request asked for {start.sampling}")
        try:
            make_sampling(**rnd.sampling)
        except (ValueError, TypeError) as exc:
            bad("sampling", f"the sampling options are invalid ({exc})")
    end = request.end
    if end is not None:
        if end.output_ids != output:
            detail = f"the end record's output {end.output_ids} is not the rounds' {output}"
            out.append(Violation(request.key, None, "output", detail, end.offset))
        if end.version != version and not end.error:
            detail = f"the request ends at version {end.version}, expected {version}"
            out.append(Violation(request.key, None, "versions", detail, end.offset))
    return out


def _vocab_size(manifest: dict | None) -> int:
    """The target vocabulary named by a recorded manifest, else no bound."""
    size = (manifest or {}).get("target", {})
    size = size.get("vocab_size") if isinstance(size, dict) else None
    return size if type(size) is int and size > 0 else UNBOUNDED_VOCAB


def check_trace(requests: list[TracedRequest]) -> list[Violation]:
    """Every broken invariant of every request."""
    return [v for request in requests for v in check_request(request)]
