"""The default tree (docs/tree.md#the-default-tree): `eyas bench tree --pick` stores the fastest grid tree beside a
drafter; the engine and the service use it when no tree is given, and refuse a malformed one naming the field."""

import json
import shutil
import warnings

import pytest
import torch
from tests.helpers.tiny import add_tokenizer, make_drafter, make_target

from eyas import Engine
from eyas.actors.config import ServiceConfig
from eyas.autotree import EXPLORE
from eyas.client.bench.tree import GRID, TUNING_MODULES, label, report
from eyas.client.cli import main
from eyas.train.corpus import HELDOUT_MODULES, stdlib_root
from eyas.manifest import weight_digest
from eyas.stored_tree import TREE_FILE, StoredTree
from eyas.tree import TreeError, TreePolicy

CHAIN = TreePolicy(1, 3, 3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stored")
    target = make_target(root / "target")
    add_tokenizer(target)
    return target, make_drafter(root / "drafter", target)


@pytest.fixture
def drafter(models, tmp_path):
    """A copy of the drafter, so each test stores its own tree."""
    return shutil.copytree(models[1], tmp_path / "drafter")


def digest(target) -> str:
    return Engine.from_pretrained(target, target.parent / "drafter", tree=CHAIN).target.fingerprint.weight_digest


def store(drafter, policy: TreePolicy, target: str, drafter_digest: str | None = None) -> None:
    digest = drafter_digest or weight_digest(drafter)
    StoredTree(policy, digest, target, {"device": "test"}, "float32", "float32", {label(policy): 1.0}, "test", "test").save(drafter)


def test_a_stored_tree_round_trips_and_the_engine_uses_it_for_its_target(models, drafter):
    target, _ = models
    picked = TreePolicy(2, 4, 8, 0.1)
    store(drafter, picked, digest(target))
    assert StoredTree.load(drafter).policy == picked
    assert Engine.from_pretrained(target, drafter).tree == picked
    assert Engine.from_pretrained(target, drafter, tree={"width": 1, "depth": 2, "budget": 2}).tree == TreePolicy(1, 2, 2)
    assert Engine.from_pretrained(target, drafter, tree="auto").tree == "auto"


def test_without_a_stored_tree_or_with_one_for_other_weights_the_engine_warns_and_uses_the_default(models, drafter):
    target, _ = models
    with pytest.warns(UserWarning, match=f"no {TREE_FILE}; using the default tree 8/5/32"):
        assert Engine.from_pretrained(target, drafter).tree == TreePolicy()
    for target_digest, drafter_digest in (("another target", None), (digest(target), "a drafter since retrained")):
        store(drafter, CHAIN, target_digest, drafter_digest)
        with pytest.warns(UserWarning, match=r"picked for other weights \(drafter or target\); using the default tree"):
            assert Engine.from_pretrained(target, drafter).tree == TreePolicy()


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("{not json", None),
        ("[]", None),
        ('{"target": "x", "drafter": "y"}', "tree"),
        ('{"tree": {"width": 0, "depth": 3, "budget": 3}, "target": "x", "drafter": "y"}', "tree.width"),
        ('{"tree": {"width": 1, "depth": 3, "budget": 3, "top_k": 2}, "target": "x", "drafter": "y"}', "tree.top_k"),
        ('{"tree": {"width": 1, "depth": 3, "budget": 3}, "target": "x"}', "drafter"),
        ('{"tree": {"width": 1, "depth": 3, "budget": 3}, "drafter": "y", "target": ""}', "target"),
        ('{"tree": {"width": 1, "depth": 3, "budget": 3}, "target": "x", "drafter": "y", "machine": "cpu"}', "machine"),
        ('{"tree": {"width": 1, "depth": 3, "budget": 3}, "target": "x", "drafter": "y", "speed": 1}', "speed"),
    ],
)
def test_a_malformed_stored_tree_is_refused_naming_the_field(drafter, content, field):
    (drafter / TREE_FILE).write_text(content)
    with pytest.raises(TreeError) as err:
        StoredTree.load(drafter)
    path = str(drafter / TREE_FILE)
    assert err.value.field == (f"{path}: {field}" if field else path)


def test_a_stored_tree_beyond_a_kv_slots_headroom_is_refused_naming_it(models, drafter):
    target, _ = models
    store(drafter, TreePolicy(8, 8, 400), digest(target))
    with pytest.raises(TreeError) as err:
        Engine.from_pretrained(target, drafter)
    assert err.value.field == f"{drafter / TREE_FILE}: tree.budget"


def test_a_service_without_a_tree_uses_the_stored_one_and_takes_request_trees_up_to_auto_s_widest(models, drafter):
    target, _ = models
    store(drafter, CHAIN, digest(target))
    config = ServiceConfig.from_dict({"models": {"target": str(target), "drafter": str(drafter)}})
    assert config.tree is None and config.policy == CHAIN and config.tree_limit == EXPLORE
    fixed = ServiceConfig.from_dict({"models": {"target": str(target), "drafter": str(drafter)}, "tree": {"width": 2, "depth": 2, "budget": 4}})
    assert fixed.policy == fixed.tree_limit == TreePolicy(2, 2, 4)
    auto = ServiceConfig.from_dict({"models": {"target": str(target), "drafter": str(drafter)}, "tree": "auto"})
    assert auto.policy == "auto" and auto.tree_limit == EXPLORE


def test_the_tuning_prompts_come_from_modules_no_report_prompt_comes_from():
    assert set(TUNING_MODULES).isdisjoint(HELDOUT_MODULES)
    assert all((stdlib_root() / module).exists() for module in TUNING_MODULES)


def test_bench_tree_pick_stores_the_fastest_grid_tree_which_the_engine_then_uses(models, drafter, tmp_path):
    target, _ = models
    out = tmp_path / "pick.json"
    argv = ["bench", "tree", "--pick", "--drafters", str(drafter), "--target", str(target), "--prompts", "2", "--blocks", "1"]
    assert main([*argv, "--max-new-tokens", "4", "--threads", str(torch.get_num_threads()), "--json", str(out)]) == 0
    stored = StoredTree.load(drafter)
    assert set(stored.tokens_per_s) == {label(p) for p in GRID}
    assert stored.tokens_per_s[label(stored.policy)] == max(stored.tokens_per_s.values())
    assert stored.command.startswith("eyas bench tree --pick") and stored.draft_dtype and stored.machine["threads"]
    assert json.loads(out.read_text())["picked"][str(drafter)]["tree"] == json.loads((drafter / TREE_FILE).read_text())["tree"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Engine.from_pretrained(target, drafter).tree == stored.policy
    assert not [w for w in caught if TREE_FILE in str(w.message)]  # no fallback: the stored tree is for this target


def test_bench_tree_reports_auto_and_the_stored_tree_against_the_best_of_the_grid(models, drafter):
    target, _ = models
    store(drafter, TreePolicy(1, 2, 2), digest(target))  # not in the grid: timed beside it
    record = report([str(drafter)], str(target), ("library",), 2, 1, 4, 0.0)
    run = record["runs"][0]
    assert set(run["settings"]) == {"auto", "1/2/2", *(label(p) for p in GRID)}
    best = max(s["tokens_per_s"] for name, s in run["settings"].items() if name != "auto")
    assert run["settings"][run["best_fixed"]]["tokens_per_s"] == best
    assert record["auto_vs_best"][f"{drafter}/library"] == run["settings"]["auto"]["tokens_per_s"] / best
    assert record["stored_vs_best"][f"{drafter}/library"] == run["settings"]["1/2/2"]["tokens_per_s"] / best


def test_generate_takes_tree_auto_in_process_only_and_never_beside_tree_knobs(capsys):
    assert main(["generate", "--prompt", "x", "--tree-auto"]) == 2
    assert capsys.readouterr().err.strip().endswith("--tree-auto: with --local only; a service's tree is its config's (tree: auto)")
    assert main(["generate", "--prompt", "x", "--local", "--tree-auto", "--depth", "3"]) == 2
    assert "--tree-auto: tree auto chooses every knob" in capsys.readouterr().err
