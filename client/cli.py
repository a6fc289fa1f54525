"""The `eyas` command line: one subcommand per job, each documented by its --help."""

from __future__ import annotations

import argparse
import json
import sys

from eyas.assets import DEFAULT_DRAFTER, demo_model


def _quiet_loading() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model directory (default: the bundled demo target)")
    parser.add_argument("--drafter", help=f"drafter directory (default: the bundled demo {DEFAULT_DRAFTER})")
    parser.add_argument("--top-k", type=int, default=8, help="tree expansion width (default 8)")
    parser.add_argument("--depth", type=int, default=5, help="tree depth (default 5)")
    parser.add_argument("--budget", type=int, default=32, help="verify budget, candidate nodes besides the root (default 32)")
    parser.add_argument(
        "--allow-manifest-mismatch",
        action="store_true",
        help="run a drafter on a target its manifest does not match (recorded in the manifest)",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sample-top-k", type=int, default=0, help="top-k truncation of the target distribution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def resolve_models(args: argparse.Namespace) -> tuple[str, str]:
    return str(args.target or demo_model("target")), str(args.drafter or demo_model(DEFAULT_DRAFTER))


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate one completion in this process and print it (or a JSON record with statistics)."""
    from eyas import Engine

    _quiet_loading()
    target, drafter = resolve_models(args)
    engine = Engine.from_pretrained(
        target,
        drafter,
        tree={"top_k": args.top_k, "depth": args.depth, "budget": args.budget},
        allow_manifest_mismatch=args.allow_manifest_mismatch,
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

    _quiet_loading()
    recipe = Recipe.from_yaml(
        args.config, target=args.target, output=args.output, max_steps=args.max_steps, workers=args.workers
    )
    if recipe.workers > 1:
        from eyas.train.distributed import fit_distributed

        final = fit_distributed(recipe, resume_from=args.resume)
    else:
        from eyas.train.trainer import Trainer

        final = Trainer(recipe, resume_from=args.resume).fit()
    print(f"drafter written to {final}")
    return 0


def cmd_demo_build(args: argparse.Namespace) -> int:
    """Rebuild the bundled demo models: tokenizer, target, plain draft LM, EAGLE-1/HASS/EAGLE-3 drafters, report."""
    from eyas.demo.drafters import build_demo

    _quiet_loading()
    build_demo(
        out_root=args.out,
        work_dir=args.work_dir,
        base=not args.skip_base,
        target_minutes=args.target_minutes,
        draft_lm_minutes=args.draft_lm_minutes,
        drafter_steps=args.drafter_steps,
        kinds=args.only or ("eagle1", "hass", "eagle3"),
        prompts=args.prompts,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas", description="EAGLE speculative decoding: engine, service and tools.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion", description=cmd_generate.__doc__)
    gen.add_argument("--prompt", required=True, help="prompt text (tokenized with the target's tokenizer)")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON record with token ids and statistics")
    gen.set_defaults(func=cmd_generate)

    train = sub.add_parser("train", help="train a drafter from a recipe", description=cmd_train.__doc__)
    train.add_argument("--config", required=True, help="recipe YAML (see configs/train/)")
    train.add_argument("--target", help="override the recipe's target directory")
    train.add_argument("--output", help="override the recipe's output directory")
    train.add_argument("--max-steps", type=int, help="override the recipe's number of optimizer steps")
    train.add_argument("--workers", type=int, help="data-parallel Ray Train workers (gloo on CPU)")
    train.add_argument("--resume", help="checkpoint directory to resume from (same recipe)")
    train.set_defaults(func=cmd_train)

    demo = sub.add_parser("demo", help="the bundled demo models")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    build = demo_sub.add_parser("build", help="rebuild the demo models", description=cmd_demo_build.__doc__)
    build.add_argument("--out", default="models/demo", help="where the demo models go (default models/demo)")
    build.add_argument("--work-dir", default="runs/demo", help="training logs, checkpoints, feature caches")
    build.add_argument("--skip-base", action="store_true", help="reuse the existing target and draft LM")
    build.add_argument("--target-minutes", type=float, default=24.0)
    build.add_argument("--draft-lm-minutes", type=float, default=4.0)
    build.add_argument("--drafter-steps", type=int, help="override every drafter recipe's max_steps")
    build.add_argument("--only", nargs="+", choices=["eagle1", "hass", "eagle3"], help="train only these drafters")
    build.add_argument("--prompts", type=int, default=50, help="held-out prompts for the acceptance report")
    build.set_defaults(func=cmd_demo_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"eyas {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
