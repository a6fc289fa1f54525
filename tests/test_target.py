"""The target on eyas's runtime against Hugging Face: logits and features for prefill, tree rows on a committed
prefix and after several commits, on all five families; KV commit; MoE experts; batches of sessions.

Tolerance: float32 throughout, logits and features within 1e-5 absolute of Hugging Face's.
"""

import pytest
import torch
from tests.helpers.tiny import make_target, random_tree
from transformers import AutoModelForCausalLM

from eyas.manifest import FeatureAddress
from eyas.runtime import KVCapacityError
from eyas.runtime.device import prepare
from eyas.runtime.kv import captured_attention
from eyas.runtime.linear import bucketed_rows
from eyas.sampling import SamplingParams
from eyas.target import TargetModel, TargetSession
from eyas.tree import DraftTree, flatten

PROMPT = [5, 17, 33, 8, 9, 41]
ATOL = 1e-5
FAMILIES = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "qwen2": {},
    "qwen3": {},
    "mistral-window": {"sliding_window": 4},
    "mixtral": {},
}


def build(tmp_path, family, kind="eagle3"):
    model_type = family.split("-")[0]
    directory = make_target(tmp_path / family, model_type, **FAMILIES[family])
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    address = FeatureAddress.eagle1() if kind == "eagle1" else FeatureAddress.eagle3(4)
    return hf, TargetModel.from_pretrained(directory, address)


def reference(hf, tokens, kind="eagle3"):
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), output_hidden_states=True)
    if kind == "eagle1":
        features = ref.hidden_states[-1][0]  # after the final norm
    else:
        features = torch.cat([ref.hidden_states[i][0] for i in (2, 2, 1)], dim=-1)  # inputs of layers 2, N//2, N-3
    return ref.logits[0], features


def verify_rows(target, session, flat):
    return target.run([target.call(session.slot, session.committed, flat.tokens, flat.positions, flat.mask)])[0]


def check_tree(hf, target, session, committed_tokens, flat, kind="eagle3"):
    out = verify_rows(target, session, flat)
    for row in range(flat.num_rows):
        logits, features = reference(hf, committed_tokens + flat.tokens[flat.path_to(row)].tolist(), kind)
        assert torch.allclose(out.logits[row], logits[-1], atol=ATOL)
        assert torch.allclose(out.features[row], features[-1], atol=ATOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_tree_rows_and_commits_equal_hugging_face(tmp_path, family):
    hf, target = build(tmp_path, family)
    session = TargetSession(target)
    features = session.prefill(0, PROMPT[:-1])
    assert torch.allclose(features, reference(hf, PROMPT[:-1])[1], atol=ATOL)
    committed = list(PROMPT[:-1])
    root = PROMPT[-1]
    for version in range(3):  # tree rows on the committed prefix, then after each of several commits
        flat = random_tree(root, len(committed), seed=version)
        check_tree(hf, target, session, committed, flat)
        session.verify(flat, version, SamplingParams())
        path = flat.path_to(flat.num_rows - 1 - version)
        session.commit(version, tuple(path))
        committed += flat.tokens[path].tolist()
        root = (root * 7 + 3) % 90
    session.close()


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_eagle1_address_taps_the_final_norm_output(tmp_path, family):
    hf, target = build(tmp_path, family, kind="eagle1")
    session = TargetSession(target)
    session.prefill(0, PROMPT[:-1])
    check_tree(hf, target, session, PROMPT[:-1], random_tree(PROMPT[-1], len(PROMPT) - 1), kind="eagle1")


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_every_activation_the_runtime_computes_equals_hugging_face(tmp_path, act):
    directory = make_target(tmp_path / act, hidden_act=act)
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    target = TargetModel.from_pretrained(directory, FeatureAddress.eagle3(4))
    session = TargetSession(target)
    session.prefill(0, PROMPT[:-1])
    check_tree(hf, target, session, PROMPT[:-1], random_tree(PROMPT[-1], len(PROMPT) - 1))


def test_an_activation_the_runtime_does_not_compute_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="hidden_act 'tanh' is not one of"):
        TargetModel.from_pretrained(make_target(tmp_path / "t", hidden_act="tanh"))


def test_commit_keeps_exactly_the_accepted_rows_kv(tmp_path):
    target = TargetModel.from_pretrained(make_target(tmp_path / "t"))
    session = TargetSession(target)
    session.prefill(0, PROMPT[:-1])
    flat = random_tree(PROMPT[-1], len(PROMPT) - 1)
    session.verify(flat, 0, SamplingParams())
    path = flat.path_to(flat.num_rows - 1)
    session.commit(0, tuple(path))
    reference_session = TargetSession(target)
    reference_session.prefill(0, PROMPT[:-1] + flat.tokens[path].tolist())
    n = session.committed
    assert n == reference_session.committed
    mine = target.pool.kv[:, :, session.slot, :, :n]
    theirs = target.pool.kv[:, :, reference_session.slot, :, :n]
    assert torch.allclose(mine, theirs, atol=ATOL)


def test_a_batch_of_sessions_equals_each_session_alone(tmp_path):
    hf, target = build(tmp_path, "qwen2")
    prompts = [PROMPT[:-1], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [44]]
    sessions = [TargetSession(target) for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        session.prefill(0, prompt)
    trees = [random_tree(7 + i, len(p), seed=i) for i, p in enumerate(prompts)]
    alone = [verify_rows(target, s, t) for s, t in zip(sessions, trees)]
    calls = [target.call(s.slot, s.committed, t.tokens, t.positions, t.mask) for s, t in zip(sessions, trees)]
    batched = target.run(calls[::-1])[::-1]  # slots out of order: the batch gathers them
    for one, many, prompt, tree in zip(alone, batched, prompts, trees):
        assert torch.allclose(one.logits, many.logits, atol=ATOL) and torch.allclose(one.features, many.features, atol=ATOL)
        assert torch.equal(one.logits.argmax(-1), many.logits.argmax(-1))
        logits, _ = reference(hf, prompt + [int(tree.tokens[0])])
        assert torch.allclose(many.logits[0], logits[-1], atol=ATOL)


def test_rows_padded_to_a_bucket_change_no_real_row(tmp_path):
    """A forward padded to a row bucket (pad rows write no KV and see one key) gives every real row exactly what the
    unpadded forward gives it, and leaves the KV as the unpadded one does."""
    _, target = build(tmp_path, "llama")
    session = TargetSession(target)
    session.prefill(0, PROMPT[:-1])
    chain = DraftTree(7)
    for token in range(1, 13):  # 13 rows: a forward pads them to the bucket of 14
        chain.add_children([len(chain) - 1], [(len(chain) - 1, token, 0.5)])
    tree = flatten(chain, chain.select(12), session.committed)
    assert bucketed_rows(1, tree.num_rows) > tree.num_rows
    call = target.call(session.slot, session.committed, tree.tokens, tree.positions, tree.mask)
    outs, kvs = [], []
    for bucketed in (False, True):
        target.bucketed = bucketed
        outs.append(target.run([call])[0])
        kvs.append(target.pool.kv[:, :, session.slot].clone())
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].features, outs[1].features)
    assert torch.equal(kvs[0], kvs[1])


def test_moe_verification_reports_the_union_of_routed_experts(tmp_path):
    directory = make_target(tmp_path / "t", "mixtral")
    target = TargetModel.from_pretrained(directory)
    hf = AutoModelForCausalLM.from_pretrained(directory)
    session = TargetSession(target)
    session.prefill(0, PROMPT[:-1])
    chain = [PROMPT[-1], 11, 12, 13]
    tree = DraftTree(chain[0])
    node = 0
    for token in chain[1:]:
        (node,) = tree.add_children([node], [(node, token, 0.5)])
    flat = flatten(tree, tree.select(3), len(PROMPT) - 1)
    verification = session.verify(flat, 0, SamplingParams())
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT[:-1] + chain]), output_router_logits=True)
    expected = set()
    for layer, logits in enumerate(out.router_logits):
        chosen = torch.topk(logits.reshape(-1, 4)[-len(chain) :], 2, dim=-1).indices
        expected |= {(layer, e) for e in chosen.flatten().tolist()}
    assert verification.experts == expected
    assert 0 < len(expected) <= 4 * 4


def test_sliding_window_enters_the_mask(tmp_path):
    target = TargetModel.from_pretrained(make_target(tmp_path / "t", "mistral", sliding_window=4))
    mask = target.visible(torch.ones(2, 2, dtype=torch.bool).tril(), torch.tensor([6, 7]), prefix_len=6)
    assert mask.int().tolist() == [[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]]


def test_feature_layers_outside_the_target_are_refused(tmp_path):
    directory = make_target(tmp_path / "t")
    with pytest.raises(ValueError, match="layer 9"):
        TargetModel.from_pretrained(directory, FeatureAddress("layer_inputs", (1, 9)))


def test_the_pool_refuses_what_does_not_fit_and_returns_every_slot(tmp_path):
    target = TargetModel.from_pretrained(make_target(tmp_path / "t"), kv_slots=2, max_seq_len=16)
    first, second = TargetSession(target), TargetSession(target)
    with pytest.raises(KVCapacityError, match="all 2 slots"):
        TargetSession(target)
    with pytest.raises(KVCapacityError, match="slot_len"):
        first.prefill(0, list(range(1, 80)) * 4)  # 316 positions in slots of 16 + tree headroom
    assert first.committed == 0 and target.pool.free_slots == 0
    first.close()
    second.close()
    assert target.pool.free_slots == 2


def test_fixed_shape_batches_a_cuda_graph_replays_equal_the_eager_batches(tmp_path):
    """The batches a CUDA graph replays (padded to a bucket of entries, rows and keys; index tensors for where rows
    go and which slots they read), run eagerly here: every real row's logits and features, and the KV of every slot,
    as the eager batch gives them, over several rounds of verification and commits."""
    hf, eager = build(tmp_path, "qwen3")
    fixed = TargetModel.from_pretrained(eager.path, FeatureAddress.eagle3(4), graphs=True)
    prompts = [PROMPT[:-1], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [44]]
    runs = {}
    for name, target in (("eager", eager), ("fixed", fixed)):
        sessions = [TargetSession(target) for _ in prompts]
        outs = []
        for session, prompt in zip(sessions, prompts):
            session.prefill(0, prompt)
        for version in range(3):
            trees = [random_tree(7 + i + version, s.committed, seed=i + 3 * version) for i, s in enumerate(sessions)]
            calls = [target.call(s.slot, s.committed, t.tokens, t.positions, t.mask) for s, t in zip(sessions, trees)]
            outs += target.run(calls[::-1])[::-1]  # slots out of order
            for session, tree in zip(sessions, trees):
                session.verify(tree, version, SamplingParams())
                session.commit(version, tuple(tree.path_to(tree.num_rows - 1)))
        committed = [s.committed for s in sessions]
        runs[name] = outs, [target.pool.kv[:, :, s.slot, :, :n].clone() for s, n in zip(sessions, committed)]
    assert fixed.graphs.captured and eager.graphs is None
    for one, other in zip(runs["eager"][0], runs["fixed"][0]):
        assert torch.allclose(one.logits, other.logits, atol=ATOL) and torch.allclose(one.features, other.features, atol=ATOL)
    for one, other in zip(runs["eager"][1], runs["fixed"][1]):
        assert torch.allclose(one, other, atol=ATOL)
    out = runs["fixed"][0][0]
    assert torch.allclose(out.logits[0], reference(hf, prompts[0] + [7])[0][-1], atol=ATOL)


def test_graphs_are_refused_for_a_target_whose_forward_is_not_captured(tmp_path):
    with pytest.raises(ValueError, match="graphs"):
        TargetModel.from_pretrained(make_target(tmp_path / "t", "mixtral"), graphs=True)


def test_captures_turn_cudnn_attention_on_and_leave_it_off_after():
    """A graph pays cuDNN's plan once, at capture, so captures may use its kernel (docs/runtime.md, "Attention on
    CUDA"); eager forwards after a capture still run without it, as `prepare` left them, in torch's order."""
    order, before = torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled()
    try:
        prepare(torch.device("cuda"))
        with captured_attention():
            assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert torch._C._get_sdp_priority_order() == order
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
