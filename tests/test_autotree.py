"""Hardware-aware trees: replaying a smaller policy on an exploration tree predicts what that policy accepts."""

import copy
import math
import pickle
from collections import deque
from dataclasses import replace

import pytest
import torch
from tests.helpers.oracle import OracleDrafter
from tests.helpers.tiny import make_drafter, make_target
from transformers import AutoModelForCausalLM

from eyas import Engine
from eyas.autotree import EXPLORATIONS, EXPLORE, Costs, Replay, TreeTuner, expected_accepted
from eyas.autotree.costs import MIN_OBSERVED, fit_line
from eyas.autotree.explored import LEVEL_PRIOR, LevelCorrection
from eyas.autotree.grid import EXPLORE_CHAIN, EXPLORE_NARROW, grid
from eyas.autotree.tuner import LOCKSTEP_ROUNDS, PREDICTION_ROUNDS, RECORRECT_ROUNDS, REPLAYED_ROUNDS, Kept
from eyas.drafters import drafter_config
from eyas.outcomes import Calibration
from eyas.proposer import DraftSession
from eyas.request import RequestState, StopRules
from eyas.rounds import RoundRecord, start
from eyas.sampling import SamplingParams
from eyas.target import TargetSession
from eyas.tree import DraftTree, TreePolicy, flatten
from eyas.treerows import AcceptanceDecision

PROMPT = [5, 17, 33, 8, 9, 41, 77, 12]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    target = make_target(root / "t")
    hf = AutoModelForCausalLM.from_pretrained(target)
    ids = torch.tensor([PROMPT])
    reference = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)[0].tolist()
    engine = Engine.from_pretrained(target, make_drafter(root / "d", target))
    engine.drafter = OracleDrafter(drafter_config("eagle1", engine.target.config), reference, rank=lambda p: p % 4)
    return engine


def generate_auto(engine, tuner, drafter=None, **kwargs):
    """`engine.generate(PROMPT, ...)` with tree auto driven by `tuner` (and `drafter` when given), restored after."""
    saved = engine.tree, engine._tuner, engine.drafter
    engine.tree, engine._tuner, engine.drafter = "auto", tuner, drafter or engine.drafter
    try:
        return engine.generate(PROMPT, **kwargs)
    finally:
        engine.tree, engine._tuner, engine.drafter = saved


def one_round(engine, policy, params):
    request = RequestState("r", list(PROMPT), params, StopRules(64))
    target, draft = TargetSession(engine.target), DraftSession(engine.draft)
    start(request, draft, target)
    proposal = draft.propose(0, request.root_token, policy)
    return proposal, target.verify(proposal.tree, 0, params)


def test_replayed_sub_policies_predict_their_greedy_acceptance_exactly(engine):
    params = SamplingParams()
    proposal, verification = one_round(engine, EXPLORE, params)
    accept = dict(zip(proposal.row_nodes, verification.row_probs.tolist()))
    assert expected_accepted(proposal.draft_tree, accept, EXPLORE) == verification.decision.num_accepted
    for policy in [TreePolicy(1, 3, 3), TreePolicy(2, 4, 8), TreePolicy(4, 5, 16), TreePolicy(3, 8, 24), TreePolicy(8, 2, 10)]:
        predicted = expected_accepted(proposal.draft_tree, accept, policy)
        _, actual = one_round(engine, policy, params)
        assert predicted == actual.decision.num_accepted, policy


def test_a_floor_ends_drafting_early_and_replays_predict_what_it_drafts_and_accepts(engine):
    """A policy with `stop` expands only nodes whose value reaches it; replayed on an exploring round, it predicts the
    greedy acceptance, the levels drafted and the rows verified of the round it drafts itself."""
    params = SamplingParams()
    proposal, verification = one_round(engine, EXPLORE, params)
    replay = Replay(proposal.draft_tree, dict(zip(proposal.row_nodes, verification.row_probs.tolist())))
    for policy in [TreePolicy(1, 8, 8, 0.5), TreePolicy(2, 6, 12, 0.5), TreePolicy(3, 8, 10, 0.4)]:
        drafted, actual = one_round(engine, policy, params)
        tree = drafted.draft_tree
        levels = max(tree.depths)
        assert levels < policy.depth  # the floor ended drafting early
        expanded = {tree.parents[n] for n in range(1, len(tree))}
        assert all(math.exp(tree.log_values[n]) >= policy.stop for n in expanded)
        assert not tree.expandable(policy.width, policy.stop)  # drafting ended where no frontier node reached it
        assert replay.expected(policy) == actual.decision.num_accepted
        assert replay.drafted(policy) == (levels, drafted.tree.num_rows)


def chain_replay(confidences: list[float]) -> Replay:
    """A recorded chain with these confidences, every node accepted."""
    tree, node = DraftTree(0), 0
    for q in confidences:
        (node,) = tree.add_children([node], [(node, 1, q)])
    return Replay(tree, dict.fromkeys(range(1, len(tree)), 1.0))


def test_a_chain_with_a_floor_is_priced_at_the_levels_it_drafts():
    """Two chain rounds where a floor of 0.5 stops after 3 levels and after 1: a request alone drafts 2 on average,
    two requests in lockstep 2.5 (the deeper of two draws), and the round is priced at that, not at the full depth."""
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.020], [1, 16], [0.002, 0.003]), explore_rounds=0)
    tuner.explored_chains.append(chain_replay([0.9, 0.9, 0.5, 0.9]))  # values 0.9, 0.81, 0.405: stops after 3
    tuner.explored_chains.append(chain_replay([0.4, 0.9]))  # value 0.4: stops after 1
    policy = TreePolicy(1, 8, 8, 0.5)
    assert tuner.shape(policy, 1) == (2.0, 3.0)
    assert tuner.shape(policy, 2) == (2.5, 3.0)
    tokens, rate = tuner.score(policy)
    assert tokens == 3.0 and rate == pytest.approx(3.0 / tuner.costs.round_seconds(policy, 3.0, 1, (2.0, 3.0)))
    assert tuner.costs.round_seconds(policy, 3.0, 1, (2.0, 3.0)) < tuner.costs.round_seconds(policy, 3.0)
    assert tuner.score(policy, 2)[1] == pytest.approx(3.0 / tuner.costs.round_seconds(policy, 3.0, 2, (2.5, 3.0)))


def test_chosen_rounds_that_held_a_floor_move_its_price():
    """The same two explored rounds count as PREDICTION_ROUNDS rounds in all beside the chosen rounds that held the
    floor: eight rounds that drafted 4 levels and verified 5 rows pull the levels a lone round drafts from 2 to 3 and
    the deeper of two requests' from 2.5 to 3.625, and the tokens from 3 to 3.5."""
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.020], [1, 16], [0.002, 0.003]), explore_rounds=0)
    tuner.explored_chains.append(chain_replay([0.9, 0.9, 0.5, 0.9]))  # 3 levels, 4 rows
    tuner.explored_chains.append(chain_replay([0.4, 0.9]))  # 1 level, 2 rows
    policy = TreePolicy(1, 8, 8, 0.5)
    tuner.replayed[policy] = Kept([(4.0, 4, 5)] * 8)
    # weights 4, 4 and 8 x 1: levels (3 * 4 + 1 * 4 + 4 * 8) / 16, rows (4 * 4 + 2 * 4 + 5 * 8) / 16
    assert tuner.shape(policy, 1) == (3.0, 4.0)
    # P(one draw < k) for k = 1 .. 4: 0, 1/4, 1/4, 1/2, so E[max of two] = 1 + 15/16 + 15/16 + 3/4
    assert tuner.shape(policy, 2) == (3.625, 4.0)
    assert tuner.score(policy)[0] == (8 * 4.0 + PREDICTION_ROUNDS * 3.0) / (8 + PREDICTION_ROUNDS)


def chain_round(policy: TreePolicy, accepted: int, draft: float = 0.005, verify: float = 0.005) -> RoundRecord:
    """A finished round of the chain `policy` (no floor) whose first `accepted` nodes the target accepted, its drafting
    and verification taking `draft` and `verify` seconds."""
    tree, node = DraftTree(0), 0
    for level in range(policy.depth):
        (node,) = tree.add_children([node], [(node, level + 1, 0.9)])
    nodes = list(range(1, len(tree)))
    decision = AcceptanceDecision(tuple(range(accepted + 1)), tuple(range(1, accepted + 1)), 99, 1.0)
    return RoundRecord(
        0, flatten(tree, nodes, 8), decision, [], policy.depth, len(tree), 0, 0, frozenset(),
        {"draft": draft, "tree": 0.0, "verify": verify, "publish": 0.0}, draft_tree=tree, row_nodes=[0, *nodes],
        policy=policy,
    )


def test_chosen_chain_rounds_correct_every_depth_like_for_like():
    """Explored chain rounds accept every node; the chosen 1/4/4 rounds accept their first node only. Level 1 is as
    predicted; at level 2 the rounds reached it every time and never got it accepted, so its acceptance is corrected
    to LEVEL_PRIOR pseudo-trials out of as many plus the rounds seen; past it nothing was seen, so nothing more
    changes. Every depth from 2 on then counts that much, deep policies lose most, and after RECORRECT_ROUNDS chosen
    rounds the choice is made again on the corrected predictions."""
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.020], [1, 16], [0.002, 0.003]), explore_rounds=0, explore_every=0)
    for _ in range(4):
        tuner.explored_chains.append(chain_replay([0.9] * EXPLORE.depth))
    deep = TreePolicy(1, 4, 4)
    assert tuner.explored_chains.levels(deep)[:5] == [(1.0, 1.0)] * 4 + [(0.0, 0.0)]
    assert tuner.score(deep)[0] == 5.0
    tuner.choices[1] = replace(tuner.choice(1), policy=deep)  # as if chosen on those predictions
    for _ in range(RECORRECT_ROUNDS - 1):
        tuner.observe(chain_round(deep, accepted=1), 1)
    assert tuner.factors is None and tuner.choice(1).policy == deep
    tuner.observe(chain_round(deep, accepted=1), 1)
    level2 = LEVEL_PRIOR / (RECORRECT_ROUNDS + LEVEL_PRIOR)
    assert tuner.factors == pytest.approx([1.0] + [level2] * (EXPLORE.depth - 1))
    assert tuner.score(deep)[0] == pytest.approx(2.0 + 3 * level2)
    assert tuner.score(TreePolicy(1, 1, 1))[0] == 2.0
    assert tuner.choice(1).policy.depth < deep.depth


def test_a_chosen_round_scores_exactly_the_policies_its_tree_holds():
    """A chosen 2/2/4 round: the root's children a (0.6) and b (0.3), each expanded with two children, the best four
    nodes verified. The target accepted a and a's first child. The round holds the chains 1/1/1 and 1/2/2 (2 and 3
    tokens), 2/1/2 (2), 2/2/2 (3) and itself (3); not the chain 1/3/3, whose third node was never drafted where the accepted
    path reached it, nor where the target refused a: what a round holds never depends on what the target accepted.
    Each held policy's score is then the mean of its replayed rounds with its prediction counted PREDICTION_ROUNDS
    times."""
    tree = DraftTree(0)
    a, b = tree.add_children([0], [(0, 1, 0.6), (0, 2, 0.3)])
    a1, a2, b1, b2 = tree.add_children([a, b], [(a, 3, 0.9), (a, 4, 0.05), (b, 5, 0.5), (b, 6, 0.1)])
    verified = [a, a1, b, b1]  # the best four: 0.6, 0.54, 0.3, 0.15; a2 and b2 (0.03) left out
    chosen = TreePolicy(2, 2, 4)
    held = {TreePolicy(1, 1, 1): 2.0, TreePolicy(1, 2, 2): 3.0, TreePolicy(2, 1, 2): 2.0, TreePolicy(2, 2, 2): 3.0, chosen: 3.0}
    replay = Replay(tree, dict(zip(verified, [1.0, 1.0, 0.0, 0.0])))
    assert all(replay.exact(p) and 1.0 + replay.expected(p) == tokens for p, tokens in held.items())
    assert not replay.exact(TreePolicy(1, 3, 3)) and not replay.exact(TreePolicy(2, 2, 6))
    refused = Replay(tree, dict(zip(verified, [0.0, 1.0, 1.0, 0.0])))
    assert not refused.exact(TreePolicy(1, 3, 3)) and all(refused.exact(p) for p in held)

    tuner = TreeTuner(Costs([1, 65], [0.010, 0.020], [1, 16], [0.002, 0.003]), explore_rounds=0, explore_every=0)
    for _ in range(4):
        tuner.explored_chains.append(chain_replay([0.9] * EXPLORE.depth))
        tuner.explored_narrow.append(chain_replay([0.9] * EXPLORE.depth))
    predicted = {p: tuner.rounds_for(p).tokens(p)[0] for p in held}
    decision = AcceptanceDecision((0, 1, 2), (1, 3), 99, 1.0)
    record = RoundRecord(
        0, flatten(tree, verified, 8), decision, [], 2, len(tree), 0, 0, frozenset(),
        {"draft": 0.005, "tree": 0.0, "verify": 0.005, "publish": 0.0}, draft_tree=tree, row_nodes=[0, *verified],
        row_probs=torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]), policy=chosen,
    )
    tuner.observe(record, 1)
    tuner.observe(record, 1)
    assert {p: [t for t, _, _ in kept] for p, kept in tuner.replayed.items()} == {p: [tokens] * 2 for p, tokens in held.items()}
    assert tuner.replayed[TreePolicy(1, 2, 2)][0][1:] == (2, 3)  # two levels drafted, root and two nodes verified
    for policy, tokens in held.items():
        expected = (2 * tokens + PREDICTION_ROUNDS * predicted[policy]) / (2 + PREDICTION_ROUNDS)
        assert tuner.score(policy)[0] == pytest.approx(expected)
    assert tuner.score(TreePolicy(1, 3, 3))[0] == tuner.rounds_for(TreePolicy(1, 3, 3)).tokens(TreePolicy(1, 3, 3))[0]


def test_a_wide_trees_rounds_are_set_beside_its_own_levels():
    """A 2/2/3 tree verifies the root's two children and one grandchild: its rounds can reach depth 2 only through the
    child that has a verified child, which is what both sides count."""
    tree = DraftTree(0)
    a, b = tree.add_children([0], [(0, 1, 0.6), (0, 2, 0.3)])
    tree.add_children([a, b], [(a, 3, 0.9), (a, 4, 0.05), (b, 5, 0.9)])
    replay = Replay(tree, {a: 1.0, b: 0.0, 3: 0.5, 4: 0.0, 5: 1.0})
    policy = TreePolicy(2, 2, 3)  # verifies a (0.6), then a's child (0.54), then b (0.3)
    assert replay.levels(policy)[:3] == [(1.0, 1.0), (1.0, 0.5), (0.0, 0.0)]
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.020], [1, 16], [0.002, 0.003]), explore_rounds=0, explore_every=0)
    tuner.explored_narrow.append(replay)
    record = chain_round(TreePolicy(1, 2, 2), accepted=1)
    tuner._correct_levels(replace(record, policy=policy))
    assert [list(kept) for kept in tuner.corrections.depths[:3]] == [[(1.0, 1.0, 1.0, 1.0)], [(1.0, 0.0, 1.0, 0.5)], []]


def test_level_corrections_compare_a_floor_with_its_own_prediction():
    """A chain with a floor drafts only while it is sure, on the explored rounds as in the rounds it runs: its levels
    are set beside the same policy's, so a floor that stops early is not read as a drop in acceptance."""
    correction = LevelCorrection()
    explored = TreeTuner(Costs([1, 65], [0.010, 0.020], [1, 16], [0.002, 0.003])).explored_chains
    explored.append(chain_replay([0.9, 0.9, 0.3, 0.9]))  # values 0.9, 0.81, 0.243: a floor of 0.5 drafts 3 levels
    floor = TreePolicy(1, 8, 8, 0.5)
    predicted = explored.levels(floor)
    assert predicted[:4] == [(1.0, 1.0)] * 3 + [(0.0, 0.0)]
    correction.add([(1.0, 1.0)] * 3 + [(0.0, 0.0)] * (EXPLORE.depth - 3), predicted)
    assert correction.factors() == [1.0] * EXPLORE.depth
    correction.add([(1.0, 1.0), (1.0, 0.0), (0.0, 0.0)] + [(0.0, 0.0)] * (EXPLORE.depth - 3), predicted)
    level2 = (1.0 + LEVEL_PRIOR) / (2.0 + LEVEL_PRIOR)  # one of two rounds accepted the second node
    assert correction.factors() == pytest.approx([1.0] + [level2] * (EXPLORE.depth - 1))


def test_rounds_of_requests_together_are_priced_at_what_they_took():
    """Beside batch-mates a round's own bookkeeping is priced at a lone round's times the requests until its
    concurrency is measured; once the lockstep's cost there is in and LOCKSTEP_ROUNDS rounds are kept, at the median
    of what they took beyond their forwards, levels and rows, whole. A lone round's fit moving later moves a lone
    round's price, not theirs; a lockstep cost learned later is taken out of the kept rounds afresh (the round's
    total stays what the rounds took); concurrencies between are priced in proportion."""
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.020], [1, 16], [0.002, 0.003]), explore_rounds=0, explore_every=0)
    tuner.explored_chains.append(chain_replay([0.9] * EXPLORE.depth))
    tuner.costs.overhead_per_round = 0.004  # a lone round's bookkeeping: 32 ms for 8 requests
    policy, shape = TreePolicy(1, 2, 2), (2.0, 3.0)
    model = tuner.costs.model_seconds(policy, 2.0, 8, shape)
    assert tuner.costs.round_seconds(policy, 2.0, 8, shape) == pytest.approx(model + 8 * 0.004)
    draft = tuner.costs.draft_seconds_for(policy, 2.0, 8)  # levels that cost the lockstep nothing beyond the drafter
    tuner.levels[8] = deque([0.0] * LOCKSTEP_ROUNDS, maxlen=64)
    tuner.costs.lockstep_per_level[8] = 0.0
    for _ in range(LOCKSTEP_ROUNDS):
        assert 8 not in tuner.choices
        tuner.observe(chain_round(policy, accepted=1, draft=draft, verify=model - draft + 0.012), 8)
    assert tuner.costs.per_round_at(8) == pytest.approx(0.012) and 8 in tuner.choices  # first measured: chosen on it
    assert tuner.costs.round_seconds(policy, 2.0, 8, shape) == pytest.approx(model + 0.012)
    tuner.costs.overhead_per_round = 0.010  # lone rounds fitted again
    assert tuner.costs.round_seconds(policy, 2.0, 8, shape) == pytest.approx(model + 0.012)
    assert tuner.costs.round_seconds(policy, 2.0, 1, shape) == pytest.approx(tuner.costs.model_seconds(policy, 2.0, 1, shape) + 0.010)
    assert tuner.costs.per_round_at(4) == pytest.approx(0.010 + (0.012 - 0.010) * 3 / 7)
    assert tuner.costs.per_round_at(16) == pytest.approx(0.012 * 2)
    tuner.levels[8] = deque([0.002] * LOCKSTEP_ROUNDS, maxlen=64)  # each level costs the lockstep 2 ms after all
    tuner.observe(chain_round(policy, accepted=1, draft=draft + 0.004, verify=model - draft + 0.008), 8)
    assert tuner.costs.lockstep_at(8) == pytest.approx(0.002)
    assert tuner.costs.per_round_at(8) == pytest.approx(0.008)  # every kept round less its levels at 2 ms
    assert tuner.costs.round_seconds(policy, 2.0, 8, shape) == pytest.approx(model + 0.012)
    tuner.costs.round_at_concurrency[8] = -1.0
    assert tuner.costs.round_seconds(policy, 2.0, 8, shape) == pytest.approx(model)  # never less than the forwards


def test_a_choice_prices_the_whole_grid_as_score_prices_each_policy():
    """`choose` prices every grid policy at once, its tokens (with level corrections and replayed rounds) and its
    time; what it picks, and the rate it records, are those of the policy `score` rates highest one at a time (the
    first in the grid on a tie), with floors, replayed rounds, the lockstep and a round's own at a concurrency all
    counted."""
    tuner = TreeTuner(Costs([1, 8, 16, 65], [0.010, 0.011, 0.030, 0.080], [1, 16], [0.001, 0.004]), explore_rounds=0)
    for confidences in ([0.9] * 8, [0.9, 0.5, 0.9, 0.2], [0.3, 0.9], [0.9, 0.9, 0.9]):
        tuner.explored_chains.append(chain_replay(confidences))
    tree = DraftTree(0)  # and a narrow round, which every wider policy is scored on too (no wide one yet)
    a, b = tree.add_children([0], [(0, 1, 0.6), (0, 2, 0.3)])
    tree.add_children([a, b], [(a, 3, 0.9), (a, 4, 0.05), (b, 5, 0.9)])
    tuner.explored_narrow.append(Replay(tree, {a: 1.0, b: 0.0, 3: 0.5, 4: 0.0, 5: 1.0}))
    tuner.costs.overhead_per_depth, tuner.costs.overhead_per_round, tuner.costs.overhead_per_row = 0.0005, 0.003, 0.0001
    tuner.costs.lockstep_per_level[8], tuner.costs.round_at_concurrency[8] = 0.002, 0.014
    tuner.replayed[TreePolicy(1, 8, 8, 0.2)] = Kept([(4.0, 4, 5)] * 8)
    tuner.replayed[TreePolicy(1, 2, 2)] = Kept([(2.0, 2, 3)] * 4)
    for factors in (None, [1.0, 0.93, 0.81, 0.8, 0.77, 0.6, 0.55, 0.5]):  # before and after a level correction
        tuner.factors = factors
        assert tuner._grid_tokens().tolist() == [tuner.tokens(p) for p in grid()]  # the same arithmetic, bit for bit
    tuner.explored_chains.append(chain_replay([0.5, 0.9]))  # the rounds change: the sums with them
    assert tuner._grid_tokens().tolist() == [tuner.tokens(p) for p in grid()]
    tuner.factors = None
    chosen = {}
    for concurrent in (1, 3, 8):
        best = max(grid(), key=lambda p: tuner.score(p, concurrent)[1])
        chosen[concurrent] = tuner.choose(concurrent)
        assert chosen[concurrent] == best
        assert tuner.history[-1]["tokens_per_s"] == pytest.approx(tuner.score(best, concurrent)[1], rel=1e-12)
        assert tuner.history[-1]["tokens_per_round"] == pytest.approx(tuner.score(best, concurrent)[0], rel=1e-12)
    assert chosen[8].budget < chosen[1].budget  # the prices differ by concurrency, and the choice with them


def test_grid_covers_chains_and_trees_within_the_exploration_tree():
    policies = grid()
    assert TreePolicy(1, 5, 5) in policies and TreePolicy(8, 5, 32) in policies and TreePolicy(4, 4, 16) in policies
    assert TreePolicy(1, EXPLORE.depth, EXPLORE.depth, 0.1) in policies
    assert all(p.width <= EXPLORE.width and p.depth <= EXPLORE.depth and p.budget <= EXPLORE.budget for p in policies)


def test_tuner_trades_acceptance_against_this_machines_costs(engine):
    """Cheap verification rows: a wide, deep tree pays. Costly rows: a smaller budget wins. Output stays exact."""
    cheap = TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=4)
    second_choice = OracleDrafter(engine.drafter.config, engine.drafter.reference, rank=lambda p: 1)
    gen = generate_auto(engine, cheap, second_choice, max_new_tokens=30)
    assert gen.token_ids == second_choice.reference[len(PROMPT) : len(PROMPT) + 30]
    assert {r["policy"] for r in cheap.history} and gen.stats.rounds > cheap.explore_rounds
    wide = cheap.history[0]["policy"]
    assert wide.width > 1  # the true token is never the drafter's first choice, so a chain accepts nothing
    steep = TreeTuner(Costs([1, 65], [0.010, 0.500], [1, 16], [0.001, 0.001]))
    steep.explored = cheap.explored
    assert steep.choose().budget < wide.budget
    # rows are cheap up to one request's tree, then every row costs: requests stepping together get smaller trees
    saturating = TreeTuner(Costs([1, 8, 16], [0.010, 0.011, 0.500], [1, 16], [0.001, 0.001]), explore_rounds=0)
    saturating.explored = cheap.explored
    alone, batched = saturating.choose(1), saturating.choose(8)
    assert batched.budget < alone.budget
    assert saturating.policy(8) == batched and saturating.policy(1) == alone


def test_exploration_takes_three_trees_and_scores_chains_and_width_two_exactly(engine):
    """A wide tree may leave deep paths unverified; the chain rounds and the narrow rounds (which verify every node
    they record) measure chains and width-2 policies exactly."""
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=6, explore_every=0)
    rounds = []
    gen = generate_auto(engine, tuner, max_new_tokens=30, on_round=rounds.append)
    assert gen.token_ids == engine.drafter.reference[len(PROMPT) : len(PROMPT) + 30]
    assert [r.policy for r in rounds[:6]] == [EXPLORE, EXPLORE_NARROW, EXPLORE_CHAIN] * 2
    assert len(tuner.explored) == len(tuner.explored_narrow) == len(tuner.explored_chains) == 2
    chains = [r for r in rounds[:6] if r.policy == EXPLORE_CHAIN]

    def predicted(policy: TreePolicy) -> float:  # on the explored rounds alone (chosen rounds weigh in after them)
        return tuner.rounds_for(policy).tokens(policy)[0]

    for depth in (1, 3, EXPLORE.depth):
        chain = TreePolicy(1, depth, depth)
        expected = sum(min(r.decision.num_accepted, depth) for r in chains) / len(chains)
        assert predicted(chain) == 1.0 + expected
    narrow = [r for r in rounds[:6] if r.policy == EXPLORE_NARROW]
    assert all(len(r.row_nodes) == len(r.draft_tree) for r in narrow)  # every recorded node verified
    assert predicted(EXPLORE_NARROW) == 1.0 + sum(r.decision.num_accepted for r in narrow) / len(narrow)
    for policy in (TreePolicy(2, 3, 6), TreePolicy(2, 5, 12)):
        exact = [expected_accepted(r.draft_tree, dict(zip(r.row_nodes, r.row_probs.tolist())), policy) for r in narrow]
        assert predicted(policy) == pytest.approx(1.0 + sum(exact) / len(exact))


def test_after_the_first_rounds_one_in_explore_every_explores_again_per_request(engine):
    """Exploring goes on between chosen rounds (the three trees in turn), each time choosing again; requests stepping
    together explore n times less often per round of theirs: an exploring round holds up every batch-mate."""
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=3, explore_every=4)
    rounds = []
    gen = generate_auto(engine, tuner, max_new_tokens=40, on_round=rounds.append)
    assert gen.token_ids == engine.drafter.reference[len(PROMPT) : len(PROMPT) + 40]
    assert len(rounds) >= 11
    assert [r.policy for r in rounds[:3]] == list(EXPLORATIONS)
    assert rounds[6].policy == EXPLORE and rounds[10].policy == EXPLORE_NARROW
    assert all(r.policy not in EXPLORATIONS for i, r in enumerate(rounds[3:11], 3) if i not in (6, 10))
    for kind in EXPLORATIONS:
        assert len(tuner.rounds_of(kind)) == sum(r.policy == kind for r in rounds)
    refreshed = [i for i, r in enumerate(rounds[3:], 3) if r.policy in EXPLORATIONS]
    assert tuner.refreshes == len(refreshed) and tuner.explorations == 3 + len(refreshed)
    assert len(tuner.history) >= 1 + sum(i + 1 < len(rounds) for i in refreshed)  # the round after one chooses again
    together = TreeTuner(tuner.costs, explore_rounds=0, explore_every=4)
    together.explored, together.explored_narrow, together.explored_chains = tuner.explored, tuner.explored_narrow, tuner.explored_chains
    for _ in range(2 * 4 * 2):  # 8 rounds of 2 requests: one refresh, not one every 4 rounds
        together.policy(2)
    assert together.refreshes == together.explorations == 1
    for _ in range(2 * 4 * 2):
        together.policy(2)
    assert together.refreshes == together.explorations == 2


def test_nodes_a_wide_round_left_unverified_count_at_their_calibrated_rate():
    """A node recorded but not verified counts at the acceptance verified nodes of its drafter probability had
    (pulled towards that probability while few were seen), not at 0."""
    tree = DraftTree(0)
    a, b = tree.add_children([0], [(0, 1, 0.75), (0, 2, 0.2)])
    (c,) = tree.add_children([a], [(a, 3, 0.95)])
    verified = {0: 1.0, a: 1.0, b: 0.0}  # c was recorded, left out of the budget
    calibration = Calibration()
    calibration.add(tree, verified)
    rates = calibration.rates()
    prior = Calibration.PRIOR
    assert rates[Calibration.bin(0.75)] == pytest.approx((1.0 + prior * 0.75) / (1.0 + prior))
    assert rates[Calibration.bin(0.2)] == pytest.approx((0.0 + prior * 0.25) / (1.0 + prior))
    assert rates[Calibration.bin(0.95)] == pytest.approx(0.95)  # nothing seen there: the drafter's word
    chain = TreePolicy(1, 2, 2)
    assert Replay(tree, verified, rates).expected(chain) == pytest.approx(1.0 + rates[Calibration.bin(0.95)])
    assert Replay(tree, verified).expected(chain) == 1.0  # without rates, an unverified node counts 0
    calibration.add(tree, {0: 1.0, a: 0.0})
    assert calibration.rates()[Calibration.bin(0.75)] < rates[Calibration.bin(0.75)]  # the latest round weighs more


def test_bookkeeping_is_fitted_over_rows_through_medians():
    """A chain's and a wide tree's bookkeeping give a line over rows; one slow round (a warm-up) does not move it."""
    chain, wide = [(9, 0.002)] * 4 + [(9, 0.040)], [(65, 0.009)] * 4 + [(65, 0.0)]
    intercept, slope = fit_line(chain + wide)
    assert slope == pytest.approx(0.007 / 56) and intercept == pytest.approx(0.002 - 9 * 0.007 / 56)
    assert fit_line([(9, 0.002), (9, 0.004)]) == (pytest.approx(0.003), 0.0)  # one row count: a flat line
    intercept, slope = fit_line([(9, 0.0), (65, 0.010)])  # a negative intercept: through the origin
    assert intercept == 0.0 and slope > 0.0
    assert fit_line([(9, 0.004), (65, 0.001)]) == (pytest.approx(0.0025), 0.0)  # never a negative slope


def test_bookkeeping_is_sloped_on_exploring_rounds_and_levelled_on_chosen_ones(engine):
    """The rest of a lone round outside the models: its slope over rows from the exploration rounds, its level from
    the chosen rounds once there are some (an exploring round also carries every node it recorded); a round whose
    tree was drafted ahead is left out (it skipped its drafting)."""
    rounds = []
    generate_auto(engine, TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=3), max_new_tokens=30, on_round=rounds.append)
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=0, explore_every=0)

    def costing(record, policy, rest, pre_built=False):  # `record` drafted with `policy`, `rest` seconds outside the models
        model = tuner.costs.model_seconds(policy, record.decision.num_accepted + 1)
        return replace(record, policy=policy, pre_built=pre_built, seconds={"draft": model + rest, "tree": 0.0, "verify": 0.0, "publish": 0.0})

    wide, chain = (next(r for r in rounds if r.policy == kind) for kind in (EXPLORE, EXPLORE_CHAIN))
    tuner.observe(costing(wide, EXPLORE, 0.030), 1)
    tuner.observe(costing(chain, EXPLORE_CHAIN, 0.016), 1)
    slope = 0.014 / (EXPLORE.budget - EXPLORE_CHAIN.budget)
    assert tuner.costs.overhead_per_row == pytest.approx(slope)
    assert tuner.costs.overhead_per_round == pytest.approx(0.016 - slope * (EXPLORE_CHAIN.budget + 1))
    chosen = tuner.choice(1).policy
    rows_part = slope * (chosen.budget + 1)
    for level in (0.004, 0.005, 0.006):  # below the exploring rounds' level of 0.01375
        tuner.observe(costing(rounds[-1], chosen, level + rows_part), 1)
    tuner.observe(costing(rounds[-1], chosen, 0.100, pre_built=True), 1)
    assert tuner.costs.overhead_per_row == pytest.approx(slope)
    assert tuner.costs.overhead_per_round == pytest.approx(0.005)


def test_an_exploration_after_the_first_waits_for_a_lone_request_and_hands_out_explore_rounds(engine):
    """After the first exploration, exploring again (after a lone request's drift) is left to a lone request: requests
    stepping together draft the chosen tree, since an exploring round costs every batch-mate its time (they explore
    by `explore_every`, and take the exploration themselves only without it). The exploration then hands out
    `explore_rounds` exploring trees; a round drafted with the chosen tree that finishes after an exploration began is
    left out of it, and does not fail. The first exploration goes to whoever asks."""
    first = TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=3, explore_every=10**6)
    assert [first.policy(1), first.policy(8), first.policy(8)] == list(EXPLORATIONS) and first.exploring == 0
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=3, explore_every=10**6)
    rounds = []
    generate_auto(engine, tuner, max_new_tokens=30, on_round=rounds.append)
    chosen = next(r for r in rounds if r.policy not in EXPLORATIONS)
    kept = {kind: len(tuner.rounds_of(kind)) for kind in EXPLORATIONS}
    tuner.exploring = tuner.explore_rounds  # what a lone request's drift does
    assert all(tuner.policy(8) not in EXPLORATIONS for _ in range(8)) and tuner.exploring == 3
    policies = [tuner.policy(1) for _ in range(4)]
    assert policies[:3] == list(EXPLORATIONS) and policies[3] not in EXPLORATIONS and tuner.exploring == 0
    tuner.explore_every, tuner.exploring = 0, 1  # without refreshes, requests stepping together take it themselves
    assert tuner.policy(8) in EXPLORATIONS and tuner.exploring == 0
    tuner.exploring = 1
    tuner.observe(chosen, 8)  # drafted before the exploration began
    assert {kind: len(tuner.rounds_of(kind)) for kind in EXPLORATIONS} == kept
    tuner.observe(rounds[0], 8)  # an exploring round is kept
    assert len(tuner.rounds_of(rounds[0].policy)) == kept[rounds[0].policy] + 1


def test_beside_batch_mates_drift_explores_one_round_not_a_whole_exploration(engine):
    """After drift, or a long while on one choice, a lone request explores `explore_rounds` rounds again; requests
    stepping together explore the next round only, as a refresh does (a whole exploration would give every one of
    them an exploration tree, step after step)."""
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=3, explore_every=1000)
    rounds = []
    generate_auto(engine, tuner, max_new_tokens=30, on_round=rounds.append)
    chosen = replace(next(r for r in rounds if r.policy not in EXPLORATIONS), draft_tree=None)  # scores no other policy
    tuner.revisit_every = 1  # every full window of realised rounds now explores again
    for concurrent in (8, 1):
        refreshes = tuner.refreshes
        tuner.realised.clear()
        for _ in range(tuner.realised.maxlen):
            assert tuner.exploring == 0
            tuner.observe(replace(chosen, policy=tuner.choice(concurrent).policy), concurrent)  # the choice may move
        if concurrent == 8:
            assert tuner.exploring == 0
            policies = [tuner.policy(8) for _ in range(8)]
            assert policies[0] in EXPLORATIONS and all(p == tuner.choice(8).policy for p in policies[1:])
            assert tuner.refreshes == refreshes + 1
        else:
            assert tuner.exploring == tuner.explore_rounds
            assert [tuner.policy(1) for _ in range(3)] == list(EXPLORATIONS)


def test_requests_stepping_together_learn_what_a_drafting_level_costs_them(engine):
    """Rounds of 8 requests whose drafting levels cost far more than the drafter's forwards (their lockstep), and whose
    Draft calls spent time off the worker, which is the round's, not its levels':
    after LOCKSTEP_ROUNDS of them the tuner charges each level that extra at 8 and drafts shallower there;
    a lone request's choice does not move."""
    def given() -> Costs:
        return Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001])

    tuner = TreeTuner(given(), explore_rounds=4)
    second_choice = OracleDrafter(engine.drafter.config, engine.drafter.reference, rank=lambda p: 1)  # deep trees pay
    rounds = []
    generate_auto(engine, tuner, second_choice, max_new_tokens=30, on_round=rounds.append)
    tuner.costs = given()  # this machine's forwards and bookkeeping out of the way: the given costs alone decide
    tuner.choices.clear()
    alone, deep = tuner.choice(1).policy, tuner.choice(8).policy
    assert deep.depth > 1 and tuner.choice(4).policy == deep  # nothing measured together yet
    last = rounds[-1]
    model = tuner.costs.draft_seconds_for(deep, last.decision.num_accepted + 1, 8)
    # as a service's rounds: 6 ms of each round's drafting was its Draft call on the wire and queued (once a round)
    slow = replace(last, policy=deep, seconds={**last.seconds, "draft": model + deep.depth * 0.050 + 0.006})
    for _ in range(LOCKSTEP_ROUNDS - 1):
        tuner.observe(slow, 8, draft_off_worker=0.006)
    assert 8 not in tuner.costs.lockstep_per_level and tuner.choice(8).policy == deep
    tuner.observe(slow, 8, draft_off_worker=0.006)
    assert tuner.costs.lockstep_per_level[8] == pytest.approx(0.050)  # whole: a lone level's is priced per round
    assert 1 not in tuner.levels  # the lone rounds above taught it nothing
    assert tuner.choice(8).policy.depth < deep.depth and tuner.choice(1).policy == alone
    # a batch's tail (4 requests left) is priced from the concurrencies measured, not as free, and chooses again
    assert tuner.costs.lockstep_at(4) == pytest.approx(0.050 * 3 / 7)
    assert tuner.costs.lockstep_at(16) == pytest.approx(0.050 * 2)
    assert tuner.choice(4).policy.depth < deep.depth


def test_costs_follow_what_forwards_took_in_rounds():
    """Forwards in rounds cost more than the warm measurement alone: once MIN_OBSERVED of a model's forwards are in,
    its curve is scaled by their median ratio; forwards past the measured rows (a prefill) are left out."""
    costs = Costs([1, 65], [0.010, 0.020], [1, 16], [0.001, 0.002])
    for _ in range(MIN_OBSERVED - 1):
        costs.observe("draft", 16, 0.004)
    costs.observe("draft", 1000, 1.0)
    assert costs.draft_at(16) == pytest.approx(0.002)  # not enough forwards yet
    costs.observe("draft", 1, 0.002)
    assert costs.draft_at(16) == pytest.approx(0.004) and costs.draft_at(1) == pytest.approx(0.002)
    assert costs.verify_at(65) == pytest.approx(0.020)  # the target's curve is its own
    policy = TreePolicy(1, 3, 3)
    assert costs.draft_seconds_for(policy, 1.0) == pytest.approx(3 * 0.002)  # each of its levels at twice 1 ms


def test_a_point_measured_under_load_is_priced_by_its_own_forwards():
    """A start-up measurement taken under a passing load (a worker measuring while Ray starts its processes) can be
    off at some row counts only: a point with MIN_OBSERVED forwards of about its rows is scaled by their own median
    ratio, the others by the median of all."""
    costs = Costs([1, 65], [0.010, 0.020], [1, 2, 4], [0.008, 0.002, 0.0025])  # 1 row measured 4x too slow
    for _ in range(MIN_OBSERVED - 1):
        costs.observe("draft", 1, 0.002)
    assert costs.draft_at(1) == pytest.approx(0.008)  # not enough forwards yet
    costs.observe("draft", 1, 0.002)
    for _ in range(MIN_OBSERVED):
        costs.observe("draft", 3, 0.0045)  # nearest the 4-row point: 2x the curve at 3 rows (2.25 ms)
    assert costs.draft_at(1) == pytest.approx(0.002)
    assert costs.draft_at(4) == pytest.approx(0.0050)
    assert costs.scales["draft"] == pytest.approx((0.25 + 2.0) / 2)  # the median of all, for the 2-row point
    assert costs.draft_at(2) == pytest.approx(0.002 * costs.scales["draft"])


def test_forwards_of_several_calls_cost_an_extra_of_their_own():
    """Requests stepping together share a forward and pay for each call beyond their rows: what forwards of 8 calls
    took beyond the curve at their rows prices rounds of 8 (at any rows), and leaves the lone curve (and 4 calls,
    not seen yet) as they were."""
    costs = Costs([1, 24, 65], [0.010, 0.012, 0.020], [1, 16], [0.001, 0.002])
    for _ in range(MIN_OBSERVED):
        costs.observe("verify", 24, 0.024, calls=8)  # 8 requests of 3 rows: 12 ms beyond the lone 24-row forward
    assert costs.verify_at(24, 8) == pytest.approx(0.024) and costs.verify_at(65, 8) == pytest.approx(0.032)
    assert costs.verify_at(24) == pytest.approx(0.012) and costs.verify_at(24, 4) == pytest.approx(0.012)
    assert "verify" not in costs.scales  # forwards of several calls do not scale the lone curve
    assert costs.model_seconds(TreePolicy(1, 2, 2), 1.0, 8) == pytest.approx(2 * costs.draft_at(8) + 0.024)


def test_kept_rounds_keep_their_tokens_sum_as_old_rounds_leave_and_in_copies():
    kept = Kept([(float(i), 1, 2) for i in range(REPLAYED_ROUNDS + 10)])
    assert len(kept) == REPLAYED_ROUNDS and kept.tokens == pytest.approx(sum(t for t, _, _ in kept))
    for copied in (copy.copy(kept), copy.deepcopy(kept), pickle.loads(pickle.dumps(kept))):
        assert list(copied) == list(kept) and copied.maxlen == kept.maxlen and copied.tokens == pytest.approx(kept.tokens)


def test_the_engine_feeds_its_forwards_to_tree_auto(engine):
    tuner = TreeTuner(Costs([1, 65], [0.010, 0.011], [1, 16], [0.001, 0.001]), explore_rounds=2)
    gen = generate_auto(engine, tuner, max_new_tokens=20)
    assert len(tuner.costs.observed["verify"]) == gen.stats.target_forwards  # the prompt's prefill too: under 65 rows
    assert len(tuner.costs.observed["draft"]) >= gen.stats.rounds
    assert set(tuner.costs.scales) == {"verify", "draft"}
