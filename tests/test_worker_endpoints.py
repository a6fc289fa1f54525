"""Every worker gRPC endpoint validates on receipt: the right status code, the field named, no state changed.

Real Ray actors serving real gRPC on 127.0.0.1 with a tiny model. Each test drives one request
with the coordinator's own proxies, fires bad messages at a known state, then finishes the
request: its output must equal the in-process engine's, token for token. Workers take calls only
with their service's credential (KEY here), even on loopback.
"""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
import torch
from tests.helpers.servicekit import TREE, build_models

from eyas import Engine, wire
from eyas.actors.config import PoolConfig
from eyas.actors.draft_worker import DraftWorker
from eyas.actors.proxy import CallTiming, RemoteCall, RemoteDraft, RemoteTarget, WorkerClient
from eyas.actors.target_worker import TargetWorker
from eyas.actors.worker import WorkerSpec
from eyas.actors.routing import PoolError
from eyas.cluster.pools import Pool
from eyas.errors import WireError
from eyas.publish import publish
from eyas.rounds import run_round, start
from eyas.rpc import TOKEN_KEY, field_of
from eyas.tree import DraftTree, TreePolicy, flatten
from eyas.v1 import round_pb2 as pb

KEY = "service-credential"
PROMPT = [5, 17, 33, 8, 9, 41]
NEW_TOKENS = 24
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    ray.init(num_cpus=4, include_dashboard=False)
    target, drafter = build_models(tmp_path_factory.mktemp("endpoints"))
    spec = WorkerSpec(target=str(target), drafter=str(drafter), tree_limit=TreePolicy(**TREE), token=KEY)
    actors = [ray.remote(DraftWorker).remote(spec), ray.remote(TargetWorker).remote(spec)]
    infos = ray.get([a.start.remote() for a in actors])
    clients = [WorkerClient(i.role, f"{i.role}-0", i.address, KEY, 30.0) for i in infos]
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    yield {"engine": engine, "spec": spec, "infos": infos, "draft": clients[0], "target": clients[1]}
    ray.shutdown()


@pytest.mark.parametrize("changes", [{"dtype": "bfloat16"}, {"draft_ahead": 2}, {"draft_dtype": "bfloat16"}])
def test_bfloat16_and_draft_ahead_workers_serve_what_the_engine_generates(workers, changes):
    spec = dataclasses.replace(workers["spec"], **changes)
    actors = [ray.remote(DraftWorker).remote(spec), ray.remote(TargetWorker).remote(spec)]
    infos = ray.get([a.start.remote() for a in actors])
    draft_client, target_client = (WorkerClient(i.role, f"{i.role}-x", i.address, KEY, 30.0) for i in infos)
    target, drafter = spec.target, spec.drafter
    engine = Engine.from_pretrained(
        target, drafter, tree=TREE, dtype=changes.get("dtype"), draft_ahead=changes.get("draft_ahead", 0), draft_dtype=changes.get("draft_dtype")
    )
    request = engine.new_request(PROMPT, NEW_TOKENS)
    timing = CallTiming()
    draft = RemoteDraft(draft_client, "r-x", infos[0].manifest_id, timing, infos[1].vocab_size)
    verifier = RemoteTarget(target_client, "r-x", infos[0].manifest_id, timing, infos[1].vocab_size, infos[1].feature_width)
    start(request, draft, verifier)
    while not request.done:
        run_round(request, draft, verifier, engine.tree)
    assert request.output == engine.generate(PROMPT, max_new_tokens=NEW_TOKENS).token_ids
    for actor in actors:
        ray.kill(actor)


def test_a_floor_on_the_policy_crosses_the_wire_and_the_output_stays_exact(workers):
    """A Draft call's policy carries its `stop`: at a floor no drafted node reaches, every round drafts one level."""
    engine, (draft_info, target_info) = workers["engine"], workers["infos"]
    policy = TreePolicy(**TREE, stop=0.999)
    request = engine.new_request(PROMPT, NEW_TOKENS, request_id="floor")
    timing = CallTiming()
    draft = RemoteDraft(workers["draft"], "floor", draft_info.manifest_id, timing, target_info.vocab_size)
    verifier = RemoteTarget(workers["target"], "floor", draft_info.manifest_id, timing, target_info.vocab_size, target_info.feature_width)
    start(request, draft, verifier)
    depths = []
    while not request.done:
        depths.append(int(run_round(request, draft, verifier, policy).tree.depths.max()))
    draft.release()
    verifier.release()
    assert request.output == expected_output(workers)
    assert set(depths) == {1} and TREE["depth"] > 1


class Live:
    """One request mid-generation: both workers at `version`, a proposed tree waiting for verification."""

    def __init__(self, workers, request_id: str, temperature: float = 0.0):
        self.engine = workers["engine"]
        self.manifest = workers["infos"][0].manifest_id
        self.request = self.engine.new_request(PROMPT, NEW_TOKENS, temperature=temperature, seed=7, request_id=request_id)
        info = workers["infos"][1]
        timing = CallTiming()
        self.draft = RemoteDraft(workers["draft"], request_id, self.manifest, timing, info.vocab_size)
        self.target = RemoteTarget(workers["target"], request_id, self.manifest, timing, info.vocab_size, info.feature_width)
        start(self.request, self.draft, self.target)
        for _ in range(2):
            record = run_round(self.request, self.draft, self.target, self.engine.tree)
        self.version = self.request.version
        self.proposal = self.draft.propose(self.version, self.request.root_token, self.engine.tree)  # carries the reseed
        # The target's commit of the last round, sent on its own; the proxy's carried copy is then a harmless retry.
        commit = pb.Commit(ref=self.ref(record.version), accepted_rows=record.decision.accepted_rows, round_id=self.target.round_id)
        call(workers["target"], "Commit", commit)
        self.features = torch.zeros(1, info.feature_width)

    def ref(self, version=None, request_id=None, manifest_id=None):
        return wire.ref(request_id or self.request.request_id, self.version if version is None else version, manifest_id or self.manifest)

    def verify_msg(self, tree=None, round_id="probe", **ref):
        r = self.ref(**ref)
        tree = self.proposal.tree if tree is None else tree
        sampling = wire.sampling_to_proto(self.request.sampling)
        return pb.VerifyRequest(ref=r, tree=wire.tree_to_proto(tree, r), sampling=sampling, round_id=round_id)

    def draft_msg(self, policy=None, root=None, **ref):
        policy = wire.policy_to_proto(policy or self.engine.tree)
        return pb.DraftRequest(ref=self.ref(**ref), root_token=self.request.root_token if root is None else root, policy=policy)

    def reseed_msg(self, **ref):
        return pb.Reseed(ref=self.ref(**ref), features=wire.tensor_to_proto(self.features), tokens=[self.request.root_token])

    def finish(self, verification=None) -> list[int]:
        """Complete the pending round through the proxies (with its `verification` when that was already served),
        then run to the end."""
        if verification is None:
            verification = self.target.verify(self.proposal.tree, self.version, self.request.sampling)
        publish(self.request, verification.decision, verification.features, self.target, self.draft)
        while not self.request.done:
            run_round(self.request, self.draft, self.target, self.engine.tree)
        self.draft.release()
        self.target.release()
        return self.request.output


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
        "cycle": (mutate(tree, parents=cycle), "parents"),
        "parent after child": (mutate(tree, parents=late), "parents"),
        "mask not the ancestry closure": (mutate(tree, mask=not_closure), "mask"),
        "wrong positions": (mutate(tree, positions=shifted), "positions"),
        "token out of vocabulary": (mutate(tree, tokens=out_of_vocab), "tokens"),
        "over budget": (flatten(wide, wide.select(20), prefix_len), "tokens"),
    }


def test_malformed_trees_are_refused_naming_the_field_and_change_nothing(workers):
    live = Live(workers, "trees")
    assert live.proposal.tree.num_rows >= 4
    for name, (tree, field) in malformed_trees(live.proposal.tree, live.proposal.tree.prefix_len).items():
        assert refused(workers["target"], "Verify", live.verify_msg(tree)) == (INVALID, field), name
    assert live.finish() == expected_output(workers)


def test_a_batch_serves_each_call_as_alone_and_a_refused_call_changes_nothing_for_the_others(workers):
    """One Batch call carries a request's Verify, another request's malformed tree, a second call for the first
    request and bytes that are no message: the first is served as if it had come alone, each other one is refused
    with its own status naming its field, and both requests then finish as the engine generates them."""
    good, bad = Live(workers, "batch-good"), Live(workers, "batch-bad")
    target = workers["target"]
    steps = good.target.verify_steps(good.proposal.tree, good.version, good.request.sampling)
    verify = next(steps).call  # the proxy's own call, as the coordinator's round driver sends it
    sent = verify.build().SerializeToString()
    tree, field = malformed_trees(bad.proposal.tree, bad.proposal.tree.prefix_len)["cycle"]
    batch = pb.CallBatch(method="Verify", calls=[sent, bad.verify_msg(tree).SerializeToString(), sent, b"\xff\xff\xff"])
    results = pb.CallBatchReply.FromString(call(target, "Batch", batch)).results
    invalid = INVALID.value[0]
    assert [(r.code, r.field) for r in results] == [(0, ""), (invalid, field), (invalid, "request_id"), (invalid, "message")]
    assert len(results[0].seconds) == 5 and results[0].seconds[3] > 0  # decode, queue, batch, compute, encode
    assert [[f.rows for f in r.forwards] for r in results] == [[good.proposal.tree.num_rows], [], [], []]  # refused: none ran
    with pytest.raises(StopIteration) as served:
        steps.send(verify.parse(pb.Verification.FromString(results[0].reply)))
    assert good.finish(served.value.value) == expected_output(workers)
    assert bad.finish() == expected_output(workers)
    assert refused(target, "Batch", pb.CallBatch(method="Commit")) == (INVALID, "method")  # only a round's calls batch
    assert refused(workers["draft"], "Batch", pb.CallBatch(method="Verify")) == (INVALID, "method")
    assert pb.CallBatchReply.FromString(call(target, "Batch", pb.CallBatch(method="Verify"))).results == []
    nameless = pb.CallBatchReply.FromString(call(target, "Batch", pb.CallBatch(method="Verify", calls=[b"", b""]))).results
    assert [(r.code, r.field) for r in nameless] == [(invalid, "request_id")] * 2  # answered, neither waits for the other


def test_each_round_call_reports_the_forwards_it_ran(workers):
    """A Draft and a Verify call come back with the model forwards the worker ran for them (rows, batch-mates' among
    them, and seconds): what tree auto prices trees with in a service, as an engine's forwards do in process. A
    verification alone is one forward of its tree's rows; drafting is one forward per level of the tree."""
    live = Live(workers, "forwards")
    depth = live.engine.tree.depth
    assert len(live.draft.forwards) == depth and all(rows > 0 and seconds > 0 for rows, seconds in live.draft.forwards)
    verification = live.target.verify(live.proposal.tree, live.version, live.request.sampling)
    [(rows, seconds)] = live.target.forwards
    assert rows == live.proposal.tree.num_rows and seconds > 0
    assert live.finish(verification) == expected_output(workers)


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
    live = Live(workers, "versions", temperature=0.9)
    v = live.version
    for version in (v - 1, v + 1):
        assert refused(workers["target"], "Verify", live.verify_msg(version=version)) == (PRECONDITION, "version")
        assert refused(workers["draft"], "Draft", live.draft_msg(version=version)) == (PRECONDITION, "version")
    for version in (v - 2, v + 1):
        commit = pb.Commit(ref=live.ref(version), accepted_rows=[0], round_id=live.target.round_id)
        assert refused(workers["target"], "Commit", commit) == (PRECONDITION, "version")
        assert refused(workers["draft"], "Reseed", live.reseed_msg(version=version)) == (PRECONDITION, "version")
    assert live.finish() == expected_output(workers, temperature=0.9)


def test_unknown_requests_and_wrong_manifests_are_refused_at_every_endpoint(workers):
    live = Live(workers, "ids")
    target, draft = workers["target"], workers["draft"]
    features = wire.tensor_to_proto(live.features)
    for ref, expected in ((dict(request_id="nobody"), (grpc.StatusCode.NOT_FOUND, "request_id")), (dict(manifest_id="0" * 16), (PRECONDITION, "manifest_id"))):
        assert refused(target, "Verify", live.verify_msg(**ref)) == expected
        assert refused(target, "Commit", pb.Commit(ref=live.ref(**ref), accepted_rows=[0])) == expected
        assert refused(target, "Release", pb.Release(ref=live.ref(**ref))) == expected
        assert refused(draft, "Draft", live.draft_msg(**ref)) == expected
        assert refused(draft, "Reseed", live.reseed_msg(**ref)) == expected
        assert refused(draft, "Release", pb.Release(ref=live.ref(**ref))) == expected
    wrong = live.ref(request_id="fresh", manifest_id="0" * 16)
    assert refused(target, "Prefill", pb.Prefill(ref=wrong, tokens=[1, 2])) == (PRECONDITION, "manifest_id")
    assert refused(draft, "Start", pb.DraftStart(ref=wrong, features=features, tokens=[1])) == (PRECONDITION, "manifest_id")
    taken = live.ref()
    assert refused(target, "Prefill", pb.Prefill(ref=taken, tokens=[1, 2])) == (grpc.StatusCode.ALREADY_EXISTS, "request_id")
    assert refused(draft, "Start", pb.DraftStart(ref=taken, features=features, tokens=[1])) == (grpc.StatusCode.ALREADY_EXISTS, "request_id")
    assert live.finish() == expected_output(workers)


def test_bad_payloads_are_refused_naming_the_field(workers):
    live = Live(workers, "payloads")
    target, draft = workers["target"], workers["draft"]
    fresh = live.ref(request_id="fresh", version=0)
    narrow = wire.tensor_to_proto(torch.zeros(1, 3))
    assert refused(target, "Prefill", pb.Prefill(ref=fresh, tokens=[1, 500])) == (INVALID, "tokens")
    assert refused(draft, "Start", pb.DraftStart(ref=fresh, features=narrow, tokens=[1])) == (INVALID, "features.shape")
    assert refused(draft, "Draft", live.draft_msg(root=500)) == (INVALID, "root_token")
    assert refused(draft, "Draft", live.draft_msg(policy=TreePolicy(4, 4, 100))) == (INVALID, "budget")
    floorless = live.draft_msg()
    floorless.policy.stop = 1.5
    assert refused(draft, "Draft", floorless) == (INVALID, "stop")
    bad_reseed = live.reseed_msg(version=live.version - 1)
    bad_reseed.features.CopyFrom(narrow)
    assert refused(draft, "Reseed", bad_reseed) == (INVALID, "features.shape")
    assert refused(target, "Verify", pb.VerifyRequest(ref=live.ref())) == (INVALID, "tree")
    empty_tree = live.verify_msg()
    empty_tree.tree.tokens.Clear()
    assert refused(target, "Verify", empty_tree) == (INVALID, "tree.tokens.dtype")
    assert refused(draft, "Draft", pb.DraftRequest(ref=live.ref(), root_token=live.request.root_token)) == (INVALID, "policy")
    assert refused(target, "Verify", live.verify_msg(round_id="")) == (INVALID, "round_id")
    assert refused(target, "Verify", live.verify_msg(round_id="r" * 65)) == (INVALID, "round_id")
    assert refused(target, "Prefill", pb.Prefill(ref=fresh, tokens=[1] * 4096)) == (INVALID, "tokens")  # past the model's positions
    assert refused(draft, "Reseed", pb.Reseed(ref=live.ref(), tokens=[1] * (TREE["depth"] + 2))) == (INVALID, "tokens")
    assert refused(target, "Release", pb.Release(ref=live.ref(request_id="x" * 129))) == (INVALID, "request_id")
    raw = workers["target"]._channel.unary_unary(f"/{target.service}/Verify")
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff", timeout=30, metadata=((TOKEN_KEY, KEY),))
    assert err.value.code() == INVALID
    assert live.finish() == expected_output(workers)


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
            (target, "Verify", live.verify_msg()),
            (target, "Release", pb.Release(ref=live.ref())),
            (draft, "Release", pb.Release(ref=live.ref())),
            (draft, "Draft", live.draft_msg()),
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
    live = Live(workers, "rounds")
    target, request = workers["target"], live.request
    verification = live.target.verify(live.proposal.tree, live.version, request.sampling)  # provisional under its round
    rows = verification.decision.accepted_rows
    kv = target.health().kv_bytes
    assert refused(target, "Verify", live.verify_msg(round_id="intruder")) == (PRECONDITION, "round_id")
    assert refused(target, "Commit", pb.Commit(ref=live.ref(), accepted_rows=rows, round_id="intruder")) == (PRECONDITION, "round_id")
    assert refused(target, "Commit", pb.Commit(ref=live.ref(), accepted_rows=rows)) == (PRECONDITION, "round_id")
    assert target.health().kv_bytes == kv
    publish(request, verification.decision, verification.features, live.target, live.draft)
    while not request.done:
        run_round(request, live.draft, live.target, live.engine.tree)
    live.draft.release()
    live.target.release()
    assert request.output == expected_output(workers)


def test_a_pool_that_cannot_be_placed_fails_naming_pool_and_resources(workers):
    pool = Pool("target", TargetWorker, PoolConfig(resources={"gpu-node": 1}), workers["spec"], ready_timeout=2.0, rpc_timeout=5.0)
    with pytest.raises(PoolError, match=r"pools.target: no node of the cluster has 1 CPU, 1 gpu-node"):
        pool.start()
    assert pool.members() == []


def test_a_verify_carrying_a_commit_with_a_bad_tree_applies_neither(workers):
    """A Commit may ride on the next Verify; if that Verify is refused, the carried commit is not applied either."""
    live = Live(workers, "carried")
    engine, request, target = live.engine, live.request, workers["target"]
    verification = live.target.verify(live.proposal.tree, live.version, request.sampling)  # branch rows now provisional
    decision = verification.decision
    request.commit(live.version, [*decision.accepted_tokens, decision.frontier_token])  # publish without the target
    live.draft.reseed(live.version, verification.features, [*decision.accepted_tokens, decision.frontier_token])
    proposal = live.draft.propose(request.version, request.root_token, engine.tree)
    carried = pb.Commit(ref=live.ref(live.version), accepted_rows=decision.accepted_rows, round_id=live.target.round_id)
    live.version = request.version
    kv_before = target.health().kv_bytes
    for tree, field in malformed_trees(proposal.tree, proposal.tree.prefix_len).values():
        msg = live.verify_msg(tree)
        msg.commit.CopyFrom(carried)
        assert refused(target, "Verify", msg) == (INVALID, field)
        assert target.health().kv_bytes == kv_before  # the branch rows are all still there: no commit happened
    live.proposal = proposal
    msg = live.verify_msg()
    msg.commit.CopyFrom(carried)
    reply = pb.Verification.FromString(call(target, "Verify", msg))
    live.target.round_id = msg.round_id  # the tree is now provisional under this call's round, which the commit names
    verification = wire.verification_from_proto(reply, workers["infos"][1].feature_width)
    publish(request, verification.decision, verification.features, live.target, live.draft)
    while not request.done:
        run_round(request, live.draft, live.target, engine.tree)
    live.draft.release()
    live.target.release()
    assert request.output == expected_output(workers)
