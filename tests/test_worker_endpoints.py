"""Every worker gRPC endpoint validates on receipt: the right status code, the field named, no state changed.

Real Ray actors serving real gRPC on 127.0.0.1 with a tiny model. A draft worker's Round calls are driven with the
coordinator's own `RemoteRequest`; a target worker's Verify calls (which a draft worker sends) are driven here as a
draft worker would, with trees built here, and checked against the in-process target verifying the same trees. Bad
messages are fired at a known state, then each request finishes: its output must equal the in-process engine's,
token for token. Workers take calls only with their service's credential (KEY here), even on loopback.
"""

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
import torch
from tests.helpers.servicekit import TREE, build_models

from eyas import Engine, wire
from eyas.actors.config import PoolConfig
from eyas.actors.draft_worker import DraftWorker
from eyas.actors.proxy import CallTiming, RemoteCall, RemoteRequest, WorkerClient
from eyas.actors.routing import PoolError
from eyas.actors.streams import BatchStream, StreamEnded, status_code
from eyas.actors.target_worker import TargetWorker
from eyas.actors.worker import WorkerSpec
from eyas.cluster.pools import Pool
from eyas.errors import WireError
from eyas.publish import publish
from eyas.rounds import run_round, start
from eyas.rpc import FIELD_KEY, TOKEN_KEY, field_of
from eyas.target import TargetSession
from eyas.tree import DraftTree, TreePolicy, flatten
from eyas.v1 import round_pb2 as pb

KEY = "service-credential"
PROMPT = [5, 17, 33, 8, 9, 41]
NEW_TOKENS = 24
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def workers(ray_session, tmp_path_factory):
    target, drafter = build_models(tmp_path_factory.mktemp("endpoints"))
    spec = WorkerSpec(target=str(target), drafter=str(drafter), tree_limit=TreePolicy(**TREE), token=KEY)
    actors = [ray.remote(DraftWorker).remote(spec), ray.remote(TargetWorker).remote(spec)]
    infos = ray.get([a.start.remote() for a in actors])
    clients = [WorkerClient(i.role, f"{i.role}-0", i.address, KEY, 30.0) for i in infos]
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    yield {"engine": engine, "spec": spec, "infos": infos, "draft": clients[0], "target": clients[1]}
    for actor in actors:
        ray.kill(actor)


def remote_request(
    workers, request_id: str, draft: WorkerClient | None = None, target: WorkerClient | None = None, request=None,
    with_features: bool = False, send_ahead: bool = False,
):
    """The coordinator's proxy of one request on the module's workers (or the given ones)."""
    info = workers["infos"][1]
    request = request or workers["engine"].new_request(PROMPT, NEW_TOKENS, request_id=request_id)
    return RemoteRequest(
        draft or workers["draft"], target or workers["target"], request_id, info.manifest_id, CallTiming(), info.vocab_size,
        info.feature_width, request, with_features, send_ahead,
    )


@pytest.mark.parametrize("changes", [{"dtype": "bfloat16"}, {"draft_ahead": 2}, {"draft_dtype": "bfloat16"}])
def test_bfloat16_and_draft_ahead_workers_serve_what_the_engine_generates(workers, changes):
    spec = dataclasses.replace(workers["spec"], **changes)
    actors = [ray.remote(DraftWorker).remote(spec), ray.remote(TargetWorker).remote(spec)]
    infos = ray.get([a.start.remote() for a in actors])
    draft_client, target_client = (WorkerClient(i.role, f"{i.role}-x", i.address, KEY, 30.0) for i in infos)
    engine = Engine.from_pretrained(
        spec.target, spec.drafter, tree=TREE, dtype=changes.get("dtype"), draft_ahead=changes.get("draft_ahead", 0), draft_dtype=changes.get("draft_dtype")
    )
    request = engine.new_request(PROMPT, NEW_TOKENS, request_id="changed")
    pair = remote_request(workers, "changed", draft_client, target_client, request)
    start(request, pair, pair)
    while not request.done:
        run_round(request, pair, pair, engine.tree)
    assert request.output == engine.generate(PROMPT, max_new_tokens=NEW_TOKENS).token_ids
    for actor in actors:
        ray.kill(actor)


def test_a_floor_on_the_policy_crosses_the_wire_and_the_output_stays_exact(workers):
    """A Round's policy carries its `stop`: at a floor no drafted node reaches, every round drafts one level."""
    engine = workers["engine"]
    policy = TreePolicy(**TREE, stop=0.999)
    request = engine.new_request(PROMPT, NEW_TOKENS, request_id="floor")
    pair = remote_request(workers, "floor", request=request)
    start(request, pair, pair)
    depths = []
    while not request.done:
        depths.append(int(run_round(request, pair, pair, policy).tree.depths.max()))
    pair.release("draft")
    pair.release("target")
    assert request.output == expected_output(workers)
    assert set(depths) == {1} and TREE["depth"] > 1


class Live:
    """One request mid-generation through the coordinator's proxy: two rounds done, the word on the last one pending
    (the draft worker at the version before it; the target already committed it, so the word's copy is a retry)."""

    def __init__(self, workers, request_id: str, temperature: float = 0.0):
        self.workers, self.engine = workers, workers["engine"]
        self.manifest = workers["infos"][0].manifest_id
        self.request = self.engine.new_request(PROMPT, NEW_TOKENS, temperature=temperature, seed=7, request_id=request_id)
        self.pair = remote_request(workers, request_id, request=self.request)
        start(self.request, self.pair, self.pair)
        for _ in range(2):
            record = run_round(self.request, self.pair, self.pair, self.engine.tree)
        self.version = self.request.version
        commit = pb.Commit(ref=self.ref(record.version), accepted_rows=record.decision.accepted_rows, round_id=self.pair.round_id)
        call(workers["target"], "Commit", commit)

    def ref(self, version=None, request_id=None, manifest_id=None):
        return wire.ref(request_id or self.request.request_id, self.version if version is None else version, manifest_id or self.manifest)

    def round_msg(self, policy=None, root=None, round_id="probe", target=None, publish=True, **ref) -> pb.RoundRequest:
        """The next Round as the proxy would send it (with the pending word), changed where asked."""
        ask = pb.DraftRequest(
            ref=self.ref(**ref), root_token=self.request.root_token if root is None else root, policy=wire.policy_to_proto(policy or self.engine.tree)
        )
        target = self.workers["target"].address if target is None else target
        msg = pb.RoundRequest(draft=ask, sampling=self.pair.sampling, round_id=round_id, target=target)
        if publish:
            msg.publish.CopyFrom(self.pair._publish)
        return msg

    def finish(self) -> list[int]:
        """Run the request to its end through the proxy; its output."""
        while not self.request.done:
            run_round(self.request, self.pair, self.pair, self.engine.tree)
        self.pair.release("draft")
        self.pair.release("target")
        return self.request.output


class TargetOnly:
    """A request on the target worker alone, driven as a draft worker drives it (trees built here), beside the same
    request on the in-process target: every verification the worker serves must equal the in-process one."""

    def __init__(self, workers, request_id: str):
        self.workers, self.request_id = workers, request_id
        self.manifest = workers["infos"][1].manifest_id
        self.local = TargetSession(workers["engine"].target)
        self.local.prefill(0, PROMPT[:-1])
        call(workers["target"], "Prefill", pb.Prefill(ref=self.ref(), tokens=PROMPT[:-1]))
        self.root = PROMPT[-1]

    @property
    def version(self) -> int:
        return self.local.version

    def ref(self, version=None, request_id=None, manifest_id=None):
        return wire.ref(request_id or self.request_id, self.version if version is None else version, manifest_id or self.manifest)

    def tree(self):
        """Five rows on the committed prefix: two children of the root, a grandchild and its child."""
        tree = DraftTree(self.root)
        tree.add_children([0], [(0, 11, 0.6), (0, 12, 0.3)])
        tree.add_children([1], [(1, 13, 0.5)])
        tree.add_children([3], [(3, 14, 0.4)])
        return flatten(tree, tree.select(4), self.local.committed)

    def verify_msg(self, tree=None, round_id="probe", **ref) -> pb.VerifyRequest:
        r = self.ref(**ref)
        tree = self.tree() if tree is None else tree
        return pb.VerifyRequest(ref=r, tree=wire.tree_to_proto(tree, r), sampling=wire.sampling_to_proto(self.sampling), round_id=round_id)

    @property
    def sampling(self):
        return self.workers["engine"].new_request(PROMPT, 1).sampling

    def verify(self, round_id: str = "good") -> pb.Verification:
        """Verify `tree()` on the worker and in process, check they agree, and commit both: a round as a draft worker
        would drive it."""
        tree = self.tree()
        reply = pb.Verification.FromString(call(self.workers["target"], "Verify", self.verify_msg(tree, round_id)))
        self.check(reply, tree, round_id)
        return reply

    def check(self, reply: pb.Verification, tree, round_id: str) -> None:
        served = wire.verification_from_proto(reply, self.workers["infos"][1].feature_width)
        local = self.local.verify(tree, self.version, self.sampling)
        assert served.decision == local.decision and torch.equal(served.features, local.features)
        rows = served.decision.accepted_rows
        call(self.workers["target"], "Commit", pb.Commit(ref=self.ref(), accepted_rows=rows, round_id=round_id))
        self.local.commit(self.version, rows)
        self.root = served.decision.frontier_token


def call(client: WorkerClient, method: str, msg, key: str | None = KEY) -> bytes:
    metadata = ((TOKEN_KEY, key),) if key else ()
    return client._channel.unary_unary(f"/{client.service}/{method}")(msg.SerializeToString(), timeout=30, metadata=metadata)


def refused(client: WorkerClient, method: str, msg, key: str | None = KEY) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(client, method, msg, key)
    return err.value.code(), field_of(err.value.trailing_metadata())


def expected_output(workers, temperature=0.0):
    return workers["engine"].generate(PROMPT, max_new_tokens=NEW_TOKENS, temperature=temperature, seed=7).token_ids


def mutate(tree, **changes):
    return dataclasses.replace(tree, **{k: v.clone() for k, v in changes.items()})


def malformed_trees(tree, prefix_len):
    tokens, parents, positions, mask = (t.clone() for t in (tree.tokens, tree.parents, tree.positions, tree.mask))
    cycle = parents.clone()
    cycle[1], cycle[2] = 2, 1
    late = parents.clone()
    late[2] = tree.num_rows - 1
    not_closure = mask.clone()
    not_closure[tree.num_rows - 1, 0] = False
    shifted = positions.clone()
    shifted[1] += 1
    out_of_vocab = tokens.clone()
    out_of_vocab[1] = 10_000
    wide = DraftTree(int(tokens[0]))
    wide.add_children([0], [(0, t, 0.01) for t in range(20)])
    return {
        "cycle": (mutate(tree, parents=cycle), "tree.parents"),
        "parent after child": (mutate(tree, parents=late), "tree.parents"),
        "mask not the ancestry closure": (mutate(tree, mask=not_closure), "tree.mask"),
        "wrong positions": (mutate(tree, positions=shifted), "tree.positions"),
        "token out of vocabulary": (mutate(tree, tokens=out_of_vocab), "tree.tokens"),
        "over budget": (flatten(wide, wide.select(20), prefix_len), "tree.tokens"),
    }


def test_malformed_trees_are_refused_naming_the_field_and_change_nothing(workers):
    probe = TargetOnly(workers, "trees")
    tree = probe.tree()
    assert tree.num_rows == 5
    kv = workers["target"].health().kv_bytes
    for name, (bad, field) in malformed_trees(tree, tree.prefix_len).items():
        assert refused(workers["target"], "Verify", probe.verify_msg(bad)) == (INVALID, field), name
    assert workers["target"].health().kv_bytes == kv
    probe.verify()
    call(workers["target"], "Release", pb.Release(ref=probe.ref()))


def test_a_batch_serves_each_call_as_alone_and_a_refused_call_changes_nothing_for_the_others(workers):
    """One Batch call carries a request's Verify, another request's malformed tree, a second call for the first
    request and bytes that are no message: the first is served as if it had come alone, each other one is refused
    with its own status naming its field; both requests then verify as the in-process target does."""
    good, bad = TargetOnly(workers, "batch-good"), TargetOnly(workers, "batch-bad")
    target = workers["target"]
    tree = good.tree()
    sent = good.verify_msg(tree, "good").SerializeToString()
    malformed, field = malformed_trees(bad.tree(), bad.tree().prefix_len)["cycle"]
    batch = pb.CallBatch(method="Verify", calls=[sent, bad.verify_msg(malformed).SerializeToString(), sent, b"\xff\xff\xff"])
    results = pb.CallBatchReply.FromString(call(target, "Batch", batch)).results
    invalid = INVALID.value[0]
    assert [(r.code, r.field) for r in results] == [(0, ""), (invalid, field), (invalid, "request_id"), (invalid, "message")]
    assert len(results[0].seconds) == 5 and results[0].seconds[3] > 0  # decode, queue, batch, compute, encode
    assert [[f.rows for f in r.forwards] for r in results] == [[tree.num_rows], [], [], []]  # refused: none ran
    good.check(pb.Verification.FromString(results[0].reply), tree, "good")
    bad.verify()
    for probe in (good, bad):
        call(target, "Release", pb.Release(ref=probe.ref()))
    assert refused(target, "Batch", pb.CallBatch(method="Commit")) == (INVALID, "method")  # only a round's calls batch
    assert refused(workers["draft"], "Batch", pb.CallBatch(method="Verify")) == (INVALID, "method")
    assert pb.CallBatchReply.FromString(call(target, "Batch", pb.CallBatch(method="Verify"))).results == []
    nameless = pb.CallBatchReply.FromString(call(target, "Batch", pb.CallBatch(method="Verify", calls=[b"", b""]))).results
    assert [(r.code, r.field) for r in nameless] == [(invalid, "request_id")] * 2  # answered, neither waits for the other


def test_a_round_batch_refuses_each_bad_call_alone(workers):
    """A draft worker's Batch of Rounds: a request's Round as the proxy sends it, a Round at a stale version, a second
    call for the same request and bytes that are no message; the first is served (its tree verified by the target
    behind it), the others refused naming their fields, and the request finishes as the engine generates it."""
    live = Live(workers, "round-batch")
    steps = live.pair.propose_steps(live.version, live.request.root_token, live.engine.tree)
    round_call = next(steps).call  # the proxy's own call, as the coordinator's round driver sends it
    sent = round_call.build().SerializeToString()
    stale = live.round_msg(version=live.version - 1).SerializeToString()
    batch = pb.CallBatch(method="Round", calls=[sent, b"\xff", sent])
    results = pb.CallBatchReply.FromString(call(workers["draft"], "Batch", batch)).results
    invalid = INVALID.value[0]
    assert [(r.code, r.field) for r in results] == [(0, ""), (invalid, "message"), (invalid, "request_id")]
    with pytest.raises(StopIteration) as served:
        steps.send(round_call.parse(pb.RoundReply.FromString(results[0].reply)))
    proposal = served.value.value
    # the same word again, after the round it published: the draft worker now holds another round's verification
    assert refused(workers["draft"], "Round", pb.RoundRequest.FromString(stale)) == (PRECONDITION, "publish.round_id")
    verification = live.pair.verified(proposal.tree, live.version, live.request.sampling)
    assert verification.decision.accepted_rows[0] == 0
    publish(live.request, verification.decision, verification.features, live.pair, live.pair)
    assert live.finish() == expected_output(workers)


def test_each_round_reports_the_forwards_each_worker_ran(workers):
    """A Round comes back with the model forwards each worker ran for it (rows, batch-mates' among them, and seconds):
    what tree auto prices trees with in a service, as an engine's forwards do in process. Drafting is one forward per
    level of the tree below the root; a verification alone is one forward of its tree's rows. A request that goes on past a round
    (`draft_next`) has its next tree drafted as that round's verification comes back: the next Round drafts nothing."""
    request = workers["engine"].new_request(PROMPT, NEW_TOKENS, request_id="forwards")
    pair = remote_request(workers, "forwards", request=request)
    start(request, pair, pair)
    record = run_round(request, pair, pair, workers["engine"].tree)
    assert len(pair.draft_forwards) == workers["engine"].tree.depth - 1  # the root's candidates came with the Start
    assert all(rows > 0 and seconds > 0 for rows, seconds in pair.draft_forwards)
    [(rows, seconds)] = pair.target_forwards
    assert rows == record.tree.num_rows and seconds > 0
    record = run_round(request, pair, pair, workers["engine"].tree)
    assert pair.draft_forwards == [] and len(pair.target_forwards) == 1 and record.tree.num_rows > 1
    while not request.done:
        run_round(request, pair, pair, workers["engine"].tree)
    pair.release("draft", "target")
    assert request.output == expected_output(workers)


def verified_by_target(workers, calls: int) -> int:
    """Wait until the target worker has served more than `calls` calls; its count then."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        served = pb.WorkerHealth.FromString(call(workers["target"], "Health", pb.WorkerHealthRequest())).calls
        if served > calls:
            return served
    raise AssertionError("the target served no call")


def test_a_round_that_promises_the_next_sends_its_tree_before_that_round_comes(workers):
    """A Round that names the next round's id (`next_round_id`) has that round's tree drafted and verified without
    it: once the target has served it, the next Round drafts nothing, comes back with the verification and says how
    long the tree had been on its way. The output is the engine's."""
    request = workers["engine"].new_request(PROMPT, NEW_TOKENS, request_id="promised")
    pair = remote_request(workers, "promised", request=request, send_ahead=True)
    start(request, pair, pair)
    calls = pb.WorkerHealth.FromString(call(workers["target"], "Health", pb.WorkerHealthRequest())).calls
    run_round(request, pair, pair, workers["engine"].tree)
    assert pair.sent_ahead_s == 0.0 and pair._next_round_id
    verified_by_target(workers, calls + 1)  # the first round's Verify, then the promised one's
    record = run_round(request, pair, pair, workers["engine"].tree)
    assert pair.sent_ahead_s > 0 and pair.draft_forwards == [] and len(pair.target_forwards) == 1
    assert record.tree.num_rows > 1
    while not request.done:
        run_round(request, pair, pair, workers["engine"].tree)
    pair.release("draft", "target")
    assert request.output == expected_output(workers)


def test_a_round_other_than_the_one_promised_is_refused_and_changes_nothing(workers):
    """Once a tree went ahead for the promised Round, a Round for that version with another round id, policy,
    sampling or target, or without the word, is refused naming the field; the promised Round then serves as if none
    had come, and the request finishes as the engine generates it."""
    engine = workers["engine"]
    request = engine.new_request(PROMPT, NEW_TOKENS, request_id="promise-kept")
    pair = remote_request(workers, "promise-kept", request=request, send_ahead=True)
    start(request, pair, pair)
    run_round(request, pair, pair, engine.tree)
    ask = pb.DraftRequest(
        ref=wire.ref("promise-kept", request.version, workers["infos"][0].manifest_id), root_token=request.root_token,
        policy=wire.policy_to_proto(engine.tree),
    )
    promised = pb.RoundRequest(draft=ask, publish=pair._publish, sampling=pair.sampling, round_id=pair._next_round_id, target=pair.target.address)
    changes = {
        "round_id": {"round_id": "another"},
        "draft.policy": {"draft": pb.DraftRequest(ref=ask.ref, root_token=ask.root_token, policy=wire.policy_to_proto(TreePolicy(1, 1, 1)))},
        "sampling": {"sampling": wire.sampling_to_proto(engine.new_request(PROMPT, 1, temperature=0.5).sampling)},
        "target": {"target": "127.0.0.1:1"},
    }
    for field, change in changes.items():
        msg = pb.RoundRequest()
        msg.CopyFrom(promised)
        for name, value in change.items():
            if isinstance(value, str):
                setattr(msg, name, value)
            else:
                getattr(msg, name).CopyFrom(value)
        assert refused(workers["draft"], "Round", msg) == (PRECONDITION, field)
    unworded = pb.RoundRequest()
    unworded.CopyFrom(promised)
    unworded.ClearField("publish")
    assert refused(workers["draft"], "Round", unworded) == (PRECONDITION, "publish")
    while not request.done:
        run_round(request, pair, pair, engine.tree)
    pair.release("draft", "target")
    assert request.output == expected_output(workers)


@pytest.mark.parametrize("with_features", [False, True])
def test_a_round_relays_the_accepted_features_only_when_asked(workers, with_features):
    """The accepted rows' features reach the draft worker, which reseeds from them; the coordinator gets them back in
    the relayed verification only when it asks (a recorded request). Either way the output is the engine's, and a
    verification carrying features the round did not ask for is refused naming them."""
    width = workers["infos"][1].feature_width
    request = workers["engine"].new_request(PROMPT, NEW_TOKENS, request_id=f"features-{with_features}")
    pair = remote_request(workers, request.request_id, request=request, with_features=with_features)
    start(request, pair, pair)
    while not request.done:
        record = run_round(request, pair, pair, workers["engine"].tree)
        relayed = pb.Verification.FromString(pair.exchange[1])
        assert relayed.decision.HasField("accepted_features") == with_features
        features = wire.verification_from_proto(relayed, width, with_features).features
        assert tuple(features.shape) == (len(record.decision.accepted_rows), width if with_features else 0)
    pair.release("draft")
    pair.release("target")
    assert request.output == expected_output(workers)
    if with_features:
        with pytest.raises(WireError, match="decision.accepted_features"):
            wire.verification_from_proto(relayed, width, with_features=False)


def test_the_proxy_refuses_a_batch_result_with_forwards_that_are_not_forwards():
    """The forwards a worker reports are checked on receipt like the rest of its reply: a real gRPC server on
    loopback answering Batch with a forward of no rows, or of a time that is no duration, fails that call naming
    `results.forwards`; well-formed forwards reach the call."""
    answers = []

    def batch(raw: bytes, context) -> bytes:
        reply = pb.Verification(round_id="r").SerializeToString()
        return pb.CallBatchReply(results=[pb.CallResult(reply=reply, seconds=[0.0] * 5, forwards=answers.pop())]).SerializeToString()

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("eyas.v1.TargetWorker", {"Batch": grpc.unary_unary_rpc_method_handler(batch)})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = WorkerClient("target", "w", f"127.0.0.1:{port}", None, timeout=30)
    try:
        for forwards in ([pb.ForwardCost(rows=0, seconds=0.01)], [pb.ForwardCost(rows=3, seconds=float("nan"))],
                         [pb.ForwardCost(rows=3, seconds=-1.0)], [pb.ForwardCost(rows=3, seconds=0.01)]):
            answers.append(forwards)
            verify = RemoteCall("Verify", pb.VerifyRequest, pb.Verification, lambda reply: reply.round_id, CallTiming())
            [outcome] = client.run_each([verify])
            if forwards[0].rows and forwards[0].seconds > 0:
                assert outcome == "r" and verify.forwards == [(3, 0.01)]
            else:
                assert isinstance(outcome, WireError) and outcome.field == "results.forwards" and verify.forwards == []
    finally:
        client.close()
        server.stop(None)


def test_stale_and_future_versions_are_refused_at_every_versioned_endpoint(workers):
    live, probe = Live(workers, "versions", temperature=0.9), TargetOnly(workers, "versions-target")
    probe.verify()
    v = probe.version
    for version in (v - 1, v + 1):
        assert refused(workers["target"], "Verify", probe.verify_msg(version=version)) == (PRECONDITION, "version")
    for version in (live.version - 1, live.version + 1):
        assert refused(workers["draft"], "Round", live.round_msg(version=version)) == (PRECONDITION, "version")
    for version in (live.version - 2, live.version + 1):  # (at v - 1 the same rows would be a retry, applied already)
        commit = pb.Commit(ref=live.ref(version), accepted_rows=[0], round_id=live.pair.round_id)
        assert refused(workers["target"], "Commit", commit) == (PRECONDITION, "version")
    probe.verify()
    call(workers["target"], "Release", pb.Release(ref=probe.ref()))
    assert live.finish() == expected_output(workers, temperature=0.9)


def test_unknown_requests_and_wrong_manifests_are_refused_at_every_endpoint(workers):
    live = Live(workers, "ids")
    target, draft = workers["target"], workers["draft"]
    features = wire.tensor_to_proto(torch.zeros(1, workers["infos"][1].feature_width))
    for ref, expected in ((dict(request_id="nobody"), (grpc.StatusCode.NOT_FOUND, "request_id")), (dict(manifest_id="0" * 16), (PRECONDITION, "manifest_id"))):
        assert refused(target, "Verify", pb.VerifyRequest(ref=live.ref(**ref), round_id="r")) == expected
        assert refused(target, "Commit", pb.Commit(ref=live.ref(**ref), accepted_rows=[0])) == expected
        assert refused(target, "Release", pb.Release(ref=live.ref(**ref))) == expected
        assert refused(draft, "Round", live.round_msg(publish=False, **ref)) == expected
        assert refused(draft, "Reseed", pb.Reseed(ref=live.ref(**ref), features=features, tokens=[1])) == expected
        assert refused(draft, "Release", pb.Release(ref=live.ref(**ref))) == expected
    wrong = live.ref(request_id="fresh", manifest_id="0" * 16)
    assert refused(target, "Prefill", pb.Prefill(ref=wrong, tokens=[1, 2])) == (PRECONDITION, "manifest_id")
    assert refused(draft, "Start", pb.DraftStart(ref=wrong, features=features, tokens=[1])) == (PRECONDITION, "manifest_id")
    taken = live.ref()
    assert refused(target, "Prefill", pb.Prefill(ref=taken, tokens=[1, 2])) == (grpc.StatusCode.ALREADY_EXISTS, "request_id")
    assert refused(draft, "Start", pb.DraftStart(ref=taken, features=features, tokens=[1])) == (grpc.StatusCode.ALREADY_EXISTS, "request_id")
    assert live.finish() == expected_output(workers)


def test_bad_payloads_are_refused_naming_the_field(workers):
    live, probe = Live(workers, "payloads"), TargetOnly(workers, "payloads-target")
    target, draft = workers["target"], workers["draft"]
    fresh = live.ref(request_id="fresh", version=0)
    narrow = wire.tensor_to_proto(torch.zeros(1, 3))
    assert refused(target, "Prefill", pb.Prefill(ref=fresh, tokens=[1, 500])) == (INVALID, "tokens")
    assert refused(draft, "Start", pb.DraftStart(ref=fresh, features=narrow, tokens=[1])) == (INVALID, "features.shape")
    assert refused(draft, "Round", live.round_msg(root=500)) == (INVALID, "draft.root_token")
    assert refused(draft, "Round", live.round_msg(policy=TreePolicy(4, 4, 100))) == (INVALID, "draft.policy.budget")
    floorless = live.round_msg()
    floorless.draft.policy.stop = 1.5
    assert refused(draft, "Round", floorless) == (INVALID, "draft.policy.stop")
    no_policy = live.round_msg()
    no_policy.draft.ClearField("policy")
    assert refused(draft, "Round", no_policy) == (INVALID, "draft.policy")
    assert refused(draft, "Round", live.round_msg(round_id="")) == (INVALID, "round_id")
    assert refused(draft, "Round", live.round_msg(target="")) == (INVALID, "target")
    hot = live.round_msg()
    hot.sampling.temperature = -1.0
    assert refused(draft, "Round", hot) == (INVALID, "sampling.temperature")
    other_word = live.round_msg()
    other_word.publish.round_id = "another"
    assert refused(draft, "Round", other_word) == (PRECONDITION, "publish.round_id")
    forged = live.round_msg()
    forged.publish.tokens[-1] = (forged.publish.tokens[-1] + 1) % 96
    assert refused(draft, "Round", forged) == (INVALID, "publish.tokens")
    bad_reseed = pb.Reseed(ref=live.ref(version=live.version - 1), features=narrow, tokens=[live.request.root_token])
    assert refused(draft, "Reseed", bad_reseed) == (INVALID, "features.shape")
    assert refused(target, "Verify", pb.VerifyRequest(ref=probe.ref())) == (INVALID, "tree")
    empty_tree = probe.verify_msg()
    empty_tree.tree.tokens.Clear()
    assert refused(target, "Verify", empty_tree) == (INVALID, "tree.tokens.dtype")
    assert refused(target, "Verify", probe.verify_msg(round_id="")) == (INVALID, "round_id")
    assert refused(target, "Verify", probe.verify_msg(round_id="r" * 65)) == (INVALID, "round_id")
    assert refused(target, "Prefill", pb.Prefill(ref=fresh, tokens=[1] * 4096)) == (INVALID, "tokens")  # past the model's positions
    assert refused(draft, "Reseed", pb.Reseed(ref=live.ref(), tokens=[1] * (TREE["depth"] + 2))) == (INVALID, "tokens")
    assert refused(target, "Release", pb.Release(ref=live.ref(request_id="x" * 129))) == (INVALID, "request_id")
    raw = target._channel.unary_unary(f"/{target.service}/Verify")
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff", timeout=30, metadata=((TOKEN_KEY, KEY),))
    assert err.value.code() == INVALID
    probe.verify()
    call(target, "Release", pb.Release(ref=probe.ref()))
    assert live.finish() == expected_output(workers)


def test_a_round_whose_target_is_gone_fails_naming_the_target_and_changes_nothing(workers):
    """A Round names a target nobody serves: the draft worker answers UNAVAILABLE naming `target` (the coordinator
    then rebuilds on another target), and the request, on its own target, finishes as before."""
    live = Live(workers, "gone")
    assert refused(workers["draft"], "Round", live.round_msg(target="127.0.0.1:9")) == (grpc.StatusCode.UNAVAILABLE, "target")
    assert live.finish() == expected_output(workers)


def test_a_start_names_the_target_that_prefills_and_a_bad_one_leaves_no_session(workers):
    """A Start naming the request's target has it prefill, and seeds the drafter from its features (which never reach
    the coordinator); a Start whose prefill does not fit its tokens, or whose target nobody serves, is refused naming
    `prefill` / `target` and opens no session on either worker."""
    draft, target = workers["draft"], workers["target"]
    ref = wire.ref("started", 0, workers["infos"][0].manifest_id)
    tokens, prefill = PROMPT[1:], PROMPT[:-1]
    assert refused(draft, "Start", pb.DraftStart(ref=ref, tokens=tokens, target=target.address, prefill=prefill[1:])) == (INVALID, "prefill")
    gone = pb.DraftStart(ref=ref, tokens=tokens, target="127.0.0.1:9", prefill=prefill)
    assert refused(draft, "Start", gone) == (grpc.StatusCode.UNAVAILABLE, "target")
    assert (draft.health().sessions, target.health().sessions) == (0, 0)
    request = workers["engine"].new_request(PROMPT, NEW_TOKENS, request_id="started")
    pair = remote_request(workers, "started", request=request)
    start(request, pair, pair)
    while not request.done:
        run_round(request, pair, pair, workers["engine"].tree)
    pair.release("draft")
    pair.release("target")
    assert request.output == expected_output(workers)


def test_batches_on_a_stream_are_answered_by_id_and_a_bad_message_ends_only_its_stream(workers):
    """Round calls travel on one long-lived Stream per worker: two batches in flight at once get their own replies;
    a message that is no batch ends its stream with the refusal naming `message`, and the next call opens a new one."""
    target = workers["target"]
    first, second = TargetOnly(workers, "stream-1"), TargetOnly(workers, "stream-2")
    trees = first.tree(), second.tree()

    async def exchange() -> tuple:
        stream = BatchStream(target.address, target.service, ((TOKEN_KEY, KEY),))
        batches = [pb.CallBatch(method="Verify", calls=[p.verify_msg(t, "good").SerializeToString()]) for p, t in zip((first, second), trees)]
        replies = await asyncio.gather(*(stream.call(b, 30) for b in batches))
        async with grpc.aio.insecure_channel(target.address) as channel:
            bad = channel.stream_stream(f"/{target.service}/Stream")(metadata=((TOKEN_KEY, KEY),))
            await bad.write(b"\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await bad.read()
        again = await stream.call(pb.CallBatch(method="Verify"), 30)
        await stream.close()
        return replies, err.value, again

    replies, refusal, again = asyncio.run(exchange())
    assert [r.id for r in replies] == [1, 2] and [len(r.results) for r in replies] == [1, 1]
    for probe, tree, reply in zip((first, second), trees, replies):
        probe.check(pb.Verification.FromString(reply.results[0].reply), tree, "good")
        call(target, "Release", pb.Release(ref=probe.ref()))
    assert refusal.code() == INVALID and field_of(refusal.trailing_metadata()) == "message"
    assert again.id == 3 and list(again.results) == []


def test_a_stream_broken_under_a_call_reads_as_its_worker_lost_and_a_workers_own_refusal_as_itself():
    """gRPC's core may end a call on a broken connection (a worker killed mid-stream) with INTERNAL or UNKNOWN; no
    eyas handler sets those without its `eyas-field` trailer, so they read as UNAVAILABLE (the coordinator rebuilds
    the request) while a worker's own INTERNAL, and any other status, keep their code."""

    async def ended(code: grpc.StatusCode, trailer: tuple) -> StreamEnded:
        async def handle(requests, context):
            async for _ in requests:
                await context.abort(code, "Internal error from Core", trailing_metadata=trailer)

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Worker", {"Stream": grpc.stream_stream_rpc_method_handler(handle)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stream = BatchStream(f"127.0.0.1:{port}", "probe.Worker", ())
        try:
            with pytest.raises(StreamEnded) as err:
                await stream.call(pb.CallBatch(method="Verify"), 30)
        finally:
            await stream.close()
            await server.stop(None)
        return err.value

    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        assert asyncio.run(ended(code, ())).code == grpc.StatusCode.UNAVAILABLE
        own = asyncio.run(ended(code, ((FIELD_KEY, "tree.tokens"),)))
        assert (own.code, own.field) == (code, "tree.tokens")
    assert asyncio.run(ended(grpc.StatusCode.UNAUTHENTICATED, ())).code == grpc.StatusCode.UNAUTHENTICATED
    bare = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "Internal error from Core")
    assert status_code(bare) == grpc.StatusCode.UNAVAILABLE


def test_released_requests_leave_no_session_and_no_kv(workers):
    for client in (workers["draft"], workers["target"]):
        health = client.health()
        assert (health.sessions, health.kv_bytes) == (0, 0)
        assert "request_ids" not in {f.name for f in health.DESCRIPTOR.fields}  # health names no request


def test_workers_take_calls_only_with_their_service_credential_even_on_loopback(workers):
    with pytest.raises(ray.exceptions.RayTaskError, match="token: a worker needs its service's credential"):
        ray.get(ray.remote(TargetWorker).remote(dataclasses.replace(workers["spec"], token=None)).start.remote())
    live = Live(workers, "outsider")
    target, draft = workers["target"], workers["draft"]
    kv = target.health().kv_bytes
    for key in (None, "guess"):
        for client, method, msg in (
            (target, "Health", pb.WorkerHealthRequest()),
            (target, "Verify", pb.VerifyRequest(ref=live.ref(), round_id="r")),
            (target, "Release", pb.Release(ref=live.ref())),
            (draft, "Release", pb.Release(ref=live.ref())),
            (draft, "Round", live.round_msg()),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(client, method, msg, key)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "outsider" not in err.value.details()
    assert target.health().kv_bytes == kv
    assert live.finish() == expected_output(workers)


def test_a_worker_advertises_the_loopback_address_it_binds(workers):
    assert all(info.address.startswith("127.0.0.1:") for info in workers["infos"])
    for host, prefix in (("127.0.0.2", "127.0.0.2:"), ("::1", "[::1]:")):
        actor = ray.remote(TargetWorker).remote(dataclasses.replace(workers["spec"], host=host))
        info = ray.get(actor.start.remote())
        assert info.address.startswith(prefix)
        assert WorkerClient("target", "t", info.address, KEY, 30.0).health().role == "target"
        ray.kill(actor)


def test_a_commit_names_its_round_and_a_verify_never_replaces_another_rounds_tree(workers):
    probe = TargetOnly(workers, "rounds")
    target = workers["target"]
    tree = probe.tree()
    reply = pb.Verification.FromString(call(target, "Verify", probe.verify_msg(tree, "mine")))  # provisional under its round
    rows = reply.decision.accepted_rows
    kv = target.health().kv_bytes
    assert refused(target, "Verify", probe.verify_msg(round_id="intruder")) == (PRECONDITION, "round_id")
    assert refused(target, "Commit", pb.Commit(ref=probe.ref(), accepted_rows=rows, round_id="intruder")) == (PRECONDITION, "round_id")
    assert refused(target, "Commit", pb.Commit(ref=probe.ref(), accepted_rows=rows)) == (PRECONDITION, "round_id")
    assert target.health().kv_bytes == kv
    probe.check(reply, tree, "mine")
    probe.verify()
    call(target, "Release", pb.Release(ref=probe.ref()))


def test_a_pool_that_cannot_be_placed_fails_naming_pool_and_resources(workers):
    pool = Pool("target", TargetWorker, PoolConfig(resources={"gpu-node": 1}), workers["spec"], ready_timeout=2.0, rpc_timeout=5.0)
    with pytest.raises(PoolError, match=r"pools.target: no node of the cluster has 1 CPU, 1 gpu-node"):
        pool.start()
    assert pool.members() == []


def test_a_verify_carrying_a_commit_with_a_bad_tree_applies_neither(workers):
    """A Commit rides on the next Verify; if that Verify is refused, the carried commit is not applied either."""
    probe = TargetOnly(workers, "carried")
    target = workers["target"]
    tree = probe.tree()
    reply = pb.Verification.FromString(call(target, "Verify", probe.verify_msg(tree, "first")))  # branch rows provisional
    served = wire.verification_from_proto(reply, workers["infos"][1].feature_width)
    carried = pb.Commit(ref=probe.ref(), accepted_rows=served.decision.accepted_rows, round_id="first")
    local = probe.local.verify(tree, probe.version, probe.sampling)
    probe.local.commit(probe.version, local.decision.accepted_rows)  # in process, as the carried commit will do there
    probe.root = local.decision.frontier_token
    kv_before = target.health().kv_bytes
    for bad, field in malformed_trees(probe.tree(), probe.local.committed).values():
        msg = probe.verify_msg(bad, "second")
        msg.commit.CopyFrom(carried)
        assert refused(target, "Verify", msg) == (INVALID, field)
        assert target.health().kv_bytes == kv_before  # the branch rows are all still there: no commit happened
    msg = probe.verify_msg(probe.tree(), "second")
    msg.commit.CopyFrom(carried)
    probe.check(pb.Verification.FromString(call(target, "Verify", msg)), probe.tree(), "second")
    call(target, "Release", pb.Release(ref=probe.ref()))


def test_a_verify_with_options_verifies_the_one_built_on_the_decided_outcome_and_else_changes_nothing(workers):
    """Trees offered while the verification they build on runs (`options`): the target verifies the one whose commit
    and assumed outcome name what it decided, as it would that tree sent alone with its commit. Options none of which
    does are refused (ABORTED, `options`) and change nothing; so is a Verify with a tree of its own beside options."""
    probe = TargetOnly(workers, "options")
    target = workers["target"]
    tree = probe.tree()
    reply = pb.Verification.FromString(call(target, "Verify", probe.verify_msg(tree, "first")))  # provisional under "first"
    decided = wire.verification_from_proto(reply, workers["infos"][1].feature_width).decision
    first = probe.ref()
    local = probe.local.verify(tree, probe.version, probe.sampling)
    probe.local.commit(probe.version, local.decision.accepted_rows)  # in process, as the chosen option's commit will do
    probe.root = local.decision.frontier_token
    following = probe.tree()

    def option(accepted, frontier, rows) -> pb.VerifyOption:
        msg = wire.tree_to_proto(following, probe.ref())
        msg.assumed.CopyFrom(pb.AssumedOutcome(accepted_tokens=accepted, frontier_token=frontier))
        return pb.VerifyOption(tree=msg, commit=pb.Commit(ref=first, accepted_rows=rows, round_id="first"))

    right = option(decided.accepted_tokens, decided.frontier_token, decided.accepted_rows)
    other_bonus = option(decided.accepted_tokens, decided.frontier_token + 1, decided.accepted_rows)
    other_path = option((11,), decided.frontier_token, (0, 1)) if decided.accepted_rows == (0,) else option((), decided.frontier_token, (0,))
    sampling = wire.sampling_to_proto(probe.sampling)
    offered = lambda *options, **fields: pb.VerifyRequest(ref=probe.ref(), sampling=sampling, round_id="second", options=options, **fields)
    before = target.health()
    assert refused(target, "Verify", offered(other_bonus, other_path)) == (grpc.StatusCode.ABORTED, "options")
    assert refused(target, "Verify", offered(right, tree=wire.tree_to_proto(following, probe.ref()))) == (INVALID, "options")
    after = target.health()
    assert (after.kv_bytes, after.options_taken) == (before.kv_bytes, before.options_taken)  # "first" is still provisional
    assert after.options_offered == before.options_offered + 2
    probe.check(pb.Verification.FromString(call(target, "Verify", offered(other_bonus, right))), following, "second")
    assert (target.health().options_offered, target.health().options_taken) == (before.options_offered + 3, before.options_taken + 1)
    call(target, "Release", pb.Release(ref=probe.ref()))


def test_a_round_whose_tree_went_ahead_charges_only_the_target_work_inside_its_wait():
    """The target's phases behind a Round whose tree went ahead began before the Round was sent: their first
    `sent_ahead_s` seconds (decode, then queue, batch, compute, encode) leave the Round's split, which then still
    sums to the Round's wait, none of it negative."""
    timing = CallTiming()
    timing.charge({"decode": 0.0, "queue": 0.0, "batch": 0.0, "compute": 0.0, "encode": 0.0}, 0.0, 0.010)
    timing.charge_target({"decode": 0.001, "queue": 0.002, "batch": 0.0, "compute": 0.016, "encode": 0.001}, before=0.012)
    split = timing.as_dict()
    assert split["compute"] == pytest.approx(0.007) and split["queue"] == 0.0
    assert split["serialize"] == pytest.approx(0.001) and split["rpc"] == pytest.approx(0.002)
    assert sum(split.values()) == pytest.approx(0.010) and min(split.values()) >= 0.0
