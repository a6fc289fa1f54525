"""`eyas bench runtime`: what eyas's own runtime costs against one plain Hugging Face decode step.

Three measurements, each against a peer timed in the same run on the same model and dtype:
- the verify forward of 1, 9 and 33 tree rows on a committed prefix, split into packing, the
  layers, the LM head and the acceptance decision, against one plain HF step (KV cache, one token);
- time per round at a short and a long context against the HF step at the same two contexts
  (a commit moves only the accepted rows, so a round should grow no faster than a plain step);
- `Engine.generate_batch` of several requests against the same requests one at a time, in a few interleaved pairs;
and whether greedy outputs equal Hugging Face's own greedy decoding, token for token. With CUDA graphs, each timed
workload first runs once untimed, so that capturing its shapes' graphs (once per shape) is not timed.
Prompts are held-out standard-library text (never trained on by the demo models). With `tree: auto`
the tuner's first exploration runs before any phase, untimed, on a held-out prompt of its own.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from eyas.assets import DEFAULT_DRAFTER
from eyas.engine import Engine
from eyas.runtime.batch import pack
from eyas.sampling import SamplingParams
from eyas.target import TargetModel, TargetSession
from eyas.train.corpus import collect
from eyas.tree import DraftTree, TreePolicy, flatten
from eyas.verify import decide

from .harness import demo_suite


def synchronize() -> None:
    """Wait for queued CUDA work, so that a wall clock read after it counts that work (a no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(run: Callable[[], object], repeats: int) -> float:
    """Median wall milliseconds of `run` over `repeats` calls (its device work included), after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def heldout_ids(engine: Engine, length: int, count: int) -> list[list[int]]:
    """`count` windows of `length` tokens from the held-out standard-library modules."""
    return heldout_windows(engine, [length] * count)


def heldout_windows(engine: Engine, lengths: list[int]) -> list[list[int]]:
    """Consecutive windows of the held-out standard-library modules' tokens, one of each length."""
    ids = []
    for doc in collect().heldout:
        ids += engine.tokenize(doc.text)
        if len(ids) >= sum(lengths):
            break
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [ids[start : start + n] for start, n in zip(starts, lengths)]


def spread(bounds: str, count: int) -> list[int]:
    """"20,300" and 8 -> 8 lengths from 20 to 300, evenly spread, in an order that mixes short and long."""
    low, high = (int(b) for b in bounds.split(","))
    lengths = [round(low + (high - low) * i / max(count - 1, 1)) for i in range(count)]
    return lengths[::2] + lengths[1::2]


def chain_tree(root: int, rows: int, prefix_len: int):
    """A flattened chain of `rows` rows (root included): the widest mask a tree of that size can have."""
    tree = DraftTree(root)
    node = 0
    for token in range(1, rows):
        (node,) = tree.add_children([node], [(node, token, 0.5)])
    return flatten(tree, tree.select(rows - 1), prefix_len)


class PlainStep:
    """One Hugging Face decode step (one new token on a KV cache of the context), dropped again after timing."""

    def __init__(self, model: torch.nn.Module, context: list[int]):
        self.model = model
        self.cache = DynamicCache()
        with torch.no_grad():
            model(torch.tensor([context], device=model.device), past_key_values=self.cache, use_cache=True)

    @torch.no_grad()
    def __call__(self) -> None:
        self.model(torch.tensor([[7]], device=self.model.device), past_key_values=self.cache, use_cache=True)
        self.cache.crop(-1)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Hugging Face's own greedy decoding of `n` tokens: a KV cache, the argmax at every step, no stop."""
    cache = DynamicCache()
    ids = torch.tensor([prompt], device=model.device)
    tokens = []
    for _ in range(n):
        ids = model(ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax().view(1, 1)
        tokens.append(int(ids))
    return tokens


def greedy_vs_hf(engine: Engine, hf: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """How many prompts the engine decodes to exactly Hugging Face's greedy tokens, and the share of tokens before
    the first difference (in half precision a tree forward rounds differently from a plain step: near-ties may part)."""
    same, agreed = 0, 0
    for prompt in prompts:
        mine = engine.generate(prompt, max_new_tokens=max_new_tokens, stop_at_eos=False).token_ids
        theirs = hf_greedy(hf, prompt, max_new_tokens)
        same += mine == theirs
        agreed += next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), max_new_tokens)
    return {"prompts": len(prompts), "identical": same, "tokens_before_first_difference": agreed / (len(prompts) * max_new_tokens)}


def chain_call(target: TargetModel, session: TargetSession, rows: int):
    """A chain of `rows` rows on `session`'s committed tokens, and the target call that verifies it."""
    tree = chain_tree(7, rows, session.committed)
    return tree, target.call(session.slot, session.committed, tree.tokens, tree.positions, tree.mask)


def verify_ms(engine: Engine, context: list[int], rows: int, repeats: int) -> float:
    """Median milliseconds of the target's forward verifying a chain of `rows` rows on `context`."""
    session = TargetSession(engine.target)
    try:
        session.prefill(0, context)
        _, call = chain_call(engine.target, session, rows)
        return median_ms(lambda: engine.target.run([call]), repeats)
    finally:
        session.close()


def verify_phases(engine: Engine, hf: torch.nn.Module, context: list[int], rows_list: tuple[int, ...], repeats: int) -> dict:
    """The verify forward of each row count on `context`, by phase, against one plain HF step."""
    target = engine.target
    session = TargetSession(target)
    session.prefill(0, context)
    plain = median_ms(PlainStep(hf, context), repeats)
    entries = []
    try:
        for rows in rows_list:
            tree, call = chain_call(target, session, rows)
            packed = pack([call.rows], target.pool, target.bucketed)
            out = target.runtime.forward(packed.tokens, packed.positions, packed.kv, packed.mask, target.taps)
            logits = target.runtime.logits(packed.rows(out.hidden)).cpu()
            phases = {
                "pack_ms": median_ms(lambda: pack([call.rows], target.pool, target.bucketed), repeats),
                "layers_ms": median_ms(lambda: target.runtime.forward(packed.tokens, packed.positions, packed.kv, packed.mask, target.taps), repeats),
                "lm_head_ms": median_ms(lambda: target.runtime.logits(packed.rows(out.hidden)), repeats),
                "decide_ms": median_ms(lambda: decide(tree, logits, SamplingParams()), repeats),
                "verify_ms": median_ms(lambda: target.run([call]), repeats),
            }
            entries.append({"rows": rows, **phases, "verify_over_plain_step": phases["verify_ms"] / plain})
    finally:
        session.close()
    return {"context": len(context), "plain_step_ms": plain, "rows": entries}


def settle(engine: Engine, prompt: list[int], max_new_tokens: int) -> None:
    """Run tree auto's first exploration to its end on a prompt no phase times: otherwise the phase that runs first
    pays all of it (every phase still pays the exploring rounds interleaved later)."""
    for _ in range(16):
        if engine.tree != "auto" or not engine.tuner.exploring:
            return
        engine.generate(prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)


def round_ms(engine: Engine, prompts: list[list[int]], max_new_tokens: int, tree: TreePolicy | None) -> tuple[float, float]:
    """Mean milliseconds per round (drafting, tree, verification, publish) over `prompts`, and tokens per round."""
    seconds, rounds, tokens = 0.0, 0, 0
    for prompt in prompts:
        gen = engine.generate(prompt, max_new_tokens=max_new_tokens, stop_at_eos=False, tree=tree)
        seconds += sum(v for k, v in gen.stats.seconds.items() if k != "prefill")
        rounds += gen.stats.rounds
        tokens += len(gen.token_ids)
    return 1000 * seconds / rounds, tokens / rounds


def context_scaling(
    engine: Engine, hf: torch.nn.Module, short: list[list[int]], long: list[list[int]], max_new_tokens: int, repeats: int
) -> dict:
    """Round time on long contexts over short ones, against the same ratio for one plain HF step. Both contexts
    draft with one tree (with `tree: auto`, the one it chose for a lone request): a round's cost, not the tuner's
    choice of tree, is what is compared. Also the target's verify forward of 1 row and of the tree's rows at both
    contexts, the part of a round that reads the whole context in every layer."""
    tree = engine.tuner.current if engine.tree == "auto" else None
    rows = (1, (tree or engine.tree).budget + 1)
    result = {"tree": None if tree is None else vars(tree)}
    for name, contexts in (("short", short), ("long", long)):
        if engine.target.graphs is not None:
            round_ms(engine, contexts[:1], max_new_tokens, tree)  # untimed: captures this context's graph shapes
        ms, tokens = round_ms(engine, contexts, max_new_tokens, tree)
        result[name] = {
            "context": len(contexts[0]),
            "round_ms": ms,
            "tokens_per_round": tokens,
            "plain_step_ms": statistics.median(median_ms(PlainStep(hf, c), repeats) for c in contexts),
            "verify_ms": {f"{n}_rows": statistics.median(verify_ms(engine, c, n, repeats) for c in contexts) for n in rows},
        }
    result["round_ratio"] = result["long"]["round_ms"] / result["short"]["round_ms"]
    result["plain_step_ratio"] = result["long"]["plain_step_ms"] / result["short"]["plain_step_ms"]
    result["verify_ratio"] = {k: result["long"]["verify_ms"][k] / v for k, v in result["short"]["verify_ms"].items()}
    result["goal_met"] = result["round_ratio"] <= result["plain_step_ratio"]
    return result


def batching(engine: Engine, prompts: list[list[int]], max_new_tokens: int, trees: tuple[str, ...] = (), pairs: int = 1) -> dict:
    """Aggregate tokens/s of `generate_batch` over the prompts against the same prompts one at a time (both with the
    engine's tree), then the batch again with each fixed tree of `trees` ("width,depth,budget"): `pairs` times in
    turn, since this machine's speed moves between runs. Each ratio is within its own pair; the record's figures are
    the medians over the pairs, and each pair is listed (the first is the only one where tree auto meets the batch's
    concurrency cold). Under tree auto, also how many exploring rounds the requests ran one at a time and in the
    batches (in a batch, an exploring round costs every batch-mate time), and the tree last chosen for the batch's
    concurrency in each pair."""
    tuner = engine.tuner if engine.tree == "auto" else None

    def explorations() -> int:
        return tuner.explorations if tuner is not None else 0

    def batch(tree: dict | None, alone: list) -> tuple[float, bool]:
        if engine.target.graphs is not None:  # untimed: captures the batch's graph shapes
            engine.generate_batch(prompts, max_new_tokens=max_new_tokens, stop_at_eos=False, tree=tree)
        start = time.perf_counter()
        together = engine.generate_batch(prompts, max_new_tokens=max_new_tokens, stop_at_eos=False, tree=tree)
        rate = sum(len(g.token_ids) for g in together) / (time.perf_counter() - start)
        return rate, [g.token_ids for g in alone] == [g.token_ids for g in together]

    runs, explored_alone, explored_batch = [], 0, 0
    for _ in range(pairs):
        explored = explorations()
        start = time.perf_counter()
        alone = [engine.generate(p, max_new_tokens=max_new_tokens, stop_at_eos=False) for p in prompts]
        run = {"one_at_a_time_tokens_per_s": sum(len(g.token_ids) for g in alone) / (time.perf_counter() - start)}
        explored_alone += explorations() - explored
        explored = explorations()
        run["batch_tokens_per_s"], run["identical_outputs"] = batch(None, alone)
        explored_batch += explorations() - explored
        if tuner is not None:
            chosen = [h["policy"] for h in tuner.history if h["concurrent"] == len(prompts)]
            run["batch_tree"] = vars(chosen[-1]) if chosen else None
        for tree in trees:
            rate, identical = batch(dict(zip(("width", "depth", "budget"), map(int, tree.split(",")))), alone)
            run[f"batch_tree_{tree.replace(',', '/')}"] = {"batch_tokens_per_s": rate, "identical_outputs": identical}
        runs.append(run)

    def median_ratio(rates: Callable[[dict], float]) -> float:
        return statistics.median(rates(run) / run["one_at_a_time_tokens_per_s"] for run in runs)

    record = {
        "requests": len(prompts),
        "pairs": runs,
        "one_at_a_time_tokens_per_s": statistics.median(run["one_at_a_time_tokens_per_s"] for run in runs),
        "batch_tokens_per_s": statistics.median(run["batch_tokens_per_s"] for run in runs),
        "batch_over_one_at_a_time": median_ratio(lambda run: run["batch_tokens_per_s"]),
        "first_pair_batch_over_one_at_a_time": runs[0]["batch_tokens_per_s"] / runs[0]["one_at_a_time_tokens_per_s"],
        "identical_outputs": all(run["identical_outputs"] for run in runs),
    }
    if tuner is not None:
        record["tree_auto"] = {"exploring_rounds_one_at_a_time": explored_alone, "exploring_rounds_batch": explored_batch}
    for tree in trees:
        key = f"batch_tree_{tree.replace(',', '/')}"
        record[key] = {
            "batch_tokens_per_s": statistics.median(run[key]["batch_tokens_per_s"] for run in runs),
            "batch_over_one_at_a_time": median_ratio(lambda run: run[key]["batch_tokens_per_s"]),
            "identical_outputs": all(run[key]["identical_outputs"] for run in runs),
        }
    return record


AHEAD_TREES = ({"width": 1, "depth": 8, "budget": 8}, {"width": 8, "depth": 5, "budget": 32})


def draft_ahead(
    target: Path, drafter: Path, prompts: list[list[int]], ahead: int, max_new_tokens: int, dtype: str, draft_dtype: str
) -> dict:
    """Hit rate of trees drafted ahead, and the acceptance of hit rounds against freshly drafted ones, per tree and
    temperature."""
    result = {}
    for tree in AHEAD_TREES:
        for temperature in (0.0, 0.7):
            engine = Engine.from_pretrained(target, drafter, tree=tree, dtype=dtype, draft_ahead=ahead, draft_dtype=draft_dtype)
            rounds = hits = hit_tokens = tokens = 0
            for i, prompt in enumerate(prompts):
                stats = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=i, stop_at_eos=False).stats
                rounds, hits = rounds + stats.rounds, hits + stats.ahead_rounds
                hit_tokens, tokens = hit_tokens + stats.ahead_tokens, tokens + stats.tokens
            result[f"{tree['width']}/{tree['depth']}/{tree['budget']} t={temperature}"] = {
                "rounds": rounds,
                "hits": hits,
                "hit_rate": hits / rounds,
                "accept_on_hits": hit_tokens / hits if hits else None,
                "accept_fresh": (tokens - hit_tokens) / (rounds - hits) if rounds > hits else None,
            }
    return result


def use_cpu_clock() -> None:
    """Every timer of the process, the engine's phases included, reads this thread's CPU time: on a shared machine,
    with one torch thread, that is the work done, whatever else runs."""
    time.perf_counter = time.thread_time


def run(args) -> dict:
    """The whole runtime benchmark on the demo target (or the given models) as one JSON record."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            raise SystemExit("eyas bench runtime: --clock cpu times one thread; pass --threads 1")
        use_cpu_clock()
    suite = demo_suite(args.batch + 1)  # the last prompt settles tree auto, untimed
    target = Path(args.target) if args.target else suite.target
    drafter = Path(args.drafter) if args.drafter else suite.drafters[DEFAULT_DRAFTER]
    tree = "auto" if args.tree == "auto" else dict(zip(("width", "depth", "budget"), map(int, args.tree.split(","))))
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    engine = Engine.from_pretrained(
        target, drafter, tree=tree, dtype=args.dtype, device=args.device, graphs=graphs, draft_dtype=args.draft_dtype
    )
    dtype = engine.target.runtime.dtype
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(engine.target.runtime.device).eval()
    context = heldout_ids(engine, args.short_context, 1)[0]
    settle(engine, suite.prompts[-1], args.max_new_tokens)
    record = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch_threads": torch.get_num_threads(),
                    "clock": args.clock},
        "config": {"target": str(target), "drafter": str(drafter), "dtype": str(dtype).removeprefix("torch."),
                   "draft_dtype": str(engine.drafter.dtype).removeprefix("torch."),
                   "device": str(engine.target.runtime.device), "tree": args.tree, "graphs": engine.target.graphs is not None},
    }
    sections = set(args.sections)
    if "verify" in sections:
        record["verify"] = verify_phases(engine, hf, context, (1, 9, 33), args.repeats)
    if "context" in sections:
        short = heldout_ids(engine, args.short_context, args.context_prompts)
        long = heldout_ids(engine, args.long_context, args.context_prompts)
        record["context_scaling"] = context_scaling(engine, hf, short, long, args.max_new_tokens, args.repeats)
    if "batch" in sections:
        prompts = suite.prompts[: args.batch]
        if args.batch_lengths:
            prompts = heldout_windows(engine, spread(args.batch_lengths, args.batch))
        record["batch"] = batching(engine, prompts, args.max_new_tokens, tuple(args.batch_trees), args.batch_pairs)
        record["batch"]["prompt_tokens"] = [len(p) for p in prompts]
    if "greedy" in sections:
        record["greedy_vs_hf"] = greedy_vs_hf(engine, hf, suite.prompts[: args.batch], args.max_new_tokens)
    for name, graphs in (("target", engine.target.graphs), ("drafter", engine.draft.graphs)):
        if graphs is not None:
            record.setdefault("graphs", {})[name] = {"captured": len(graphs.captured), "capture_s": graphs.seconds}
    if args.draft_ahead and "ahead" in sections:
        prompts = suite.prompts[: args.batch]
        record["draft_ahead"] = draft_ahead(target, drafter, prompts, args.draft_ahead, args.max_new_tokens, args.dtype, args.draft_dtype)
    return record
