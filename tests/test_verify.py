"""Verification contract (docs/sampling.md): greedy path + frontier, exact seeded sampling, the target distribution.

Statistical tests use fixed seeds and a chi-square test; each has a stated false-alarm rate (ALPHA)
under the null hypothesis that the sampler is exact. The sampled tests together hold about 8 such
tests, so the chance that an exact sampler fails any of them is below 1% (and the seeds are fixed,
so a passing run passes every time).
"""

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eyas.keyed import keyed_token, position_noise, target_log_probs, target_probs
from eyas.sampling import SamplingError, SamplingParams
from eyas.tree import DraftTree, flatten
from eyas.verify import decide, greedy_decision, sampled_decision

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
    decision, _ = greedy_decision(flat, one_hot_logits(flat, argmax))
    assert decision.accepted_rows == (0, r2, r24)
    assert decision.accepted_tokens == (2, 4)
    assert decision.frontier_token == 7


def test_greedy_with_no_matching_child_emits_only_the_frontier_token():
    flat = small_tree()
    decision, _ = greedy_decision(flat, one_hot_logits(flat, [6] * flat.num_rows))
    assert decision.accepted_rows == (0,) and decision.accepted_tokens == () and decision.frontier_token == 6


def test_greedy_reports_the_target_probabilities_of_every_node_and_the_frontier():
    """Informational under greedy, but traces and the tuner read them: each node's token under the softmax of its
    parent row, the frontier token under its row's; a tie goes to the lowest token id, as torch's argmax has it."""
    flat = small_tree()
    torch.manual_seed(0)
    logits = torch.randn(flat.num_rows, 8) * 4
    logits[0, 2] = logits[0].max() + 1.0
    logits[0, 5] = logits[0, 2]  # a tie at the root: token 2 (a child) comes first
    decision, acceptance = greedy_decision(flat, logits)
    probs = torch.softmax(logits.double(), dim=-1)
    parents, tokens = flat.parents.tolist(), flat.tokens.tolist()
    expected = [1.0] + [probs[parents[r], tokens[r]].item() for r in range(1, flat.num_rows)]
    assert decision.accepted_rows[:2] == (0, tokens.index(2))
    assert decision.token_probs == pytest.approx(expected, rel=1e-6)
    assert decision.frontier_prob == pytest.approx(probs[decision.accepted_rows[-1], decision.frontier_token].item(), rel=1e-6)
    best = logits.argmax(dim=-1)
    assert acceptance.tolist() == [1.0] + [float(best[parents[r]] == tokens[r]) for r in range(1, flat.num_rows)]


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


def test_position_noise_depends_only_on_seed_and_position():
    assert torch.equal(position_noise(7, 3, 50), position_noise(7, 3, 50))
    assert torch.equal(position_noise(7, 3, 80)[:50], position_noise(7, 3, 50))  # one stream per key, whatever V
    assert not torch.equal(position_noise(7, 3, 50), position_noise(7, 4, 50))
    assert not torch.equal(position_noise(7, 3, 50), position_noise(8, 3, 50))
    assert torch.isfinite(position_noise(2**63 - 1, 2**63 - 1, 1000)).all()
    with pytest.raises(SamplingError, match="position"):
        position_noise(1, -1, 10)


def test_position_noise_is_standard_gumbel():
    """Kolmogorov-Smirnov against the standard Gumbel law, pooled over positions (false alarms: ALPHA)."""
    from scipy.stats import gumbel_r, kstest

    noise = torch.cat([position_noise(5, t, 1000) for t in range(20)])
    assert kstest(noise.numpy(), gumbel_r.cdf).pvalue > ALPHA


def test_keyed_token_never_picks_an_excluded_token_and_samples_the_target_law():
    """Over seeds, the token the noise of one position picks follows the filtered target distribution."""
    torch.manual_seed(1)
    logits = torch.randn(1, 12) * 2
    for params in [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5, top_p=0.8)]:
        log_probs = target_log_probs(logits, params)[0]
        probs = log_probs.exp()
        trials = 6000
        counts = torch.bincount(torch.tensor([keyed_token(log_probs, seed, 9) for seed in range(trials)]), minlength=12)
        assert counts[probs == 0].sum() == 0
        keep = probs * trials >= 5
        expected = probs[keep] * trials
        assert chisquare(counts[keep].numpy(), (expected * counts[keep].sum() / expected.sum()).numpy()).pvalue > ALPHA


def sequential_acceptance(flat, probs):
    """[N] P(row accepted | parent reached) under the sequential rule: try the children in draft order, accept
    child x with the residual probability p'(x), zero and renormalise on rejection (the former sampler)."""
    out = torch.ones(flat.num_rows, dtype=torch.float64)
    tokens = flat.tokens.tolist()
    for row in range(flat.num_rows):
        residual = probs[row].clone()
        reach = 1.0  # P(every earlier sibling was rejected)
        for child in flat.children(row):
            accept = residual[tokens[child]].item()
            out[child] = reach * accept
            reach *= 1.0 - accept
            residual[tokens[child]] = 0.0
            residual = residual / residual.sum()
    return out


def synthetic_target(flat, seed):
    """p(next | path) depends on the path's last token: [8, 8] base law and its [N, V] rows for the tree."""
    tokens = flat.tokens.tolist()
    generator = torch.Generator().manual_seed(seed)
    base = torch.softmax(torch.randn(8, 8, generator=generator, dtype=torch.float64) * 1.5, -1)
    return base, torch.stack([base[tokens[r]] for r in range(flat.num_rows)])  # [N, V]


def test_every_child_is_accepted_with_the_probability_of_the_sequential_rule():
    """decide's per-row acceptance equals the sequential rule's exactly (so acceptance lengths are unchanged),
    and the accepted path's last row follows those probabilities over seeds (chi-square, ALPHA)."""
    flat = small_tree()
    base, probs = synthetic_target(flat, 3)
    params = SamplingParams(temperature=1.0)
    _, acceptance = decide(flat, probs.log(), params)
    assert torch.allclose(acceptance, sequential_acceptance(flat, probs), atol=1e-12, rtol=0)
    on_path = torch.tensor([acceptance[flat.path_to(r)].prod().item() for r in range(flat.num_rows)])
    children = [flat.children(r) for r in range(flat.num_rows)]
    ends_at = torch.stack([on_path[r] - on_path[children[r]].sum() for r in range(flat.num_rows)])  # P(last row = r)
    trials = 8000
    counts = torch.zeros(flat.num_rows)
    for seed in range(trials):
        decision, _ = decide(flat, probs.log(), SamplingParams(temperature=1.0, seed=seed))
        counts[decision.accepted_rows[-1]] += 1
    assert chisquare(counts.numpy(), (ends_at * trials).numpy()).pvalue > ALPHA
    greedy = decide(flat, probs.log(), SamplingParams())[1]
    best = probs.argmax(-1)
    tokens = flat.tokens.tolist()
    assert greedy.tolist() == [1.0] + [float(tokens[r] == best[flat.parents[r]].item()) for r in range(1, flat.num_rows)]


def test_tree_sampler_preserves_the_joint_target_distribution_of_two_tokens():
    """The emitted (x1, x2) must follow p(x1 | root) p(x2 | x1) exactly, whether x2 came from the tree or
    from the next round (where the noise of the same position picks it)."""
    flat = small_tree()
    base, probs = synthetic_target(flat, 0)
    trials = 20000
    counts = torch.zeros(8, 8)
    for seed in range(trials):
        d, _ = sampled_decision(flat, probs.log(), seed)
        emitted = [*d.accepted_tokens, d.frontier_token]
        if len(emitted) < 2:  # the next round's root is x1, at position prefix + 1; x2 goes to prefix + 2
            emitted.append(keyed_token(base[emitted[0]].log(), seed, flat.prefix_len + 2))
        counts[emitted[0], emitted[1]] += 1
    expected = (base[0][:, None] * base * trials).flatten()
    keep = expected >= 5
    observed = counts.flatten()[keep]
    exp = expected[keep] * observed.sum() / expected[keep].sum()
    assert chisquare(observed.numpy(), exp.numpy()).pvalue > ALPHA


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory):
    from tests.helpers.tiny import make_drafter, make_target

    from eyas import Engine

    root = tmp_path_factory.mktemp("sampling")
    target = make_target(
        root / "t", vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, init_std=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    drafter = make_drafter(root / "d", target, "eagle1")
    return Engine.from_pretrained(target, drafter, tree={"width": 3, "depth": 2, "budget": 6}, kv_slots=64)


def exact_two_token_joint(engine, prompt, params):
    """p(x1, x2) by enumeration over the target's own forwards (Hugging Face's, as the reference)."""
    model = AutoModelForCausalLM.from_pretrained(engine.target.path)
    with torch.no_grad():
        first = target_probs(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        second = torch.stack(
            [target_probs(model(torch.tensor([prompt + [x]])).logits[0, -1:], params)[0] for x in range(8)]
        )
    return first[:, None] * second


@pytest.mark.slow  # 3000 sampled requests per case
@pytest.mark.parametrize("top_p, speculate", [(1.0, True), (0.8, True), (0.8, False)])
def test_engine_sampling_matches_the_exact_target_joint_distribution(small_vocab_engine, top_p, speculate):
    engine = small_vocab_engine
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    joint = exact_two_token_joint(engine, prompt, params)
    trials = 3000
    options = dict(max_new_tokens=2, temperature=1.0, top_p=top_p)
    # one seeded trial per request, 64 requests a forward; the first trials also alone, to the same tokens
    gens = engine.generate_batch([prompt] * trials, seed=list(range(trials)), speculate=speculate, **options)
    alone = [engine.generate(prompt, seed=s, speculate=speculate, **options).token_ids for s in range(20)]
    assert [g.token_ids for g in gens[:20]] == alone
    counts = torch.zeros(8, 8)
    accepted_any = 0
    for gen in gens:
        counts[gen.token_ids[0], gen.token_ids[1]] += 1
        accepted_any += gen.stats.accepted_length_histogram[0] < gen.stats.rounds
    assert accepted_any > trials // 10 if speculate else accepted_any == 0  # drafts used only when speculating
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
