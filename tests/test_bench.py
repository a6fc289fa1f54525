"""The benchmark harness: every system runs the same prompts, interleaved, into one well-formed JSON record."""

import json

from tiny import make_drafter, make_target

from eyas.client.bench import Suite, run_bench, write_charts


def test_bench_record_has_every_system_and_ratio(tmp_path):
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
