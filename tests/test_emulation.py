"""Emulated accelerators: the cost profiles, the synthetic law the timed models follow, and their timing contract.

The law is tested statistically: each check's false-alarm rate under the law is stated (two-sided z bound of 4.4,
about 1e-5 per check), so a benchmark that relies on the law cannot drift from it silently.
"""

import hashlib
import math
import random
import time

import numpy as np
import pytest
import torch

from eyas import Engine
from eyas.emulation import EmulatedDevice, ProfileError, load_profile
from eyas.emulation.law import MODULUS, context_hashes, draft_candidates, powers, scramble, target_logits
from eyas.emulation.profile import Law, profile_from_dict
from eyas.emulation.timed import TimedTarget, row_hashes
from eyas.proposer import Seed
from eyas.runtime.batch import RowsCall, pack
from eyas.runtime.kv import KVPool
from eyas.rounds import start
from eyas.steps import run_alone
from eyas.tree import TreePolicy

Z = 4.4  # two-sided normal bound: a false alarm about once in 1e5 checks


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def engine():
    return Engine.emulated("null", tree={"width": 4, "depth": 4, "budget": 12})


def test_bundled_profiles_load_and_name_their_sources():
    for name in ("null", "h200-1b", "70b-tp4", "70b-tp4-l4"):
        profile = load_profile(name)
        assert profile.name == name and profile.sources.startswith("docs/emulation.md#")
        assert profile.summary()["emulation"] is True
    assert load_profile("null").target.seconds(64, [512]) == 0.0
    tp4 = load_profile("70b-tp4")
    assert tp4.target.seconds(1, [100]) == pytest.approx(tp4.target.seconds(64, [100]))  # memory-bound below the knee
    assert tp4.target.seconds(1000, [100]) > tp4.target.seconds(240, [100])
    assert tp4.draft.seconds(1, [100]) < tp4.target.seconds(1, [100]) / 10  # a drafter step is cheap beside a verification


@pytest.mark.parametrize(
    "data, field",
    [
        ({"draft": {}, "target": {"fixed_ms": 1, "speed": 2}}, "target.speed"),
        ({"draft": {}, "target": {"fixed_ms": -1}}, "target.fixed_ms"),
        ({"target": {}}, "draft"),
        ({"draft": {}, "target": {}, "law": {"agree": [0.9, 0.2]}}, "law.agree"),
        ({"draft": {}, "target": {}, "law": {"vocab": 10}}, "law.vocab"),
        ({"draft": {}, "target": {}, "features": {"dtype": "int8"}}, "features.dtype"),
        ({"draft": {}, "target": {}, "gpu": "h100"}, "gpu"),
    ],
)
def test_a_malformed_profile_is_refused_naming_the_key(data, field):
    with pytest.raises(ProfileError, match=f"^{field}"):
        profile_from_dict(data)


def test_an_unknown_profile_names_the_bundled_ones():
    with pytest.raises(ProfileError, match="bundled: 70b-tp4, 70b-tp4-l4, h200-1b, null"):
        load_profile("h100-8x")


def test_the_drafter_ranks_the_targets_top_token_at_the_laws_rates():
    law = load_profile("null").law
    hashes = np.random.default_rng(0).integers(0, 1 << 24, 40_000)
    top = target_logits(hashes, law).argmax(-1)
    ids, probs = draft_candidates(hashes, law, 4)
    assert (probs > 0).all() and (probs.sum(-1) <= 1 + 1e-12).all() and (probs[:, :-1] >= probs[:, 1:]).all()
    for rank, rate in enumerate(law.agree):
        observed = (ids[:, rank] == top).mean()
        assert abs(observed - rate) <= Z * math.sqrt(rate * (1 - rate) / len(hashes)), (rank, observed, rate)


def test_a_chain_accepts_each_level_at_the_laws_rate(engine):
    """Greedy chains of depth 4: the accepted length of a round is geometric in the law's agreement, cut at 4."""
    a, depth = load_profile("null").law.agree[0], 4
    accepted = []
    for prompt in prompts(6, 24, seed=11):
        gen = engine.generate(prompt, max_new_tokens=200, tree={"width": 1, "depth": depth, "budget": depth})
        accepted += [k for k, n in enumerate(gen.stats.accepted_length_histogram) for _ in range(n)]
    expected = sum(a**k for k in range(1, depth + 1))
    variance = sum((2 * k - 1) * a**k for k in range(1, depth + 1)) - expected**2  # E[L^2] - E[L]^2
    mean = sum(accepted) / len(accepted)
    assert abs(mean - expected) <= Z * math.sqrt(variance / len(accepted)), (mean, expected, len(accepted))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_over_timed_models_decodes_the_synthetic_targets_own_text(engine, temperature):
    """Greedy and seeded sampling: speculative output equals plain decoding of the synthetic target, and a request's
    output is the same in a batch (the law keys every row on its own context)."""
    batch = prompts(4, 20, seed=3)
    alone = [engine.generate(p, max_new_tokens=48, temperature=temperature, seed=i).token_ids for i, p in enumerate(batch)]
    plain = [engine.generate(p, max_new_tokens=48, temperature=temperature, seed=i, speculate=False).token_ids for i, p in enumerate(batch)]
    together = engine.generate_batch(batch, max_new_tokens=48, temperature=temperature, seed=list(range(4)))
    assert alone == plain == [g.token_ids for g in together]


def test_a_held_device_waits_without_the_cpu():
    device = EmulatedDevice()
    wall, cpu = time.perf_counter(), time.process_time()
    with device.hold(0.2):
        pass
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= 0.2 and cpu < 0.05 and device.busy_seconds >= 0.2


def test_a_timed_forward_takes_its_profiles_time():
    profile = profile_from_dict({"target": {"fixed_ms": 40, "knee_rows": 8, "row_ms": 1}, "draft": {}})
    target = TimedTarget(profile, EmulatedDevice(), kv_slots=1)
    slot = target.pool.acquire(64)
    tokens = torch.arange(24)
    call = target.call(slot, 0, tokens, torch.arange(24), torch.ones(24, 24, dtype=torch.bool).tril())
    started = time.perf_counter()
    (out,) = target.run([call])
    assert time.perf_counter() - started >= (40 + 16) / 1000  # 24 rows: 16 past the knee
    assert out.logits.shape == (24, profile.law.vocab) and out.features.shape == (24, profile.feature_width)
    assert out.features.dtype == torch.bfloat16


def test_tree_rows_score_as_their_paths_would_alone(engine):
    """A row's outputs depend on its own path only: siblings, and the rows of other requests, change nothing."""
    target = engine.target
    slot = target.pool.acquire(64)
    prefix = torch.tensor([5, 6, 7, 8, 9])
    target.run([target.call(slot, 0, prefix, torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril(), with_logits=False)])
    # a tree: root 10, children 11 and 12, and 13 under 12
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    (tree,) = target.run([target.call(slot, 5, torch.tensor([10, 11, 12, 13]), torch.tensor([5, 6, 6, 7]), mask)])
    (chain,) = target.run([target.call(slot, 5, torch.tensor([10, 12, 13]), torch.tensor([5, 6, 7]), torch.ones(3, 3, dtype=torch.bool).tril())])
    assert torch.equal(tree.logits[[0, 2, 3]], chain.logits)
    assert not torch.equal(tree.logits[1], tree.logits[2])
    target.pool.release(slot)


def test_the_drafters_candidates_are_the_laws_whether_its_step_drew_them_or_not():
    """A step of some device time draws its rows' candidates inside its hold (one of no time leaves them to be drawn
    when asked for); asked for any states, the drafter answers with the law's."""
    profile = profile_from_dict({"target": {"fixed_ms": 0.01}, "draft": {"fixed_ms": 0.01}})
    engine = Engine.emulated(profile, tree={"width": 4, "depth": 4, "budget": 12})
    drafter = engine.draft.drafter
    engine.generate([3, 1, 4, 1, 5], max_new_tokens=8)
    drawn = drafter._drawn[0]  # the last step's rows
    assert len(drawn) > 0
    for states in (drawn[:5], np.concatenate([drawn[:5], [12345, 777]])):
        for k in (1, 4, 40):
            tokens, probs = drafter.top_candidates(torch.from_numpy(states)[:, None].float(), k)
            expected = draft_candidates(states, drafter.law, k)
            assert np.array_equal(tokens.numpy(), expected[0]) and np.array_equal(probs.numpy(), expected[1])


@pytest.mark.parametrize("stop", [0.0, 0.02])
def test_a_forest_grows_each_tree_as_it_would_grow_alone(stop):
    """Drafting ahead grows its trees as one forest, a level of all of them per drafter call: each is the tree `_grow`
    grows alone from the same seed (records, values, selection, flattened rows) with the same node states, on the
    timed drafter, whose state hashes exactly the rows a row sees; a tree told to stop is None, the others unchanged."""
    policy = TreePolicy(4, 4, 12, stop)
    engine = Engine.emulated(load_profile("null"), tree=policy)
    request = engine.new_request(prompts(1, 24, seed=5)[0], max_new_tokens=32)
    target, draft = engine.sessions(request)
    start(request, draft, target)
    verified = run_alone(draft._draft_fresh(request.root_token, policy))
    tree, nodes, prefix = verified.proposal.draft_tree, verified.proposal.row_nodes, verified.proposal.tree.prefix_len
    states, path_rows = verified.states, verified.path_rows
    leaves = [n for n in nodes if n not in states]  # as drafting ahead runs them: every verified node gets a row
    states.update(zip(leaves, run_alone(draft._expand(tree, leaves, states, path_rows, prefix)).states))
    chosen = [(nodes[i], 7 + i) for i in (0, 1, 3, len(nodes) - 1)]  # (node, bonus) outcomes, shallow and deep
    base = draft.written
    roots = run_alone(draft._run_rows(
        [path_rows[n] for n, _ in chosen], [b for _, b in chosen], [prefix + tree.depths[n] for n, _ in chosen],
        torch.stack([states[n] for n, _ in chosen]), policy.width,
    ))
    calls = [0]

    def stop_second():
        calls[0] += 1
        return calls[0] >= 2  # the second tree, before its second drafter step

    seeds = [
        Seed(b, roots.states[i], path_rows[n] + [base + i],
             prefix + tree.depths[n] + 1, (roots.tokens[i : i + 1], roots.probs[i : i + 1]),
             stop_second if i == 1 else (lambda: False))
        for i, (n, b) in enumerate(chosen)
    ]
    forest = run_alone(draft._grow_forest(seeds, policy))
    assert forest[1] is None
    for seed, grown in zip(seeds, forest):
        if grown is None:
            continue
        alone = run_alone(draft._grow(seed.token, seed.state, seed.base_rows, seed.prefix_len, policy, seed.candidates))
        a, b = grown.proposal, alone.proposal
        for field in ("tokens", "parents", "depths", "confidences", "log_values"):
            assert getattr(a.draft_tree, field) == getattr(b.draft_tree, field), field
        assert a.row_nodes == b.row_nodes and a.nodes_expanded == b.nodes_expanded and a.draft_kv_bytes == b.draft_kv_bytes
        for field in ("tokens", "parents", "positions", "mask", "retrieve", "draft_probs"):
            assert torch.equal(getattr(a.tree, field), getattr(b.tree, field)), field
        assert grown.states.keys() == alone.states.keys()
        assert all(torch.equal(grown.states[n], alone.states[n]) for n in alone.states)
        assert {n: len(r) for n, r in grown.path_rows.items()} == {n: len(r) for n, r in alone.path_rows.items()}
    target.close(), draft.close()


def test_a_rows_hash_is_its_last_tokens_by_position_among_those_it_sees_whatever_its_batch():
    """The timed models' context hash against its definition, row by row: entries of different lengths and windows in
    one batch, tree rows written far past their positions (as drafting ahead writes them), pad rows beside them."""
    context, rng = Law().context, np.random.default_rng(1)
    pool = KVPool(1, 1, 1, 3, 160, torch.float32, torch.device("cpu"), "test KV")
    prefix = {0: 40, 1: 7, 2: 23}  # committed rows per slot, written in one prefill each
    written = {}  # slot -> [(token, position)] by KV row
    for slot, n in prefix.items():
        tokens = torch.from_numpy(rng.integers(0, 1024, n))
        call = RowsCall(slot, 0, tokens, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
        packed = pack([call], pool)
        row_hashes(packed.tokens, packed.positions, packed.kv, packed.mask, context)
        written[slot] = [(int(t), i) for i, t in enumerate(tokens)]
    calls = []
    for slot, first, n in ((0, 100, 9), (1, 7, 3), (2, 60, 14)):  # rows at `first`, positions right after the prefix
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(n - 1)]  # a forest of paths over the new rows
        depths = [0] * n
        for i, p in enumerate(parents):
            depths[i] = 0 if p < 0 else depths[p] + 1
        visible = torch.zeros(n, first + n, dtype=torch.bool)
        visible[:, : prefix[slot]] = True
        for i in range(n):
            j = i
            while j >= 0:
                visible[i, first + j], j = True, parents[j]
        tokens = torch.from_numpy(rng.integers(0, 1024, n))
        positions = torch.tensor([prefix[slot] + d for d in depths])
        calls.append(RowsCall(slot, first, tokens, positions, visible))
        rows = written[slot] + [(0, 0)] * (first - len(written[slot])) + list(zip(tokens.tolist(), positions.tolist()))
        written[slot] = rows
    packed = pack(calls, pool)
    got = packed.rows(torch.from_numpy(row_hashes(packed.tokens, packed.positions, packed.kv, packed.mask, context))).tolist()
    want = []
    for call in calls:
        for i in range(call.tokens.shape[0]):
            position = int(call.positions[i])
            seen = [written[call.slot][k] for k in np.flatnonzero(call.visible[i].numpy())]
            terms = [(t + 1) * int(powers(context)[position - p]) for t, p in seen if 0 <= position - p < context]
            want.append(int(scramble(np.int64(sum(terms) % MODULUS))))
    assert got == want


def test_the_laws_outputs_are_pinned():
    """The default law's exact outputs, so that a change to them (which the rate tests above might not see) shows:
    every benchmark figure on timed models assumes them. Integer and IEEE-exact outputs by digest; the drafter's
    probabilities (a softmax, computed once per law) to a tolerance."""
    law = Law()
    h = np.arange(0, 1 << 24, 4099, dtype=np.int64)  # [4093] hashes over the law's range
    rng = np.random.default_rng(0)
    tokens, keys = rng.integers(0, law.vocab, (3, 9)), np.tile(np.arange(9), (3, 1))  # [3, 9]
    seen, rows = rng.random((3, 5, 9)) < 0.7, np.tile(np.arange(4, 9), (3, 1))  # [3, 5, 9], [3, 5]
    hashes = context_hashes(tokens, keys, np.nonzero(seen), rows, law.context)
    candidates, probs = draft_candidates(h, law, 8)
    digest = hashlib.sha256()
    for array in (hashes, target_logits(h, law), candidates):
        digest.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
    assert hashes[0].tolist() == [15258660, 9074565, 13024930, 16395871, 7091231]
    assert digest.hexdigest() == "bced3108797f081beb72bfd126443b535f556f464ef838de15a0a0e3e6b3591b"
    assert np.unique(probs[:, 0]) == pytest.approx([0.50341469, 0.86466472])  # unsure, confident
    engine = Engine.emulated("null", tree={"width": 8, "depth": 6, "budget": 48})
    out = engine.generate(list(range(1, 9)), max_new_tokens=64, stop_at_eos=False)
    assert out.token_ids[:12] == [692, 694, 572, 71, 517, 439, 420, 811, 93, 777, 90, 126]
    assert out.stats.rounds == 12
