"""Invariant checks without a model: each broken invariant of a recorded trace is caught and named.

A real in-process trace (tiny target, random EAGLE-1 drafter; one greedy and one sampled request) is
broken one way at a time; the checker must report exactly that invariant, at that round, and replay
must not call the trace identical.
"""

import pytest
from tests.helpers.servicekit import TREE, build_models

from eyas import Engine, wire
from eyas.client.cli import main
from eyas.client.replay import replay_trace
from eyas.trace import Trace, TraceWriter, read_trace
from eyas.trace.format import RequestStart, encode
from eyas.trace.invariants import INVARIANTS, check_trace
from eyas.trace.messages import decode_round
from eyas.v1 import round_pb2 as pb

ROUND = 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace-invariants")
    target, drafter = build_models(root)
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    path = root / "run.trace"
    engine.generate([5, 17, 33, 8, 9], max_new_tokens=12, trace=path)
    engine.generate([4, 40, 20], max_new_tokens=12, temperature=0.9, seed=7, trace=path)
    return path, engine


def edit_tree(record, change):
    msg = pb.FlattenedTree.FromString(record.tree)
    tree = wire.tree_from_proto(msg)
    change(tree, msg)
    record.tree = wire.tree_to_proto(tree, msg.ref).SerializeToString()


def edit_decision(record, change):
    tree, _, _, msg = decode_round(record)
    change(tree, msg)
    record.decision = msg.SerializeToString()


def depth_two_row(tree):
    return tree.depths.index(2)


def accept_a_grandchild(tree, msg):
    row = depth_two_row(tree)
    msg.accepted_rows[:] = [0, row]
    msg.accepted_tokens[:] = [tree.tokens[row]]


BREAKS = {
    "parents": (0, lambda r: edit_tree(r, lambda t, m: t.parents.__setitem__(-1, t.num_rows - 1))),
    "mask": (0, lambda r: edit_tree(r, lambda t, m: t.mask.__setitem__((1, 2), True))),
    "positions": (0, lambda r: edit_tree(r, lambda t, m: t.positions.__setitem__(1, t.positions[1] + 1))),
    "budget": (0, lambda r: setattr(r, "policy", {**r.policy, "budget": TREE["budget"] - 3})),
    "path": (0, lambda r: edit_decision(r, accept_a_grandchild)),
    "output": (0, lambda r: setattr(r, "emitted", [r.emitted[0] ^ 1])),
    "versions": (0, lambda r: setattr(r, "version", r.version + 7)),
    "sampling": (1, lambda r: setattr(r, "sampling", {**r.sampling, "seed": r.sampling["seed"] + 1})),
    "manifest": (0, lambda r: edit_tree(r, lambda t, m: setattr(m.ref, "manifest_id", "0" * 16))),
    "messages": (0, lambda r: setattr(r, "tree", r.tree[:10])),
}


def test_an_intact_trace_keeps_every_invariant(recorded, capsys):
    path, _ = recorded
    assert check_trace(read_trace(path).requests) == []
    assert main(["trace", "check", str(path)]) == 0
    assert "all invariants hold: 2 requests" in capsys.readouterr().out


@pytest.mark.parametrize("invariant", sorted(BREAKS))
def test_each_broken_invariant_is_caught_and_named(recorded, tmp_path, invariant):
    path, engine = recorded
    trace = read_trace(path)
    request_index, breaking = BREAKS[invariant]
    record = trace.requests[request_index].rounds[ROUND]
    breaking(record)
    violations = check_trace(trace.requests)
    assert {v.invariant for v in violations} == {invariant}, [str(v) for v in violations]
    assert (violations[0].request, violations[0].round) == (trace.requests[request_index].key, ROUND)
    assert INVARIANTS[invariant] in str(violations[0])
    broken = tmp_path / "broken.trace"
    with TraceWriter(broken) as writer:
        writer.write(b"".join(encode(r) for r in trace.records))
    assert not replay_trace(read_trace(broken), engine.target).identical


def test_rounds_without_their_request_record_are_caught(recorded, tmp_path):
    path, _ = recorded
    records = [r for r in read_trace(path).records if not (isinstance(r, RequestStart) and r.request == "req-0")]
    violations = check_trace(Trace(str(path), records, []).requests)
    assert {v.invariant for v in violations} == {"request"}
