"""The trace commands of the `eyas` command line: replay, trace show, trace diff, trace check."""

from __future__ import annotations

import argparse
import sys

from eyas.trace.store import Trace, read_trace

from .loading import quiet_loading


def _read(path: str) -> Trace:
    """A trace, with what could not be read said on stderr."""
    trace = read_trace(path, warn=False)
    for problem in trace.problems:
        print(f"warning: {path}: {problem}", file=sys.stderr)
    return trace


def cmd_replay(args: argparse.Namespace) -> int:
    """Re-verify every recorded tree against the target from the committed prefix with the recorded seed (and,
    with --redraft, run the drafter again and compare its trees); print "identical" or the first divergence.
    Progress (loading, then a bar of rounds replayed) goes to stderr."""
    from eyas.assets import DEFAULT_DRAFTER, demo_model

    trace = _read(args.path)
    rounds = sum(len(r.rounds) for r in trace.requests)
    target_dir = args.target or demo_model("target")
    models = f"{target_dir} and its drafter" if args.redraft else target_dir
    print(f"eyas replay: {len(trace.requests)} request(s), {rounds} round(s); loading {models}", file=sys.stderr, flush=True)
    from eyas import Engine
    from eyas.target import TargetModel

    from .replay import replay_trace
    from .trace_text import token_labeler

    quiet_loading()
    if args.redraft:
        engine = Engine.from_pretrained(target_dir, args.drafter or demo_model(DEFAULT_DRAFTER), draft_dtype=args.draft_dtype)
        target, drafter = engine.target, engine.drafter
    else:
        target, drafter = TargetModel.from_pretrained(target_dir), None
    report = replay_trace(trace, target, drafter, args.tolerance, token_labeler(target.tokenizer), progress=not args.no_progress)
    print("\n".join(report.lines()))
    return 0 if report.identical else 1


def cmd_trace_show(args: argparse.Namespace) -> int:
    """Summarize a trace (rounds, tokens, acceptance length, accepted length by depth, draft confidence against
    observed acceptance), print one round's tree with --round, write a page with --html and charts with --png."""
    from eyas.trace.summary import summarize

    from .trace_text import format_round, format_summary, token_labeler, trace_tokenizer

    trace = _read(args.path)
    requests = [trace.request(args.request)] if args.request else trace.requests
    label = token_labeler(trace_tokenizer(requests, args.target))
    summary = summarize(requests)
    print(format_summary(args.path, requests, summary))
    if args.round is not None:
        if not requests:
            raise ValueError(f"{args.path} holds no requests")
        request = requests[0]
        rounds = {r.round: r for r in request.rounds}
        if args.round not in rounds:
            raise ValueError(f"request {request.key} has no round {args.round} (rounds 0 to {len(request.rounds) - 1})")
        print()
        print(format_round(request, rounds[args.round], label))
    title = f"eyas trace {args.path}" + (f", request {args.request}" if args.request else "")
    if args.html:
        from .trace_html import write_html

        nodes = write_html(args.html, title, requests, summary, label)
        print(f"wrote {args.html} ({nodes} tree nodes)", file=sys.stderr)
    if args.png:
        from .trace_png import write_png

        write_png(args.png, title, summary)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def cmd_trace_diff(args: argparse.Namespace) -> int:
    """Print the first round where two traces differ, and how (timings and request ids are not compared)."""
    from .trace_diff import diff_traces
    from .trace_text import token_labeler, trace_tokenizer

    a, b = _read(args.a), _read(args.b)
    label = token_labeler(trace_tokenizer(a.requests, args.target))
    difference = diff_traces(a, b, args.tolerance, label)
    if difference is None:
        rounds = sum(len(r.rounds) for r in a.requests)
        print(f"identical: {len(a.requests)} requests, {rounds} rounds")
        return 0
    print(f"first difference: {difference}")
    return 1


def cmd_trace_check(args: argparse.Namespace) -> int:
    """Check every record's invariants without any model: tree structure, accepted path, output, versions, sampling."""
    from eyas.trace.invariants import check_trace

    trace = _read(args.path)
    violations = check_trace(trace.requests)
    for violation in violations:
        print(violation)
    rounds = sum(len(r.rounds) for r in trace.requests)
    if not violations:
        print(f"all invariants hold: {len(trace.requests)} requests, {rounds} rounds")
    return 1 if violations else 0


def add_trace_commands(sub: argparse._SubParsersAction) -> None:
    """Register `eyas replay` and `eyas trace show|diff|check`."""
    replay = sub.add_parser("replay", help="re-verify a trace against the target", description=cmd_replay.__doc__)
    replay.add_argument("path", help="trace file")
    replay.add_argument("--target", help="target model directory (default: the bundled demo target)")
    replay.add_argument("--drafter", help="drafter directory for --redraft (default: the bundled demo drafter)")
    replay.add_argument("--redraft", action="store_true", help="also run the drafter again and compare its trees")
    replay.add_argument("--draft-dtype", default="auto", help="the redrafting drafter's dtype: auto (as the engine chooses), float32, bfloat16 or float16")
    replay.add_argument("--tolerance", type=float, default=1e-6, help="largest probability difference called identical")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.set_defaults(func=cmd_replay)

    trace = sub.add_parser("trace", help="look at traces: show, diff, check")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    show = trace_sub.add_parser("show", help="summarize a trace, print or draw its trees", description=cmd_trace_show.__doc__)
    show.add_argument("path", help="trace file")
    show.add_argument("--request", help="only this request (its id; id#2 for the second request with that id)")
    show.add_argument("--round", type=int, help="print this round's tree (of --request, else of the first request)")
    show.add_argument("--html", help="write a self-contained page with every round's tree and the charts")
    show.add_argument("--png", help="write the acceptance-by-depth and calibration charts")
    show.add_argument("--target", help="target directory whose tokenizer decodes tokens (default: the demo target when it matches)")
    show.set_defaults(func=cmd_trace_show)

    diff = trace_sub.add_parser("diff", help="first round where two traces differ", description=cmd_trace_diff.__doc__)
    diff.add_argument("a", help="first trace")
    diff.add_argument("b", help="second trace")
    diff.add_argument("--tolerance", type=float, default=1e-6, help="largest probability difference ignored (0: bit for bit)")
    diff.add_argument("--target", help="target directory whose tokenizer decodes tokens")
    diff.set_defaults(func=cmd_trace_diff)

    check = trace_sub.add_parser("check", help="check a trace's invariants without models", description=cmd_trace_check.__doc__)
    check.add_argument("path", help="trace file")
    check.set_defaults(func=cmd_trace_check)
