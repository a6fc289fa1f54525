"""The benchmark harness: every system runs the same prompts, interleaved, into one well-formed JSON record."""

import argparse
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from transformers import AutoModelForCausalLM

from tests.helpers.tiny import make_drafter, make_target

from eyas import Engine
from eyas.client.bench.harness import Suite, write_charts
from eyas.client.bench.forward import run as forward_bench
from eyas.client.bench.peers import DEFAULT_VLLM_K, K_SCAN_FILE, choose_vllm_k, run_bench
from eyas.client.bench.runtime import batching, context_scaling, greedy_vs_hf, spread, verify_phases
from eyas.client.bench.script import Modes
from eyas.runtime import model as model_module
from eyas.target import TargetSession
from eyas.client.bench.floor import wire_floor
from eyas.client.bench.service import command_line, scheduler_seconds


def test_bench_record_has_every_system_and_ratio(tmp_path, capsys):
    target = make_target(tmp_path / "t")
    draft_lm = make_target(tmp_path / "lm", num_hidden_layers=1, seed=3)
    suite = Suite(
        "tiny",
        target,
        {"eagle1": make_drafter(tmp_path / "e1", target, "eagle1"), "eagle3": make_drafter(tmp_path / "e3", target, "eagle3")},
        draft_lm,
        [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]],
    )
    result = run_bench(suite, systems=("hf", "hf-assisted", "eyas"), blocks=2, max_new_tokens=12)
    json.dumps(result)
    entries = {(e["system"], e["drafter"], e["temperature"]): e for e in result["systems"]}
    assert set(entries) == {
        (system, drafter, t)
        for system, drafter in [("hf", ""), ("hf-assisted", "draft-lm"), ("eyas", "eagle1"), ("eyas", "eagle3")]
        for t in (0.0, 0.7)
    }
    for entry in entries.values():
        assert entry["prompts"] == 4 and entry["tokens"] == 4 * 12
        assert entry["tokens_per_s"] > 0 and entry["speedup_vs_hf"] > 0
    assert entries[("hf", "", 0.0)]["speedup_vs_hf"] == 1.0
    assert entries[("hf", "", 0.0)]["mean_accept_length"] == 1.0
    eyas = entries[("eyas", "eagle1", 0.0)]
    assert eyas["target_forwards_per_token"] > 0 and sum(eyas["accepted_length_by_depth"]) > 0
    assert {"draft", "tree", "verify", "publish"} <= set(eyas["phase_seconds_per_round"])
    assert "efficiency_vs_ideal" in eyas and "tree_policy" in eyas
    charts = write_charts(result, tmp_path / "png")
    assert all(p.stat().st_size > 0 for p in charts)
    progress = capsys.readouterr().err.splitlines()
    steps = [line for line in progress if line.startswith("eyas bench: block ")]
    assert len(steps) == 2 * len(entries)  # every system in each block, each step announced
    assert all("left)" in line for line in steps[len(entries) :])  # from the second block on, with what is left
    assert progress[-1].startswith("eyas bench: 2 blocks in ")


def test_runtime_bench_measures_verify_phases_context_and_batches(tmp_path):
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "e3", target, "eagle3")
    engine = Engine.from_pretrained(target, drafter, tree={"width": 2, "depth": 2, "budget": 4})
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    phases = verify_phases(engine, hf, list(range(5, 25)), (1, 3), repeats=2)
    assert [r["rows"] for r in phases["rows"]] == [1, 3] and phases["plain_step_ms"] > 0
    assert all(r["verify_ms"] > 0 and r["layers_ms"] > 0 and r["decide_ms"] > 0 for r in phases["rows"])
    scaling = context_scaling(engine, hf, [list(range(5, 15))], [list(range(5, 85))], max_new_tokens=6, repeats=2)
    assert scaling["short"]["context"] == 10 and scaling["long"]["context"] == 80
    assert scaling["goal_met"] == (scaling["round_ratio"] <= scaling["plain_step_ratio"])
    assert set(scaling["verify_ratio"]) == {"1_rows", "5_rows"} and all(r > 0 for r in scaling["verify_ratio"].values())
    batch = batching(engine, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], max_new_tokens=6, trees=("1,2,2",), pairs=3)
    assert batch["identical_outputs"] and batch["requests"] == 3 and batch["batch_tokens_per_s"] > 0
    assert batch["batch_tree_1/2/2"]["identical_outputs"] and batch["batch_tree_1/2/2"]["batch_tokens_per_s"] > 0
    assert len(batch["pairs"]) == 3 and all(run["identical_outputs"] for run in batch["pairs"])
    ratios = sorted(run["batch_tokens_per_s"] / run["one_at_a_time_tokens_per_s"] for run in batch["pairs"])
    assert batch["batch_over_one_at_a_time"] == pytest.approx(ratios[1])  # each pair's own ratio, then their median
    first = batch["pairs"][0]
    assert batch["first_pair_batch_over_one_at_a_time"] == first["batch_tokens_per_s"] / first["one_at_a_time_tokens_per_s"]
    auto = Engine.from_pretrained(target, drafter, tree="auto")
    counted = batching(auto, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], max_new_tokens=6)["tree_auto"]
    assert counted["exploring_rounds_one_at_a_time"] > 0  # a fresh tuner's first exploration
    assert counted["exploring_rounds_one_at_a_time"] + counted["exploring_rounds_batch"] == auto.tuner.explorations
    assert spread("20,300", 8) == [20, 100, 180, 260, 60, 140, 220, 300]  # prompts of mixed lengths, short and long mixed
    exact = greedy_vs_hf(engine, hf, [[5, 6, 7], [8, 9]], max_new_tokens=6)
    assert exact == {"prompts": 2, "identical": 2, "tokens_before_first_difference": 1.0}
    assert engine.target.pool.free_slots == engine.target.pool.slots


def test_script_bench_switches_the_forwards_between_eager_and_torchscript_with_the_same_bits(tmp_path):
    target = make_target(tmp_path / "t")
    engine = Engine.from_pretrained(target, make_drafter(tmp_path / "e1", target, "eagle1"), tree={"width": 2, "depth": 2, "budget": 3})
    modes, tokens, features = Modes(), {}, {}
    for mode in ("eager", "script"):
        with modes.use(mode):
            assert isinstance(model_module.dense_layers, torch.jit.ScriptFunction) == (mode == "script")
            tokens[mode] = engine.generate([5, 6, 7, 8], max_new_tokens=8).token_ids
            session = TargetSession(engine.target)
            features[mode] = session.prefill(0, list(range(5, 12)))
            session.close()
    assert isinstance(model_module.dense_layers, torch.jit.ScriptFunction)  # the shipped functions again
    assert tokens["eager"] == tokens["script"] and torch.equal(features["eager"], features["script"])


def test_forward_bench_times_a_plain_step_and_tree_rows_with_graphs_off_and_on(tmp_path):
    args = argparse.Namespace(size="tiny", device="cpu", dtype="auto", context=24, rows=(1, 5), repeats=2)
    record = forward_bench(args)
    assert record["config"]["parameters"] > 0 and record["hf_plain_step_ms"] > 0
    for name in ("off", "on"):
        assert [e["rows"] for e in record["graphs"][name]] == [1, 5]
        assert all(e["ms"] > 0 and e["vs_hf"]["argmax_agree"] == 1.0 and e["vs_hf"]["max_rel_diff"] < 1e-5 for e in record["graphs"][name])
    assert all(c["max_rel_diff"] < 1e-5 for c in record["graphs_on_vs_off"].values())


def test_vllm_k_is_the_one_given_else_the_last_scan_else_the_default(tmp_path):
    assert choose_vllm_k(tmp_path, None) == (DEFAULT_VLLM_K, "default (no scan yet; --vllm-k-scan runs one)")
    (tmp_path / K_SCAN_FILE).write_text(json.dumps({"best": 5, "tokens_per_s": {"5": 90.0}}))
    assert choose_vllm_k(tmp_path, None) == (5, f"last scan ({tmp_path / K_SCAN_FILE})")
    assert choose_vllm_k(tmp_path, 2) == (2, "given")


def test_the_service_bench_reads_past_a_process_that_ends_while_it_looks():
    """Finding the coordinator lists /proc, then reads each command line: a process gone in between is skipped."""
    assert command_line(str(os.getpid())) != b""
    assert command_line("4194304999") == b""  # above any pid Linux gives out


def test_the_wire_floor_times_round_trips_of_the_sizes_it_names():
    """The floor a service round's overhead is read against: bare gRPC stream round trips to a fresh process."""
    floor = wire_floor(request_bytes=1000, reply_bytes=20000, trips=100)
    assert (floor["request_bytes"], floor["reply_bytes"], floor["trips"]) == (1000, 20000, 90)
    assert 0 < floor["p10_ms"] <= floor["median_ms"] <= floor["p90_ms"] < 1000


def test_every_bench_subcommand_prints_its_help_without_loading_a_bench():
    """`eyas bench KIND --help` for every KIND, in one fresh process: each exits 0 with its usage, and no bench is
    imported on the way (torch, transformers and Ray stay unloaded)."""
    probe = (
        "import argparse, contextlib, io, json, sys\n"
        "from eyas.client.cli import build_parser, main\n"
        "def kinds(parser):\n"
        "    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices\n"
        "names = sorted(kinds(kinds(build_parser())['bench']))\n"
        "for name in names:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            main(['bench', name, '--help'])\n"
        "        except SystemExit as exc:\n"
        "            assert exc.code == 0, (name, exc.code)\n"
        "    assert out.getvalue().startswith(f'usage: eyas bench {name}'), (name, out.getvalue())\n"
        "print(json.dumps([names, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names, loaded = json.loads(done.stdout.splitlines()[-1])
    assert {"peers", "tree", "service", "runtime", "forward", "trace", "groups", "failover", "profile"} <= set(names)
    assert loaded == []


def test_scheduler_seconds_count_this_process_running_and_its_switches():
    """The service bench's CPU wait a round: every thread's run and runnable-wait seconds and switches (schedstat)."""
    before = scheduler_seconds([os.getpid()])
    deadline = time.perf_counter() + 5.0
    while scheduler_seconds([os.getpid()])[0] == before[0] and time.perf_counter() < deadline:
        sum(i * i for i in range(10_000))  # run until the kernel's next update of this thread's time
    after = scheduler_seconds([os.getpid()])
    assert after[0] > before[0] and after[1] >= before[1] and after[2] >= before[2]
