"""The wire ABI: committed generated code matches the .proto sources, and the codec round-trips and refuses bad fields.

No Ray and no servers here: the codec must work (and be importable) without either.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.servicekit import TREE, build_models, with_unknown_field

from eyas import Engine, wire
from eyas.actors.config import ConfigError, ServiceConfig
from eyas.autotree import Replay
from eyas.proposer import DraftSession
from eyas.rounds import Verification, start
from eyas.target import TargetSession
from eyas.tree import TreePolicy
from eyas.v1 import round_pb2 as pb
from eyas.v1 import service_pb2 as spb
from eyas.v1 import tensor_pb2 as tpb
from eyas.verify import AcceptanceDecision

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_what_grpc_tools_makes_of_the_protos(tmp_path):
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *map(str, protos)],
        check=True,
    )
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    committed = {p.relative_to(ROOT): p.read_bytes() for p in (ROOT / "eyas" / "v1").iterdir() if p.name != "__init__.py" and p.is_file() and p.suffix in (".py", ".pyi")}
    assert sorted(map(str, fresh)) == sorted(map(str, committed)), "generated files differ from eyas/v1: regenerate (README)"
    for path, data in fresh.items():
        assert committed[path] == data, f"{path} is stale: regenerate it from protos/ (README, commands)"


def test_codec_imports_neither_grpc_nor_ray():
    code = "import sys, eyas.wire; bad = [m for m in ('grpc', 'ray') if m in sys.modules]; sys.exit(f'imported {bad}' if bad else 0)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([1, -2, 3], dtype=torch.int64),
        torch.tensor([[True, False], [False, True]]),
        torch.randn(3, 5),
        torch.randn(2, 4, dtype=torch.float64),
        torch.randn(4, 3).to(torch.bfloat16),
        torch.randn(4).to(torch.float16),
        torch.tensor([7], dtype=torch.int32),
        torch.empty(0, 8),
    ],
    ids=lambda t: f"{t.dtype}{list(t.shape)}",
)
def test_tensors_round_trip_bit_for_bit(tensor):
    msg = wire.tensor_to_proto(tensor)
    back = wire.tensor_from_proto(msg, "x", tuple(wire.DTYPES), tensor.dim())
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8) if back.dtype != torch.bool else back, tensor.view(torch.uint8) if tensor.dtype != torch.bool else tensor)


def test_tensor_bytes_are_little_endian():
    assert wire.tensor_to_proto(torch.tensor([1, 256], dtype=torch.int64)).data == bytes([1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize(
    "msg, field",
    [
        (tpb.Tensor(dtype="int64", shape=[3], data=b"\0" * 23), "x.data"),
        (tpb.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8), "x.dtype"),
        (tpb.Tensor(dtype="int64", shape=[1, 1], data=b"\0" * 8), "x.shape"),
        (tpb.Tensor(dtype="int64", shape=[-1], data=b""), "x.shape"),
        (tpb.Tensor(dtype="bool", shape=[2], data=b"\x01\x02"), "x.data"),
    ],
)
def test_tensor_decoding_refuses_a_bad_field_by_name(msg, field):
    with pytest.raises(wire.WireError) as err:
        wire.tensor_from_proto(msg, "x", tuple(wire.DTYPES), 1)
    assert err.value.field == field


def test_a_field_the_schema_does_not_define_is_refused_by_path_and_number():
    tree = pb.TreePolicy.FromString(with_unknown_field(pb.TreePolicy(width=2, depth=2, budget=4), 99))
    request = spb.GenerateRequest(text="w5", tree=tree)
    with pytest.raises(wire.WireError) as err:
        wire.check_known(request)
    assert err.value.field == "tree.99" and "eyas.v1.TreePolicy" in str(err.value)
    with pytest.raises(wire.WireError) as err:
        wire.check_known(spb.GenerateRequest.FromString(with_unknown_field(spb.GenerateRequest(text="w5"), 40)))
    assert err.value.field == "40"
    item = spb.JobItem(id="a", request=spb.GenerateRequest(token_ids=spb.TokenIds(ids=[5])))
    item.request.token_ids.MergeFromString(with_unknown_field(spb.TokenIds(), 7))
    with pytest.raises(wire.WireError) as err:
        wire.check_known(item)
    assert err.value.field == "request.token_ids.7"
    wire.check_known(spb.GenerateRequest(text="w5", tree=pb.TreePolicy(width=2, depth=2, budget=4)))  # all known: passes


@pytest.fixture(scope="module")
def round_parts(tmp_path_factory):
    target, drafter = build_models(tmp_path_factory.mktemp("wire"))
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    request = engine.new_request([5, 17, 33, 8, 9], temperature=0.8, seed=3)
    draft, verifier = DraftSession(engine.draft), TargetSession(engine.target)
    start(request, draft, verifier)
    proposal = draft.propose(0, request.root_token, engine.tree)
    return engine, request, proposal, verifier.verify(proposal.tree, 0, request.sampling)


def test_trees_proposals_and_verifications_round_trip(round_parts):
    engine, request, proposal, verification = round_parts
    ref = wire.ref("r1", 0, "m1")
    tree = pb.FlattenedTree.FromString(wire.proposed_tree_to_proto(proposal, ref).SerializeToString())
    back = wire.proposal_from_proto(pb.Proposal.FromString(wire.proposal_to_proto(proposal, ref).SerializeToString()), tree)
    for name in ("tokens", "parents", "depths", "positions", "mask", "retrieve", "draft_probs"):
        assert torch.equal(getattr(back.tree, name), getattr(proposal.tree, name)), name
    assert (back.tree.prefix_len, back.nodes_expanded, back.draft_kv_bytes) == (
        proposal.tree.prefix_len, proposal.nodes_expanded, proposal.draft_kv_bytes
    )
    msg = pb.Verification.FromString(wire.verification_to_proto(verification, ref).SerializeToString())
    again = wire.verification_from_proto(msg, engine.target.feature_width)
    assert again.decision == verification.decision  # a sampled round replays bit for bit
    assert torch.equal(again.features, verification.features)
    assert wire.sampling_from_proto(wire.sampling_to_proto(request.sampling)) == request.sampling
    wire.validate_decision(again.decision, proposal.tree, engine.target.vocab_size)


def test_a_decision_that_does_not_fit_its_tree_is_refused(round_parts):
    engine, _, proposal, verification = round_parts
    d = verification.decision
    cases = {
        "decision.accepted_rows": AcceptanceDecision((1,), (), d.frontier_token, d.frontier_prob),
        "decision.accepted_tokens": AcceptanceDecision((0,), (5,), d.frontier_token, d.frontier_prob),
        "decision.frontier_token": AcceptanceDecision((0,), (), 10_000, d.frontier_prob),
    }
    for field, decision in cases.items():
        with pytest.raises(wire.WireError) as err:
            wire.validate_decision(decision, proposal.tree, engine.target.vocab_size)
        assert err.value.field == field


def test_an_exploring_proposal_carries_its_records_and_a_verification_its_row_acceptance(round_parts):
    """What `tree: auto` needs across the wire: every node the expansion recorded (ids, order and values kept, so a
    replay of any smaller policy on them gives what it gives in process) and every row's acceptance."""
    engine, request, proposal, verification = round_parts
    ref = wire.ref("r1", 0, "m1")
    assert not pb.Proposal.FromString(wire.proposal_to_proto(proposal, ref).SerializeToString()).HasField("records")
    tree = wire.proposed_tree_to_proto(proposal, ref)
    back = wire.proposal_from_proto(pb.Proposal.FromString(wire.proposal_to_proto(proposal, ref, with_records=True).SerializeToString()), tree)
    sent = proposal.draft_tree
    for name in ("tokens", "parents", "depths", "confidences", "log_values"):
        assert getattr(back.draft_tree, name) == getattr(sent, name), name
    assert back.row_nodes == proposal.row_nodes
    accept = dict(zip(proposal.row_nodes, verification.row_probs.tolist()))
    for policy in (TreePolicy(1, 3, 3), TreePolicy(2, 2, 4), TreePolicy(4, 4, 12)):
        assert Replay(back.draft_tree, accept).expected(policy) == Replay(sent, accept).expected(policy)
    again = wire.verification_from_proto(
        pb.Verification.FromString(wire.verification_to_proto(verification, ref).SerializeToString()), engine.target.feature_width
    )
    assert torch.equal(again.row_probs, verification.row_probs)
    wire.validate_verification(again, proposal.tree, engine.target.vocab_size)


def test_records_and_row_acceptance_that_do_not_fit_are_refused_by_name(round_parts):
    engine, _, proposal, verification = round_parts
    ref = wire.ref("r1", 0, "m1")
    good = wire.proposal_to_proto(proposal, ref, with_records=True)
    tree, nodes = proposal.draft_tree, proposal.row_nodes
    cases = {
        "records.parents": wire.records_to_proto(tree, nodes),
        "records.confidences": wire.records_to_proto(tree, nodes),
        "records.row_nodes": wire.records_to_proto(tree, [0, *reversed(nodes[1:])]),
        "records.tokens": wire.records_to_proto(tree, nodes),
    }
    cases["records.parents"].parents.CopyFrom(wire.tensor_to_proto(torch.tensor([-1, *range(1, len(tree))])))  # node 1 its own parent
    cases["records.confidences"].confidences.CopyFrom(wire.tensor_to_proto(torch.tensor([1.0] + [1.5] * (len(tree) - 1), dtype=torch.float64)))
    cases["records.tokens"].tokens.CopyFrom(wire.tensor_to_proto(torch.tensor(tree.tokens[:-1])))
    for field, records in cases.items():
        msg = pb.Proposal.FromString(good.SerializeToString())
        msg.records.CopyFrom(records)
        with pytest.raises(wire.WireError) as err:
            wire.proposal_from_proto(msg, wire.proposed_tree_to_proto(proposal, ref))
        assert err.value.field == field
    short = Verification(verification.decision, verification.features, verification.experts, 0, verification.row_probs[:-1])
    with pytest.raises(wire.WireError) as err:
        wire.validate_verification(short, proposal.tree, engine.target.vocab_size)
    assert err.value.field == "row_acceptance"
    nan = verification.row_probs.clone()
    nan[-1] = float("nan")
    for values in (verification.row_probs + 2.0, -verification.row_probs - 1.0, nan):
        outside = pb.Verification.FromString(wire.verification_to_proto(verification, ref).SerializeToString())
        outside.row_acceptance.CopyFrom(wire.tensor_to_proto(values))
        with pytest.raises(wire.WireError) as err:
            wire.verification_from_proto(outside, engine.target.feature_width)
        assert err.value.field == "row_acceptance"


def test_local_yaml_is_the_documented_default():
    assert ServiceConfig.load(ROOT / "configs" / "local.yaml") == ServiceConfig.load(None)


@pytest.mark.parametrize(
    "data, named",
    [
        ({"pools": {"draft": {"replica": 2}}}, "pools.draft.replica"),
        ({"pools": {"target": {"replicas": 0}}}, "pools.target.replicas"),
        ({"tree": {"budget": -1}}, "tree.budget"),
        ({"tree": "fast"}, "tree"),
        ({"netwrk": {}}, "netwrk"),
        ({"models": {"dtype": "int8"}}, "models.dtype"),
        ({"models": {"draft_dtype": "half"}}, "models.draft_dtype"),
        ({"pools": {"draft": {"num_cpus": 0}}}, "pools.draft"),
        ({"service": {"kv_slots": 0}}, "service.kv_slots"),
    ],
)
def test_config_refuses_unknown_keys_and_bad_values_by_name(data, named):
    with pytest.raises(ConfigError, match=named):
        ServiceConfig.from_dict(data)
