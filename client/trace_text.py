"""`eyas trace show` in a terminal: a trace's summary, and one round's tree as an indented tree."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from eyas.assets import demo_model
from eyas.digests import tokenizer_digest
from eyas.treerows import check_decision, check_tree
from eyas.trace.compare import Label
from eyas.trace.format import Round
from eyas.trace.invariants import UNBOUNDED_VOCAB
from eyas.trace.messages import decode_round
from eyas.trace.store import TracedRequest
from eyas.trace.summary import Summary

BAR = 40


def token_labeler(tokenizer=None) -> Label:
    """Token ids as quoted text when a tokenizer is known, else as #id."""
    if tokenizer is None:
        return lambda token: f"#{token}"
    return lambda token: repr(tokenizer.decode([token]))


def load_tokenizer(directory: str | Path):
    """A tokenizer that decodes token labels: from tokenizer.json with the light `tokenizers` library (no torch),
    else through transformers; None when the directory has no tokenizer."""
    if Path(directory, "tokenizer.json").exists():
        return Tokenizer.from_file(str(Path(directory, "tokenizer.json")))
    if Path(directory, "tokenizer_config.json").exists():
        from transformers import AutoTokenizer  # heavy: only for tokenizers that ship without tokenizer.json

        return AutoTokenizer.from_pretrained(directory)
    return None


def trace_tokenizer(requests: list[TracedRequest], target: str | Path | None):
    """The tokenizer of `target`, else of the bundled demo target when the trace's manifest names its tokenizer."""
    if target is not None:
        return load_tokenizer(target)
    try:
        demo = demo_model("target")
    except FileNotFoundError:
        return None
    digests = {
        r.start.manifest.get("target", {}).get("tokenizer_digest")
        for r in requests
        if r.start is not None and isinstance(r.start.manifest, dict) and isinstance(r.start.manifest.get("target"), dict)
    }
    if digests and digests <= {tokenizer_digest(demo)}:
        return load_tokenizer(demo)
    return None


def _bar(count: int, largest: int) -> str:
    return "█" * round(BAR * count / largest) if largest else ""


def format_summary(path: str, requests: list[TracedRequest], s: Summary) -> str:
    """Rounds, tokens, acceptance length, accepted length by depth, calibration, seconds, and each request."""
    lines = [
        f"trace {path}: {s.requests} requests, {s.rounds} rounds, {s.tokens} tokens",
        f"acceptance length {s.acceptance_length:.2f} tokens per target forward; "
        f"{s.tree_rows / s.rounds if s.rounds else 0:.1f} tree rows per round",
        "accepted length (draft tokens accepted in a round: rounds):",
    ]
    largest = max(s.accepted_lengths, default=0)
    lines += [f"  {k:>3}  {_bar(n, largest):<{BAR}}  {n}" for k, n in enumerate(s.accepted_lengths)]
    lines.append("acceptance by depth (rounds accepting a token at depth d / rounds whose tree reaches d):")
    lines += [
        f"  {d:>3}  {accepted / offered if offered else 0:6.1%}  ({accepted}/{offered})"
        for d, offered, accepted in s.depth_acceptance()
    ]
    lines.append("draft confidence against observed acceptance (children of accepted rows):")
    lines.append("  confidence   nodes  mean confidence  accepted")
    lines += [
        f"  {b.low:.1f}-{b.high:.1f}  {b.nodes:>8}  {b.mean_confidence:>15.3f}  {b.acceptance:>8.1%}"
        for b in s.calibration
        if b.nodes
    ]
    if s.seconds:
        lines.append("seconds: " + "  ".join(f"{phase} {sec:.3f}" for phase, sec in s.seconds.items()))
    lines.append("requests:")
    for r in requests:
        prompt = f"prompt {len(r.start.prompt_ids)} tokens" if r.start is not None else "no request record"
        tokens = sum(len(x.emitted) for x in r.rounds)
        finish = (r.end.finish_reason or f"error: {r.end.error}") if r.end is not None else "unfinished"
        lines.append(f"  {r.key}  {prompt}, {len(r.rounds)} rounds, {tokens} tokens, {finish}")
    return "\n".join(lines)


def format_round(request: TracedRequest, rnd: Round, label: Label = str) -> str:
    """One round's tree, one node per line in draft order: row, token, draft confidence, target probability;
    the accepted path is marked with *."""
    tree, decision, _, _ = decode_round(rnd)
    check_tree(tree, vocab_size=UNBOUNDED_VOCAB)
    check_decision(decision, tree, UNBOUNDED_VOCAB)
    accepted = set(decision.accepted_rows)
    tokens, probs = tree.tokens, tree.draft_probs
    target = list(decision.token_probs) or [float("nan")] * tree.num_rows
    lines = [
        f"request {request.key}, round {rnd.round} (version {rnd.version}): {tree.num_rows} rows on a prefix of "
        f"{tree.prefix_len}; accepted {decision.num_accepted} draft tokens "
        f"{[label(t) for t in decision.accepted_tokens]}, then the frontier token {label(decision.frontier_token)} "
        f"(target p {decision.frontier_prob:.3f})",
        "  (* accepted; each node: [row] token  draft confidence / target probability)",
    ]

    def walk(row: int, lead: str, branch: str) -> None:
        mark = "*" if row in accepted else " "
        lines.append(f"{lead}{branch}{mark}[{row}] {label(tokens[row])}  {probs[row]:.3f} / {target[row]:.3f}")
        children = tree.children(row)
        below = lead + ("" if not branch else "    " if branch == "└── " else "│   ")
        for i, child in enumerate(children):
            walk(child, below, "└── " if i == len(children) - 1 else "├── ")

    walk(0, "  ", "")
    return "\n".join(lines)
