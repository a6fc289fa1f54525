"""Traces of a real service run: record, replay identical, name an altered decision, sampled rounds bit for bit.

Requests recorded while several ran at once on one target worker have replayed with probabilities one
float32 rounding apart on some machines, so those are compared within the replay tolerance (1e-6);
tokens, rows and accepted paths always exactly. A request served alone replays bit for bit. The drafters run in
float32 on both sides, so that the redraft proposes the recorded trees again: a bfloat16 drafter rounds the target's
features, and the last-bit differences between a batched and a lone target forward then reach its trees
(docs/runtime.md, "The drafter's dtype").

One Ray instance and one service (tiny models, real gRPC on 127.0.0.1) recording every request to a
trace file, as `eyas serve --trace` does; the Python client also asks for single-request traces.
"""

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from tests.helpers.servicekit import TREE, build_models, service_config

from eyas import Engine
from eyas.client.cli import main
from eyas.client.client import Client
from eyas.client.replay import replay_trace
from eyas.client.trace_diff import diff_traces
from eyas.cluster.service import Service
from eyas.trace import TraceWriter, read_trace
from eyas.trace.format import encode
from eyas.trace.invariants import check_trace
from eyas.trace.messages import decode_round
from eyas.v1 import round_pb2 as pb

RUN = [
    {"prompt": [5, 17, 33, 8], "max_new_tokens": 24, "request_id": "greedy-0"},
    {"prompt": [7, 7, 7, 7, 7, 7], "max_new_tokens": 16, "request_id": "greedy-1"},
    {"prompt": "w3 w41 w9", "max_new_tokens": 20, "request_id": "greedy-2"},
    {"prompt": [11, 12, 13], "max_new_tokens": 20, "temperature": 0.9, "seed": 5, "request_id": "sampled-0"},
]
CLIENT_TRACED = {"prompt": [9, 30, 60, 2, 44], "max_new_tokens": 20, "request_id": "client-0"}


@pytest.fixture(scope="module")
def svc(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("trace-service")
    target, drafter = build_models(root)
    config = service_config(target, drafter, models={"target": str(target), "drafter": str(drafter), "draft_dtype": "float32"})
    service = Service(config, port=0, trace=str(root / "service.trace")).start()
    client = Client(service.address)
    with ThreadPoolExecutor(len(RUN) + 1) as pool:
        results = list(pool.map(lambda kw: client.generate(**kw), RUN))
        results.append(pool.submit(client.generate, trace=root / "client.trace", **CLIENT_TRACED).result())
    shutil.copy(root / "service.trace", root / "run.trace")  # this run's records, before later tests add theirs
    yield {
        "root": root, "target": target, "drafter": drafter, "service": service, "client": client, "results": results,
        "engine": Engine.from_pretrained(target, drafter, tree=TREE, draft_dtype="float32"),
    }
    client.close()
    service.stop()


def test_a_recorded_service_run_of_several_requests_replays_identical(svc, capsys):
    trace = read_trace(svc["root"] / "run.trace")
    requests = {r.key: r for r in trace.requests}
    assert set(requests) == {kw["request_id"] for kw in [*RUN, CLIENT_TRACED]} and trace.problems == []
    for result in svc["results"]:
        request = requests[result.request_id]
        assert [t for rnd in request.rounds for t in rnd.emitted] == result.token_ids == request.end.output_ids
        assert request.start.source == "service" and len(request.rounds) == result.stats["rounds"]
    assert check_trace(trace.requests) == []
    assert main(["replay", str(svc["root"] / "run.trace"), "--target", str(svc["target"])]) == 0
    out = capsys.readouterr().out
    assert f"identical: 5 requests, {sum(len(r.rounds) for r in trace.requests)} rounds re-verified" in out
    engine = svc["engine"]
    assert replay_trace(trace, engine.target, engine.drafter).identical, "the drafter proposes the recorded trees again"


def test_a_bfloat16_drafters_lone_request_redrafts_as_recorded_and_the_report_says_when_one_may_not(svc, tmp_path):
    """A request run alone drafts from the same features when redrafted, so a bfloat16 drafter's trees come back as
    recorded; the report notes that a request recorded beside batch-mates may not."""
    half = Engine.from_pretrained(svc["target"], svc["drafter"], tree=TREE, draft_dtype="bfloat16")
    path = tmp_path / "half.trace"
    half.generate([5, 17, 33, 8], max_new_tokens=16, trace=str(path))
    report = replay_trace(read_trace(path), half.target, half.drafter)
    assert report.identical and report.rounds > 1
    assert any(note.startswith("the drafter runs in bfloat16 beside a float32 target") for note in report.notes)
    assert not any("drafter runs in" in note for note in replay_trace(read_trace(path), svc["engine"].target, svc["engine"].drafter).notes)


def test_the_client_trace_holds_the_bytes_that_crossed_the_wire(svc):
    mine = read_trace(svc["root"] / "client.trace").requests
    served = read_trace(svc["root"] / "run.trace").request("client-0")
    assert len(mine) == 1 and mine[0].start == served.start and mine[0].end == served.end
    assert [(r.tree, r.decision) for r in mine[0].rounds] == [(r.tree, r.decision) for r in served.rounds]
    first = pb.FlattenedTree.FromString(served.rounds[0].tree)
    assert (first.ref.request_id, first.ref.version) == ("client-0", 0)


def test_a_sampled_service_run_replays_bit_for_bit(svc):
    path = svc["root"] / "sampled.trace"
    options = [{"temperature": 0.8, "seed": 11}, {"temperature": 1.2, "top_p": 0.9, "top_k": 30, "seed": 12}]
    for o in options:
        served = svc["client"].generate([5, 9, 5, 9, 5], max_new_tokens=24, trace=path, **o)
        assert served.token_ids == svc["engine"].generate([5, 9, 5, 9, 5], max_new_tokens=24, speculate=False, **o).token_ids
    trace = read_trace(path)
    assert all(rnd.sampling["seed"] in (11, 12) for request in trace.requests for rnd in request.rounds)
    report = replay_trace(trace, svc["engine"].target, tolerance=0.0)
    assert report.bit_exact and report.rounds == sum(len(r.rounds) for r in trace.requests), report.lines()


def altered(trace, key, index, change):
    """The trace's records, the decision of round `index` of request `key` edited by `change(tree, decision_msg)`."""
    record = trace.request(key).rounds[index]
    tree, _, _, decision = decode_round(record)
    change(tree, decision)
    record.decision = decision.SerializeToString()
    return trace.records


def write(path, records):
    with TraceWriter(path) as writer:
        writer.write(b"".join(encode(r) for r in records))
    return path


def test_an_altered_decision_is_named_by_replay_with_its_round_and_node(svc, capsys):
    trace = read_trace(svc["root"] / "run.trace")
    request = trace.request("greedy-0")
    index = 2
    recorded = decode_round(request.rounds[index])[1]
    tree = decode_round(request.rounds[index])[0]
    child = next(c for c in tree.children(0) if c not in recorded.accepted_rows)

    def accept_child(tree, decision):
        decision.accepted_rows[:] = [0, child]
        decision.accepted_tokens[:] = [int(tree.tokens[child])]

    path = write(svc["root"] / "altered.trace", altered(trace, "greedy-0", index, accept_child))
    report = replay_trace(read_trace(path), svc["engine"].target)
    (divergence,) = report.divergences
    assert (divergence.request, divergence.round, divergence.difference.node) == ("greedy-0", index, child)
    assert divergence.difference.what == "accepted path"
    assert main(["replay", str(path), "--target", str(svc["target"])]) == 1
    assert f"request greedy-0, round {index}, node {child}: accepted path" in capsys.readouterr().out

    node = tree.num_rows - 1

    def nudge_probability(tree, decision):
        decision.token_probs[node] = min(1.0, decision.token_probs[node] + 0.01)

    path = write(svc["root"] / "nudged.trace", altered(read_trace(svc["root"] / "run.trace"), "greedy-0", index, nudge_probability))
    (divergence,) = replay_trace(read_trace(path), svc["engine"].target).divergences
    assert (divergence.round, divergence.difference.node, divergence.difference.what) == (index, node, "target probability")


def test_local_and_service_traces_of_the_same_request_agree(svc):
    local = svc["root"] / "local.trace"
    options = {k: v for k, v in CLIENT_TRACED.items() if k != "request_id"}
    svc["engine"].generate(**options, trace=local)
    service, here = read_trace(svc["root"] / "client.trace"), read_trace(local)
    assert here.requests[0].start.source == "local"
    assert diff_traces(service, here, tolerance=1e-6) is None

    def exact_fields(request):
        """Each round's messages without the request id and the float probabilities: what must match exactly."""
        out = []
        for rnd in request.rounds:
            tree, decision = pb.FlattenedTree.FromString(rnd.tree), pb.AcceptanceDecision.FromString(rnd.decision)
            tree.ref.request_id = decision.ref.request_id = ""
            tree.ClearField("draft_probs")
            decision.ClearField("token_probs")
            decision.ClearField("frontier_prob")
            out.append((tree.SerializeToString(), decision.SerializeToString()))
        return out

    assert exact_fields(here.requests[0]) == exact_fields(service.requests[0])


def test_eyas_generate_traces_through_the_service_and_in_process(svc, capsys):
    remote, local = svc["root"] / "cli-remote.trace", svc["root"] / "cli-local.trace"
    common = ["--prompt", "w5 w17 w33", "--max-new-tokens", "10", "--json"]
    assert main(["generate", "--server", svc["service"].address, "--trace", str(remote), *common]) == 0
    models = ["--target", str(svc["target"]), "--drafter", str(svc["drafter"]), "--tree-width", "4", "--depth", "4", "--budget", "12"]
    assert main(["generate", "--local", *models, "--draft-dtype", "float32", "--trace", str(local), *common]) == 0  # as the service's
    capsys.readouterr()
    assert main(["trace", "diff", str(remote), str(local)]) == 0
    assert capsys.readouterr().out.startswith("identical: 1 requests")
