"""Target adapter contract: taps at the declared address, tree rows equal their paths, KV commit, MoE experts."""

import pytest
import torch
from tiny import make_target
from transformers import AutoModelForCausalLM

from eyas.manifest import FeatureAddress
from eyas.sampling import SamplingParams
from eyas.target import TargetModel, TargetSession
from eyas.tree import DraftTree, flatten

PROMPT = [5, 17, 33, 8, 9, 41]


def random_tree(root, prefix_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tree = DraftTree(root)
    expanded = [0]
    for depth in range(3):
        if depth:
            expanded = tree.expandable(3)
        children = []
        for node in expanded:
            tokens = torch.randperm(90, generator=generator)[:3].tolist()
            children += [(node, t, 0.3) for t in tokens]
        tree.add_children(expanded, children)
    return flatten(tree, tree.select(10), prefix_len)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mixtral"])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_tree_rows_equal_a_plain_forward_of_their_paths(tmp_path, model_type, kind):
    directory = make_target(tmp_path / "t", model_type)
    hf = AutoModelForCausalLM.from_pretrained(directory)
    address = FeatureAddress.eagle1() if kind == "eagle1" else FeatureAddress.eagle3(4)
    target = TargetModel.from_pretrained(directory, address)
    session = TargetSession(target)
    session.prefill(0, PROMPT[:-1])
    flat = random_tree(PROMPT[-1], len(PROMPT) - 1)
    out = target.forward(flat.tokens, flat.positions, flat.mask, session.cache)
    for row in range(flat.num_rows):
        path = flat.tokens[flat.path_to(row)].tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPT[:-1] + path]), output_hidden_states=True)
        assert torch.allclose(out.logits[row], ref.logits[0, -1], atol=1e-5)
        if kind == "eagle1":
            expected = ref.hidden_states[-1][0, -1]  # after the final norm
        else:
            expected = torch.cat([ref.hidden_states[i][0, -1] for i in (2, 2, 1)])  # inputs of layers 2, N//2, N-3
        assert torch.allclose(out.features[row], expected, atol=1e-5)


def test_commit_keeps_exactly_the_accepted_rows_kv(tmp_path):
    directory = make_target(tmp_path / "t")
    target = TargetModel.from_pretrained(directory)
    session = TargetSession(target)
    session.prefill(0, PROMPT[:-1])
    flat = random_tree(PROMPT[-1], len(PROMPT) - 1)
    session.verify(flat, 0, SamplingParams())
    path = flat.path_to(flat.num_rows - 1)
    session.commit(0, tuple(path))
    reference = TargetSession(target)
    reference.prefill(0, PROMPT[:-1] + flat.tokens[path].tolist())
    for mine, ref in zip(session.cache.layers, reference.cache.layers):
        assert torch.allclose(mine.keys, ref.keys, atol=1e-5) and torch.allclose(mine.values, ref.values, atol=1e-5)


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
    directory = make_target(tmp_path / "t", "mistral", sliding_window=4)
    target = TargetModel.from_pretrained(directory)
    mask = target.attention_mask(torch.ones(2, 2, dtype=torch.bool).tril(), torch.tensor([6, 7]), prefix_len=6)
    assert mask[0, 0].int().tolist() == [[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]]


def test_feature_layers_outside_the_target_are_refused(tmp_path):
    directory = make_target(tmp_path / "t")
    with pytest.raises(ValueError, match="layer 9"):
        TargetModel.from_pretrained(directory, FeatureAddress("layer_inputs", (1, 9)))
