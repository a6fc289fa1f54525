"""`eyas bench tree`: fixed trees, the drafter's stored tree and tree auto, interleaved on the same prompts.

The report times every policy of `GRID` and tree auto for each drafter on each prompt suite; `--pick` times the grid
on the tuning prompts, never a report's, and stores the fastest beside each drafter (docs/tree.md#the-default-tree).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import asdict
from pathlib import Path

from transformers import AutoTokenizer

from eyas.assets import demo_model
from eyas.train.corpus import heldout_prompts, stdlib_root
from eyas.demo.drafters import STAGES
from eyas.manifest import weight_digest
from eyas.stored_tree import StoredTree, stored_for
from eyas.tree import TreePolicy

from .harness import EyasRunner, Tally, machine, run_interleaved

GRID = (
    TreePolicy(1, 3, 3), TreePolicy(1, 4, 4), TreePolicy(1, 5, 5), TreePolicy(1, 7, 7),
    TreePolicy(2, 4, 8), TreePolicy(2, 6, 12), TreePolicy(4, 4, 16), TreePolicy(4, 6, 24),
    TreePolicy(8, 5, 32), TreePolicy(8, 6, 48), TreePolicy(8, 8, 64), TreePolicy(3, 6, 16), TreePolicy(6, 7, 40),
    TreePolicy(1, 8, 8, 0.1), TreePolicy(1, 8, 8, 0.2), TreePolicy(1, 8, 8, 0.3),
)
LIBRARIES = {"yaml": "pyyaml", "tqdm": "tqdm"}  # module -> distribution: pure-Python code eyas installs, not the stdlib
# training-split standard-library modules (none held out), present on Python 3.11-3.13: the tuning prompts
TUNING_MODULES = (
    "argparse.py", "typing.py", "shutil.py", "inspect.py", "dataclasses.py", "functools.py", "logging/__init__.py",
    "subprocess.py",
)
WINDOW_TOKENS = 96


def label(policy: TreePolicy) -> str:
    """width/depth/budget, and the floor where there is one."""
    return f"{policy.width}/{policy.depth}/{policy.budget}" + (f" stop {policy.stop:g}" if policy.stop else "")


def windows(paths: list[Path], tokenizer, count: int, length: int = WINDOW_TOKENS) -> list[list[int]]:
    """`count` windows of `length` tokens, spread evenly over each file and taken from the files in turn."""
    per_file = -(-count // len(paths))
    spread = []
    for path in paths:
        ids = tokenizer.encode(path.read_text())
        step = max(1, (len(ids) - length) // per_file)
        spread.append([ids[i * step : i * step + length] for i in range(per_file) if i * step + length <= len(ids)])
    taken = [w[k] for k in range(per_file) for w in spread if k < len(w)]
    if len(taken) < count:
        raise ValueError(f"--prompts: only {len(taken)} windows of {length} tokens in {len(paths)} files, {count} asked")
    return taken[:count]


def library_files() -> list[Path]:
    """The source files of LIBRARIES as installed, in a fixed order."""
    files = []
    for name in LIBRARIES:
        root = Path(importlib.util.find_spec(name).origin).parent
        files += sorted(p for p in root.rglob("*.py") if p.stat().st_size > 8 * WINDOW_TOKENS)
    return files


def suite_prompts(suite: str, tokenizer, count: int) -> tuple[list[list[int]], str]:
    """A report suite's prompts (token ids) and what they are."""
    if suite == "stdlib":
        return [tokenizer.encode(p.text) for p in heldout_prompts(tokenizer, count)], "held-out standard-library functions"
    versions = ", ".join(f"{name} {importlib.metadata.version(dist)}" for name, dist in LIBRARIES.items())
    return windows(library_files(), tokenizer, count), f"windows of {WINDOW_TOKENS} tokens of installed {versions}"


def tuning_prompts(tokenizer, count: int) -> tuple[list[list[int]], str]:
    """The prompts `--pick` times the grid on: windows of training-split standard-library modules."""
    root = stdlib_root()
    prompts = windows([root / m for m in TUNING_MODULES], tokenizer, count)
    return prompts, f"windows of {WINDOW_TOKENS} tokens of the standard library's {', '.join(TUNING_MODULES)}"


def models(drafter: str, target: str | None) -> tuple[Path, Path]:
    """(target, drafter) directories: a bundled demo drafter's name or a drafter directory; its demo target unless
    `target` is given."""
    if (Path(drafter) / "config.json").exists():
        if target is None:
            raise ValueError(f"--target: needed for {drafter}, which is not a bundled demo drafter")
        return Path(target), Path(drafter)
    if STAGES.get(drafter, ("base",))[0] != "drafter":
        raise ValueError(f"--drafters: {drafter!r} is neither a drafter directory nor one of the demo drafters")
    return Path(target) if target else demo_model(STAGES[drafter][1]), demo_model(drafter)


def time_policies(
    runner: EyasRunner, policies: list[TreePolicy], prompts: list[list[int]], blocks: int, max_new_tokens: int,
    temperature: float, auto: bool,
) -> dict[str, Tally]:
    """Each policy (and tree auto when `auto`, on `runner`'s engine) over `prompts`, interleaved, after an untimed
    warm-up (where tree auto measures this machine's costs)."""
    runners = {("eyas", "auto", temperature): runner.run} if auto else {}
    for policy in policies:
        runners[("eyas", label(policy), temperature)] = EyasRunner(runner.engine, asdict(policy)).run
    for run in runners.values():
        run(prompts[:1], 8, temperature, 0)
    tallies = run_interleaved(runners, prompts, blocks, max_new_tokens, seed=0)
    return {name: tally for (_, name, _), tally in tallies.items()}


def summary(tally: Tally) -> dict:
    """A tree's tokens/s and acceptance over the prompts it ran."""
    return {
        "tokens_per_s": tally.tokens / tally.seconds,
        "mean_accept_length": tally.tokens / tally.decode_forwards,
        "tokens": tally.tokens,
        "seconds": tally.seconds,
    }


def report_one(target: Path, drafter: Path, prompts: list[list[int]], blocks: int, max_new_tokens: int, temperature: float) -> dict:
    """Tree auto and the stored tree against the grid on one drafter and suite (a fresh engine: auto starts cold)."""
    runner = EyasRunner.load(target, drafter, tree="auto")
    stored = stored_for(drafter, runner.engine.target.fingerprint.weight_digest)
    extra = [stored.policy] if stored is not None and stored.policy not in GRID else []
    tallies = time_policies(runner, [*GRID, *extra], prompts, blocks, max_new_tokens, temperature, auto=True)
    settings = {name: summary(t) for name, t in tallies.items()}
    best = max((n for n in settings if n != "auto"), key=lambda n: settings[n]["tokens_per_s"])

    def rate(name: str) -> float:
        return settings[name]["tokens_per_s"] / settings[best]["tokens_per_s"]

    return {
        "settings": settings,
        "best_fixed": best,
        "auto_vs_best": rate("auto"),
        "auto_policy_at_end": asdict(runner.engine.tuner.current),
        "stored": label(stored.policy) if stored else None,
        "stored_vs_best": rate(label(stored.policy)) if stored else None,
        "draft_dtype": str(runner.engine.drafter.dtype).removeprefix("torch."),
        "machine": machine(runner.engine),
    }


def report(
    drafters: list[str], target: str | None, suites: tuple[str, ...], n_prompts: int, blocks: int, max_new_tokens: int,
    temperature: float, command: str = "",
) -> dict:
    """Every drafter on every suite: the grid, the stored tree and tree auto, each drafter and suite in one
    interleaved run."""
    runs, described = [], {}
    for name in drafters:
        target_dir, drafter_dir = models(name, target)
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        for suite in suites:
            prompts, described[suite] = suite_prompts(suite, tokenizer, n_prompts)
            timed = report_one(target_dir, drafter_dir, prompts, blocks, max_new_tokens, temperature)
            runs.append({"drafter": name, "suite": suite, **timed})
    return {
        "command": command,
        "temperature": temperature,
        "config": {"prompts": n_prompts, "blocks": blocks, "max_new_tokens": max_new_tokens},
        "suites": described,
        "auto_vs_best": {f"{r['drafter']}/{r['suite']}": r["auto_vs_best"] for r in runs},
        "stored_vs_best": {f"{r['drafter']}/{r['suite']}": r["stored_vs_best"] for r in runs},
        "runs": runs,
    }


def pick(
    drafters: list[str], target: str | None, n_prompts: int, blocks: int, max_new_tokens: int, temperature: float,
    command: str = "",
) -> dict:
    """Time the grid on the tuning prompts for each drafter and store the fastest policy beside it (tree.json)."""
    picked = {}
    for name in drafters:
        target_dir, drafter_dir = models(name, target)
        prompts, described = tuning_prompts(AutoTokenizer.from_pretrained(target_dir), n_prompts)
        runner = EyasRunner.load(target_dir, drafter_dir, tree=asdict(GRID[0]))  # each call names its own tree
        tallies = time_policies(runner, list(GRID), prompts, blocks, max_new_tokens, temperature, auto=False)
        rates = {key: round(t.tokens / t.seconds, 1) for key, t in tallies.items()}
        best = max(GRID, key=lambda p: rates[label(p)])
        engine = runner.engine
        dtypes = [str(d).removeprefix("torch.") for d in (engine.target.runtime.dtype, engine.drafter.dtype)]
        digests = weight_digest(drafter_dir), engine.target.fingerprint.weight_digest
        stored = StoredTree(best, *digests, machine(engine), *dtypes, rates, described, command)
        path = stored.save(drafter_dir)
        print(f"eyas bench tree: {name}: {label(best)} ({rates[label(best)]:.1f} tokens/s) -> {path}", file=sys.stderr, flush=True)
        picked[name] = {"path": str(path), **stored.to_dict()}
    return {"command": command, "picked": picked}
