"""`eyas bench script`: the runtime's forwards eager, as TorchScript and through `torch.compile`, in one run.

The same functions (the decoder blocks, `linear`, the served drafter's steps and candidates) run three ways on
the demo models: eager Python, `torch.jit.script`, and `torch.compile` of the functions a forward enters
(inductor, dynamic shapes; the oneDNN product it cannot lower runs as an opaque call). Measured in turns, each
mode after the others on the same inputs: a verification of 1, 7 and 33 rows on a committed context, a drafter
pass of 1 and 8 rows with its top-k (the drafter in float32 and in bfloat16), and whole requests with a fixed tree.
Each figure is a median of wall and of this thread's CPU milliseconds, and a ratio to eager in the same run.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

import eyas.proposer as proposer
import eyas.runtime.linear as linear_module
import eyas.runtime.model as model_module
from eyas.assets import demo_model
from eyas.engine import Engine
from eyas.runtime.batch import RowsCall
from eyas.runtime.script import script
from eyas.target import TargetSession

from .harness import demo_suite
from .runtime import chain_call, heldout_ids

# (module, name) of every function a forward runs as one unit, and whether a forward enters it from Python
FUNCTIONS = (
    (linear_module, "linear", True),
    (model_module, "linear", False),
    (model_module, "attention_block", True),
    (model_module, "mlp_block", True),
    (model_module, "residual_layer", False),
    (model_module, "dense_layers", True),
    (proposer, "linear", False),
    (proposer, "residual_layer", False),
    (proposer, "eagle1_step", True),
    (proposer, "eagle3_step", True),
    (proposer, "eagle1_candidates", True),
    (proposer, "eagle3_candidates", True),
)


def python_function(fn: Callable) -> Callable:
    """The Python function behind `fn` (itself, or the source of a scripted function)."""
    return getattr(fn, "_torchdynamo_inline", fn)


class Modes:
    """Switches the forwards' functions between eager, TorchScript and torch.compile (each built once)."""

    def __init__(self):
        self.eager = {(module, name): python_function(getattr(module, name)) for module, name, _ in FUNCTIONS}
        self.built: dict[str, dict[tuple[ModuleType, str], Callable]] = {"eager": self.eager}

    def functions(self, mode: str) -> dict[tuple[ModuleType, str], Callable]:
        if mode not in self.built:
            if mode == "script":
                self.built[mode] = {key: script(fn) for key, fn in self.eager.items()}
            else:
                allow_opaque_products()
                entered = {(module, name) for module, name, entry in FUNCTIONS if entry}
                self.built[mode] = {
                    key: torch.compile(fn, dynamic=True) if key in entered else fn for key, fn in self.eager.items()
                }
        return self.built[mode]

    @contextlib.contextmanager
    def use(self, mode: str) -> Iterator[None]:
        """Bind `mode`'s functions where the forwards look them up; the shipped ones again afterwards."""
        shipped = {(module, name): getattr(module, name) for module, name, _ in FUNCTIONS}
        for (module, name), fn in self.functions(mode).items():
            setattr(module, name, fn)
        try:
            yield
        finally:
            for (module, name), fn in shipped.items():
                setattr(module, name, fn)


def allow_opaque_products() -> None:
    """Let inductor call oneDNN's product on a prepacked weight as it is (it lowers only its own prepacking)."""
    from torch._inductor import lowering

    op = torch.ops.mkldnn._linear_pointwise.default
    if op not in lowering.fallbacks:
        lowering.lowerings.pop(op, None)
        lowering.make_fallback(op)


def timed(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and thread-CPU milliseconds of `run` over `repeats` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.thread_time()
        run()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return 1000 * statistics.median(wall), 1000 * statistics.median(cpu)


def workloads(engines: dict[str, Engine], context: list[int], prompts: list[list[int]], max_new_tokens: int) -> dict[str, Callable]:
    """Name -> a call to time: verifications by rows, drafter passes by rows and dtype, whole requests by dtype."""
    target = next(iter(engines.values())).target
    session = TargetSession(target)
    session.prefill(0, context)
    jobs: dict[str, Callable] = {}
    for rows in (1, 7, 33):
        _, call = chain_call(target, session, rows)
        jobs[f"verify_{rows}"] = lambda call=call: target.run([call])
    for dtype, engine in engines.items():
        draft = engine.draft
        slot = draft.pool.acquire(len(context) + 8)
        states = torch.zeros(8, engine.drafter.hidden_size, dtype=engine.drafter.dtype)
        for rows in (1, 8):
            visible = torch.ones(rows, len(context) + rows, dtype=torch.bool)
            call = RowsCall(slot, len(context), torch.tensor(context[-rows:]), torch.arange(len(context), len(context) + rows), visible, states[:rows], top_k=4)
            jobs[f"draft_{dtype}_{rows}"] = lambda call=call, draft=draft: draft.run([call])
        jobs[f"requests_{dtype}"] = lambda engine=engine: [engine.generate(p, max_new_tokens=max_new_tokens, stop_at_eos=False) for p in prompts]
    return jobs


def run(args) -> dict:
    """The whole comparison as one JSON record."""
    torch.set_num_threads(args.threads)
    suite = demo_suite(args.prompts)
    drafter = demo_model(args.drafter)
    tree = dict(zip(("width", "depth", "budget"), map(int, args.tree.split(","))))
    engines = {dtype: Engine.from_pretrained(suite.target, drafter, tree=tree, draft_dtype=dtype) for dtype in ("float32", "bfloat16")}
    context = heldout_ids(engines["float32"], args.context, 1)[0]
    jobs = workloads(engines, context, suite.prompts, args.max_new_tokens)
    modes = Modes()
    warmup = {}
    order = args.modes
    for mode in order:  # builds each mode and runs every shape once (compiling where the mode compiles)
        start = time.perf_counter()
        with modes.use(mode):
            for job in jobs.values():
                job()
        warmup[mode] = time.perf_counter() - start
    times: dict[str, dict[str, list[tuple[float, float]]]] = {name: {mode: [] for mode in order} for name in jobs}
    for turn in range(args.turns):
        for mode in order[turn % len(order):] + order[: turn % len(order)]:
            with modes.use(mode):
                for name, job in jobs.items():
                    times[name][mode].append(timed(job, 1 if name.startswith("requests") else args.repeats))
    results = {}
    for name, by_mode in times.items():
        entry = {}
        for mode, pairs in by_mode.items():
            entry[mode] = {"wall_ms": statistics.median(w for w, _ in pairs), "cpu_ms": statistics.median(c for _, c in pairs)}
        for mode in order[1:]:
            turns = zip(by_mode[mode], by_mode["eager"])
            ratios = [(w / ew, c / ec) for (w, c), (ew, ec) in turns]
            entry[f"{mode}_over_eager"] = {"wall": statistics.median(r[0] for r in ratios), "cpu": statistics.median(r[1] for r in ratios)}
        results[name] = entry
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch_threads": torch.get_num_threads()},
        "config": {"drafter": args.drafter, "tree": tree, "context": len(context), "prompts": len(suite.prompts),
                   "max_new_tokens": args.max_new_tokens, "turns": args.turns, "repeats": args.repeats, "modes": order},
        "warmup_s": warmup,
        "results": results,
    }

