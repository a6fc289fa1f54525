"""Greedy exactness: eyas output equals the target's own greedy decoding, token for token.

Random EAGLE-1 and EAGLE-3 drafters on five tiny Hugging Face families, plus oracle drafters that
force full, partial and off-first-branch acceptance so that every commit path is exercised.
"""

from concurrent.futures import Future

import pytest
import torch
from tests.helpers.oracle import OracleDrafter
from tests.helpers.tiny import make_drafter, make_target
from transformers import AutoModelForCausalLM

from eyas import Engine
from eyas.drafters import drafter_config
from eyas.publish import publish, reseed_tokens
from eyas.rounds import start
from eyas.steps import run_alone
from eyas.tree import TreePolicy

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "mixtral"]
PROMPTS = [
    [5, 17, 33, 8, 9, 41, 77, 12],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7],  # repeated tokens
    [5, 9, 5, 9, 5, 9, 5],
    [3],  # a single token: nothing to prefill, the first tree has no drafter seed
    list(range(10, 90)),
]
NEW_TOKENS = 64


def hf_greedy(model, prompt, n=NEW_TOKENS):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = make_target(root / "target", request.param)
    model = AutoModelForCausalLM.from_pretrained(target)
    references = [hf_greedy(model, p) for p in PROMPTS]
    return request.param, root, target, references


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_random_drafter_greedy_equals_hugging_face_generate(family, kind, draft_dtype):
    """In float32 and in bfloat16 (the default beside a float32 target on a CPU with bf16 units, asked for here on any
    CPU) the drafter's trees change, the output does not. EAGLE-1 drafters store a float32 copy of the target's
    embedding, as official checkpoints do: it loads beside a drafter in either dtype."""
    _, root, target, references = family
    embedding = torch.float32 if kind == "eagle1" else None
    drafter = make_drafter(root / f"{kind}-{draft_dtype}", target, kind, embedding=embedding)
    engine = Engine.from_pretrained(target, drafter, tree={"width": 4, "depth": 4, "budget": 12}, draft_dtype=draft_dtype)
    assert engine.drafter.dtype == draft_dtype and engine.target.runtime.dtype == torch.float32
    for prompt, reference in zip(PROMPTS, references):
        gen = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert gen.token_ids == reference, f"prompt {prompt[:10]}"
        assert gen.finish_reason == "length"


def test_fixed_shape_batches_of_cuda_graphs_keep_greedy_exact(family):
    """With `graphs` on (here: the fixed-shape batches CUDA graphs replay, run eagerly), every prompt of a batch still
    decodes to Hugging Face's greedy tokens."""
    name, root, target, references = family
    load = lambda: Engine.from_pretrained(target, make_drafter(root / "eagle3", target, "eagle3"), tree={"width": 4, "depth": 4, "budget": 12}, graphs=True)
    if name == "mixtral":  # MoE routing is not captured: asking for graphs is refused by name
        with pytest.raises(ValueError, match="graphs"):
            load()
        return
    engine = load()
    generations = engine.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [g.token_ids for g in generations] == references
    assert engine.target.graphs.captured and engine.draft.graphs.captured


def oracle_engine(target_dir, reference, rank, tree, draft_ahead=0):
    engine = Engine.from_pretrained(target_dir, make_drafter(target_dir.parent / "oracle-base", target_dir), draft_ahead=draft_ahead)
    engine.drafter = OracleDrafter(drafter_config("eagle1", engine.target.config), reference, rank)
    engine.tree = TreePolicy.from_dict(tree)
    return engine


def test_partially_right_drafter_keeps_greedy_exact_across_branches(family):
    """The true token sits at rank p % 5 of 4 candidates: accepted paths leave the first branch, or stop early."""
    _, _, target, references = family
    for prompt, reference in zip(PROMPTS, references):
        engine = oracle_engine(target, prompt + reference, lambda p: p % 5, {"width": 4, "depth": 4, "budget": 16})
        gen = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert gen.token_ids == reference
        assert len(gen.stats.accepted_length_histogram) > 2  # rounds accepted 0, 1 and more drafts


def test_a_floor_on_the_tree_keeps_greedy_exact(family):
    """Rounds that stop drafting where the path's value falls under the floor (here after 5 of 8 levels) commit the
    same tokens."""
    _, _, target, references = family
    for prompt, reference in zip(PROMPTS, references):
        engine = oracle_engine(target, prompt + reference, lambda p: p % 5, {"width": 2, "depth": 8, "budget": 16, "stop": 0.5})
        depths = []
        gen = engine.generate(prompt, max_new_tokens=NEW_TOKENS, on_round=lambda r: depths.append(max(r.draft_tree.depths)))
        assert gen.token_ids == reference
        assert max(depths) < 8


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_oracle_drafter_accepts_full_depth_every_round(family, depth):
    """Proves publish loses nothing: target forwards per token = 1 / (depth + 1)."""
    _, _, target, references = family
    prompt, reference = PROMPTS[0], references[0]
    engine = oracle_engine(target, prompt + reference, lambda p: 0, {"width": 3, "depth": depth, "budget": 3 * depth})
    n = (depth + 1) * 8
    gen = engine.generate(prompt, max_new_tokens=n)
    assert gen.token_ids == reference[:n]
    assert gen.stats.accepted_length_histogram == [0] * depth + [8]
    assert gen.stats.target_forwards_per_token == pytest.approx(1 / (depth + 1))
    assert gen.stats.target_forwards == 1 + 8  # one prefill, then one verification per round


def test_draft_ahead_hits_and_misses_change_no_token(family):
    """Trees drafted ahead during verification: an always-right oracle hits every round after the first (the
    pre-built tree is verified as is); one that leaves the truth out now and then hits and misses; the tokens
    equal the target's greedy decoding either way."""
    _, _, target, references = family
    prompt, reference = PROMPTS[0], references[0]
    right = oracle_engine(target, prompt + reference, lambda p: 0, {"width": 3, "depth": 3, "budget": 9}, draft_ahead=2)
    gen = right.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert gen.token_ids == reference
    assert gen.stats.ahead_rounds == gen.stats.rounds - 1 and gen.stats.ahead_tokens == gen.stats.tokens - 4
    for prompt, reference in zip(PROMPTS, references):
        tree = {"width": 4, "depth": 4, "budget": 16}
        partly = oracle_engine(target, prompt + reference, lambda p: 9 if p % 7 == 3 else 0, tree, draft_ahead=2)
        gen = partly.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert gen.token_ids == reference
        assert 0 < gen.stats.ahead_rounds < gen.stats.rounds - 1


def test_a_tree_drafted_ahead_is_used_only_for_the_version_and_outcome_it_assumed(family):
    _, _, target, references = family
    prompt, reference = PROMPTS[0], references[0]
    engine = oracle_engine(target, prompt + reference, lambda p: 0, {"width": 2, "depth": 2, "budget": 4}, draft_ahead=3)
    request = engine.new_request(prompt, max_new_tokens=12)
    target_session, draft = engine.sessions(request)
    start(request, draft, target_session)
    proposal = draft.propose(0, request.root_token, engine.tree)
    draft._settle_ahead()
    assert draft.ahead and all(key[0] == 1 for key in draft.ahead)  # keyed to the next version only
    tokens, parents = proposal.tree.tokens.tolist(), proposal.tree.parents.tolist()
    for grown in draft.ahead.values():  # each names the rows of the tree sent that its outcome accepts, root first
        (accepted, bonus), rows = grown.proposal.assumed, grown.proposal.assumed_rows
        assert rows[0] == 0 and all(parents[c] == p for p, c in zip(rows, rows[1:]))
        assert [tokens[r] for r in rows[1:]] == list(accepted) and bonus not in [tokens[c] for c in proposal.tree.children(rows[-1])]
    verification = target_session.verify(proposal.tree, 0, request.sampling)
    publish(request, verification.decision, verification.features, target_session, draft)
    calibration = engine.draft.calibration  # fed what the target made of the tree: the oracle's path accepted
    observed = (sum(calibration.accepted), sum(calibration.counts))
    assert observed[0] == pytest.approx(2.0) and observed[1] > observed[0]
    draft.reseed(0, verification.features, reseed_tokens(verification.decision))  # a retried reseed is a no-op ...
    assert (sum(calibration.accepted), sum(calibration.counts)) == observed  # ... and feeds nothing twice
    hit = draft.propose(1, request.root_token, engine.tree)
    assert hit.assumed == (tuple(reference[:2]), reference[2]) and hit.tree.prefix_len == target_session.committed
    assert hit.assumed_rows == verification.decision.accepted_rows  # the rows the target accepted
    draft._settle_ahead()
    assert draft.ahead and all(key[0] == 2 for key in draft.ahead)  # the other version-1 trees are gone, never sent
    target_session.close(), draft.close()


def test_the_decided_outcomes_tree_drafted_before_the_word_is_the_tree_its_round_drafts(family):
    """`draft_decided` (a draft worker's, once a verification it relayed decides a round of a request that goes on):
    the reseed the word then finds applied and the very tree the next round would have drafted, which that round
    takes without drafting; no token changes and no draft-ahead hit is counted."""
    _, root, target, references = family
    engine = Engine.from_pretrained(target, make_drafter(root / "decided", target, "eagle1"), tree={"width": 4, "depth": 3, "budget": 10})
    plain, early = (engine.new_request(PROMPTS[0], max_new_tokens=24) for _ in range(2))
    (plain_target, plain_draft), (early_target, early_draft) = engine.sessions(plain), engine.sessions(early)
    start(plain, plain_draft, plain_target)
    start(early, early_draft, early_target)
    drafted_early = 0
    while not plain.done:
        ready = list(early_draft.ahead.values())
        expected = plain_draft.propose(plain.version, plain.root_token, engine.tree)
        proposal = early_draft.propose(early.version, early.root_token, engine.tree)
        assert torch.equal(proposal.tree.tokens, expected.tree.tokens) and torch.equal(proposal.tree.parents, expected.tree.parents)
        drafted_early += bool(ready) and proposal is ready[0].proposal
        decided = early_target.verify(proposal.tree, early.version, early.sampling)
        run_alone(early_draft.draft_decided(early.version, decided.features, reseed_tokens(decided.decision), engine.tree))
        publish(early, decided.decision, decided.features, early_target, early_draft)  # its reseed: applied already
        verification = plain_target.verify(expected.tree, plain.version, plain.sampling)
        publish(plain, verification.decision, verification.features, plain_target, plain_draft)
    assert early.output == plain.output == references[0][:24]
    assert drafted_early == plain.version - 1 > 0 and early_draft.ahead_hits == 0
    for session in (plain_target, plain_draft, early_target, early_draft):
        session.close()


def test_drafting_ahead_interrupted_by_the_decision_drops_its_trees_and_changes_no_token(family):
    """A worker stops drafting ahead when the request's next call arrives: trees half built are dropped, the round
    drafts afresh, and the tokens are still the target's greedy decoding."""
    _, _, target, references = family
    prompt, reference = PROMPTS[0], references[0]
    engine = oracle_engine(target, prompt + reference, lambda p: 0, {"width": 2, "depth": 3, "budget": 6}, draft_ahead=2)
    jobs = []
    engine.draft.ahead_runner = lambda steps, guessing: jobs.append(steps) or Future()  # run by hand below

    built_by = []  # trees built once each forward of the latest job had run

    def run_job(draft, interrupt_after: int | None) -> int:
        """Drive the drafting ahead the last proposal left, interrupting it after that many forwards; -> forwards."""
        steps, forwards = jobs.pop(), 0
        built_by.clear()
        forward = next(steps)
        with pytest.raises(StopIteration):
            while True:
                result = forward.runner.run([forward.call])[0]
                forwards += 1
                if forwards == interrupt_after:
                    draft.interrupt_ahead()
                try:
                    forward = steps.send(result)
                finally:
                    built_by.append(draft.ahead_built)
        draft._ahead_job.set_result(None)
        return forwards

    request = engine.new_request(prompt, max_new_tokens=12)
    target_session, draft = engine.sessions(request)
    start(request, draft, target_session)
    proposal = draft.propose(0, request.root_token, engine.tree)
    assert run_job(draft, None) > 2 and draft.ahead_built == 2  # left alone, both trees are built ...
    first = built_by.index(1) + 1  # ... the likeliest alone first, after this many forwards
    assert first < len(built_by) and built_by[-1] == 2
    likeliest = next(iter(draft.ahead))
    draft.ahead.clear()
    draft.propose(0, request.root_token, engine.tree)
    assert run_job(draft, first) == first and list(draft.ahead) == [likeliest]  # a decision after it: that one stays
    draft.ahead.clear()
    draft.propose(0, request.root_token, engine.tree)
    assert run_job(draft, 1) == 1 and draft.ahead == {}  # the decision arrives after one step: no tree grows further
    draft.propose(0, request.root_token, engine.tree)
    assert run_job(draft, 2) == 2 and draft.ahead == {}  # ... or once the trees have begun: the half-built ones are dropped
    for version in range(2):
        verification = target_session.verify(proposal.tree, version, request.sampling)
        publish(request, verification.decision, verification.features, target_session, draft)
        if version == 0:
            proposal = draft.propose(1, request.root_token, engine.tree)
            assert proposal.assumed is None and draft.ahead_hits == 0  # drafted afresh
            run_job(draft, 1)
    assert request.output == reference[: len(request.output)] and len(request.output) == 8
    target_session.close(), draft.close()


def test_max_new_tokens_is_never_overshot_when_a_round_accepts_more(family):
    _, _, target, references = family
    prompt, reference = PROMPTS[0], references[0]
    engine = oracle_engine(target, prompt + reference, lambda p: 0, {"width": 2, "depth": 5, "budget": 10})
    for n in (1, 2, 5, 7, 13):
        gen = engine.generate(prompt, max_new_tokens=n)
        assert gen.token_ids == reference[:n]
