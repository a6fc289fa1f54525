"""Verification contract (facts.md section 3): greedy path + frontier, exact sampling, the target distribution.

Statistical tests use a fixed seed and a chi-square test; each has a stated false-alarm rate
(ALPHA) under the null hypothesis that the sampler is exact.
"""

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eyas.sampling import SamplingParams, round_draws, target_probs
from eyas.tree import DraftTree, flatten
from eyas.verify import greedy_decision, sample_from, sampled_decision

ALPHA = 1e-3  # false-alarm rate of each chi-square test below


def small_tree():
    """root -> {1, 2, 3}; 1 -> {4, 5}; 2 -> {4}: rows are [root, 1, 2, 3, 1.4, 1.5, 2.4] in value order."""
    tree = DraftTree(root_token=0)
    n1, n2, n3 = tree.add_children([0], [(0, 1, 0.5), (0, 2, 0.3), (0, 3, 0.1)])
    tree.add_children([n1, n2], [(n1, 4, 0.6), (n1, 5, 0.3), (n2, 4, 0.9)])
    return flatten(tree, tree.select(6), prefix_len=5)


def one_hot_logits(flat, argmax_by_row):
    logits = torch.zeros(flat.num_rows, 8)
    for row, token in enumerate(argmax_by_row):
        logits[row, token] = 5.0
    return logits


def test_greedy_accepts_the_longest_argmax_path_plus_one_frontier_token():
    flat = small_tree()
    tokens = flat.tokens.tolist()
    row_of = {(flat.parents[r].item(), t): r for r, t in enumerate(tokens)}
    r2 = row_of[(0, 2)]
    r24 = row_of[(r2, 4)]
    argmax = [0] * flat.num_rows
    argmax[0], argmax[r2], argmax[r24] = 2, 4, 7
    decision = greedy_decision(flat, one_hot_logits(flat, argmax))
    assert decision.accepted_rows == (0, r2, r24)
    assert decision.accepted_tokens == (2, 4)
    assert decision.frontier_token == 7


def test_greedy_with_no_matching_child_emits_only_the_frontier_token():
    flat = small_tree()
    decision = greedy_decision(flat, one_hot_logits(flat, [6] * flat.num_rows))
    assert decision.accepted_rows == (0,) and decision.accepted_tokens == () and decision.frontier_token == 6


def test_target_distribution_matches_hugging_face_warpers():
    torch.manual_seed(0)
    logits = torch.randn(16, 50) * 3
    for temperature, top_k, top_p in [(1.0, 0, 0.8), (0.7, 5, 1.0), (1.3, 10, 0.6), (0.5, 0, 0.95)]:
        ours = target_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        scores = TemperatureLogitsWarper(temperature)(None, logits.double())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        assert torch.allclose(ours, torch.softmax(scores, -1), atol=1e-12)


def test_inverse_cdf_draw_never_picks_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0], dtype=torch.float64)
    assert [sample_from(probs, u) for u in (0.0, 0.49, 0.5, 0.999999999)] == [1, 1, 3, 3]


def test_draws_depend_only_on_seed_and_version():
    assert torch.equal(round_draws(7, 3, 5), round_draws(7, 3, 5))
    assert not torch.equal(round_draws(7, 3, 5), round_draws(7, 4, 5))
    assert torch.equal(round_draws(7, 3, 8)[:5], round_draws(7, 3, 5))


def test_tree_sampler_preserves_the_joint_target_distribution_of_two_tokens():
    """Synthetic target: p(next | path) depends on the path's last token. The emitted (x1, x2) must follow
    p(x1 | root) p(x2 | x1) exactly, whether x2 came from the tree or from the next round."""
    flat = small_tree()
    tokens = flat.tokens.tolist()
    generator = torch.Generator().manual_seed(0)
    base = torch.softmax(torch.randn(8, 8, generator=generator, dtype=torch.float64) * 1.5, -1)
    probs = torch.stack([base[tokens[r]] for r in range(flat.num_rows)])  # [N, V]
    trials = 20000
    counts = torch.zeros(8, 8)
    for _ in range(trials):
        d = sampled_decision(flat, probs, torch.rand(flat.num_rows, generator=generator, dtype=torch.float64))
        emitted = [*d.accepted_tokens, d.frontier_token]
        if len(emitted) < 2:  # the next round would draw x2 from the target after x1
            emitted.append(sample_from(base[emitted[0]], torch.rand(1, generator=generator).item()))
        counts[emitted[0], emitted[1]] += 1
    expected = (base[0][:, None] * base * trials).flatten()
    keep = expected >= 5
    observed = counts.flatten()[keep]
    exp = expected[keep] * observed.sum() / expected[keep].sum()
    assert chisquare(observed.numpy(), exp.numpy()).pvalue > ALPHA


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory):
    from tiny import make_drafter, make_target

    from eyas import Engine

    root = tmp_path_factory.mktemp("sampling")
    target = make_target(
        root / "t", vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, init_std=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    drafter = make_drafter(root / "d", target, "eagle1")
    return Engine.from_pretrained(target, drafter, tree={"top_k": 3, "depth": 2, "budget": 6})


def exact_two_token_joint(engine, prompt, params):
    """p(x1, x2) by enumeration over the target's own forwards."""
    model = engine.target.model
    with torch.no_grad():
        first = target_probs(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        second = torch.stack(
            [target_probs(model(torch.tensor([prompt + [x]])).logits[0, -1:], params)[0] for x in range(8)]
        )
    return first[:, None] * second


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_engine_sampling_matches_the_exact_target_joint_distribution(small_vocab_engine, top_p):
    engine = small_vocab_engine
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    joint = exact_two_token_joint(engine, prompt, params)
    trials = 3000
    counts = torch.zeros(8, 8)
    accepted_any = 0
    for seed in range(trials):
        gen = engine.generate(prompt, max_new_tokens=2, temperature=1.0, top_p=top_p, seed=seed)
        counts[gen.token_ids[0], gen.token_ids[1]] += 1
        accepted_any += gen.stats.accepted_length_histogram[0] < gen.stats.rounds
    assert accepted_any > trials // 10  # the drafts were really used, not only frontier tokens
    expected = (joint * trials).flatten()
    observed = counts.flatten()
    assert observed[expected == 0].sum() == 0  # nothing outside the truncated support
    keep = expected >= 5
    exp = expected[keep] * observed[keep].sum() / expected[keep].sum()
    assert chisquare(observed[keep].numpy(), exp.numpy()).pvalue > ALPHA


def test_same_seed_same_sample(small_vocab_engine):
    a = small_vocab_engine.generate([1, 2, 3], max_new_tokens=20, temperature=0.9, top_k=5, seed=11)
    b = small_vocab_engine.generate([1, 2, 3], max_new_tokens=20, temperature=0.9, top_k=5, seed=11)
    assert a.token_ids == b.token_ids


def test_row_acceptance_is_each_nodes_chance_to_be_on_the_accepted_path():
    """Under sampling, P(row on accepted path) = product of row_acceptance along its path (and 0/1 when greedy)."""
    from eyas.verify import row_acceptance

    flat = small_tree()
    tokens = flat.tokens.tolist()
    generator = torch.Generator().manual_seed(3)
    base = torch.softmax(torch.randn(8, 8, generator=generator, dtype=torch.float64), -1)
    probs = torch.stack([base[tokens[r]] for r in range(flat.num_rows)])
    conditional = row_acceptance(flat, probs.log(), SamplingParams(temperature=1.0))
    on_path = torch.tensor([conditional[flat.path_to(r)].prod().item() for r in range(flat.num_rows)])
    trials = 20000
    hits = torch.zeros(flat.num_rows)
    for _ in range(trials):
        d = sampled_decision(flat, probs, torch.rand(flat.num_rows, generator=generator, dtype=torch.float64))
        hits[list(d.accepted_rows)] += 1
    assert torch.allclose(hits / trials, on_path.float(), atol=0.015)
    greedy = row_acceptance(flat, probs.log(), SamplingParams())
    best = probs.argmax(-1)
    expected = [1.0] + [float(tokens[r] == best[flat.parents[r]].item()) for r in range(1, flat.num_rows)]
    assert greedy.tolist() == expected
