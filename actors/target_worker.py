"""The target worker: target weights and target KV per request, provisional branch KV until commit.

Serves Prefill (commit the KV of the committed tokens, return their features), Verify (apply a
carried Commit, then verify a tree: the acceptance decision plus the accepted rows' features; of
trees offered as `options`, the one that builds on the outcome decided) and Commit. Each Verify
names its round (`round_id`); a Commit must name the round whose provisional tree it commits, and
a Verify never replaces a provisional tree of another round. Sessions are
`eyas.target.TargetSession`s. A tree is checked once, on receipt,
with `validate_tree` (structure, the service's verify budget, the committed prefix); a tree arriving
with a commit is checked against the state after that commit before the commit is applied, so a
refused message changes nothing.

With `tensor_parallel: N > 1` the worker is rank 0 of a group: it opens the group's rendezvous, loads
its shard and leads; `TargetRank` actors (ranks 1..N-1) load theirs and follow (docs/groups.md).
"""

from __future__ import annotations

import asyncio
import datetime
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import ray
import torch
from transformers.utils import logging as hf_logging

from eyas import wire
from eyas.autotree import measure_verify
from eyas.emulation import EmulatedDevice, TimedTarget, emulated_manifest, load_profile
from eyas.request import eos_token_ids
from eyas.errors import VersionError, renamed
from eyas.pairing import plan_drafter, target_num_layers
from eyas.pairing import DrafterPlan
from eyas.runtime.device import freeze_startup_objects, prepare, resolve_dtype, stored_dtype
from eyas.runtime.shard import Shard, join_group, open_rendezvous
from eyas.steps import Steps
from eyas.target import TargetModel, TargetSession
from eyas.tree import TreeError, validate_tree
from eyas.v1 import round_pb2 as pb

from .errors import ServiceError
from .limits import MAX_ROUND_ID_BYTES
from .server import Clock
from .worker import Worker, WorkerSpec, WorkerStartError, assigned_device

PRECONDITION, ABORTED = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED
GROUP_TIMEOUT = datetime.timedelta(seconds=120)  # joining a group, and any one collective of a forward


@dataclass(frozen=True)
class RankInfo:
    """One rank of a target worker (rank 0 alone when it is not a group): where it runs and what it holds."""

    rank: int
    node_id: str
    pid: int
    device: str
    weight_bytes: int  # this rank's shard of the weights
    kv_pool_bytes: int  # this rank's KV pool (its share of every session's KV), reserved at start


def load_target(spec: WorkerSpec, device: torch.device, shard: Shard) -> tuple[TargetModel, DrafterPlan]:
    """This rank's shard of the target (the whole target for one rank) and the drafter plan it serves."""
    plan = plan_drafter(spec.drafter, target_num_layers(spec.target), spec.feature_layers)
    dtype = resolve_dtype(spec.dtype, device, stored_dtype(spec.target))
    model = TargetModel.from_pretrained(spec.target, plan.address, dtype=dtype, device=device, kv_slots=spec.kv_slots, shard=shard)
    return model, plan


def rank_info(model: TargetModel, device: torch.device) -> RankInfo:
    return RankInfo(
        rank=model.runtime.shard.rank,
        node_id=ray.get_runtime_context().get_node_id(),
        pid=os.getpid(),
        device=str(device),
        weight_bytes=sum(t.numel() * t.element_size() for t in model.runtime.tensors()),
        kv_pool_bytes=model.pool.reserved_bytes,
    )


class TargetRank:
    """Ray actor: rank r > 0 of a target group. It serves nothing itself: it runs rank 0's steps on its shard."""

    def __init__(self, spec: WorkerSpec, rank: int):
        self.spec = spec
        self.rank = rank
        self.device = assigned_device()
        self.model: TargetModel | None = None
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"eyas-rank{rank}")

    async def start(self, host: str, port: int) -> RankInfo:
        """Join the group at rank 0's rendezvous and load this rank's shard."""
        torch.set_num_threads(self.spec.threads)
        prepare(self.device)
        hf_logging.disable_progress_bar()

        def load() -> RankInfo:
            shard = join_group(host, port, self.rank, self.spec.tensor_parallel, self.device, GROUP_TIMEOUT)
            self.model, _ = load_target(self.spec, self.device, shard)
            freeze_startup_objects()
            return rank_info(self.model, self.device)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._compute, load)
        except Exception as exc:
            raise WorkerStartError(f"rank {self.rank}: {type(exc).__name__}: {exc}") from None

    async def follow(self) -> None:
        """Run rank 0's steps; returns when rank 0 stops the group, raises when the group breaks."""
        await asyncio.get_running_loop().run_in_executor(self._compute, self.model.follow)


class TargetWorker(Worker):
    """Ray actor: one target model, a TargetSession per request, served over gRPC (service eyas.v1.TargetWorker)."""

    role = "target"
    service = "TargetWorker"
    batched = ("Verify",)
    follower = TargetRank

    def __init__(self, spec):
        super().__init__(spec)
        self.provisional_round: dict[str, str] = {}  # request id -> round_id of its provisional tree
        self.committed_round: dict[str, str] = {}  # request id -> round_id of its last commit (for retries)
        # request id -> its provisional tree's round_id, version, accepted rows, and accepted tokens then frontier token
        self.decided: dict[str, tuple[str, int, tuple[int, ...], tuple[int, ...]]] = {}
        self.options_offered = self.options_taken = 0

    def forget(self, request_id: str) -> None:
        self.provisional_round.pop(request_id, None)
        self.committed_round.pop(request_id, None)
        self.decided.pop(request_id, None)

    def check_round(self, request_id: str, session: TargetSession, commit: tuple, round_id: str, field: str) -> bool:
        """A commit must name the round of the tree it commits; True when it is a retry already applied."""
        applied = session.last_commit == commit and session.version == commit[0] + 1
        if not applied and commit[0] != session.version:
            raise VersionError("target cache", session.version, commit[0])
        expected = (self.committed_round if applied else self.provisional_round).get(request_id)
        if not round_id or round_id != expected:
            raise ServiceError(PRECONDITION, field, "names no round whose tree this worker holds for the request")
        return applied

    def apply_commit(self, request_id: str, session: TargetSession, commit: tuple) -> None:
        session.commit(*commit)
        self.committed_round[request_id] = self.provisional_round.pop(request_id)
        self.decided.pop(request_id, None)

    def chosen(self, msg: pb.VerifyRequest) -> pb.VerifyOption:
        """Of a Verify's options, the one whose commit and assumed outcome name what this worker decided for the
        request's provisional tree; refused (ABORTED) when none does."""
        if msg.HasField("tree") or msg.HasField("commit"):
            raise wire.WireError("options", "a Verify with options carries no tree or commit of its own")
        decided = self.decided.get(msg.ref.request_id)
        for option in msg.options:
            commit, assumed = option.commit, option.tree.assumed
            if decided == (commit.round_id, commit.ref.version, tuple(commit.accepted_rows), (*assumed.accepted_tokens, assumed.frontier_token)):
                return option
        raise ServiceError(ABORTED, "options", "none builds on the outcome this worker decided for the request's provisional tree")

    def open_group(self, host: str | None) -> tuple[str, int]:
        """Rank 0 of a group: open the store the other ranks join at, on `host` (this node's address when None)."""
        host = host or ray.util.get_node_ip_address()
        self._store = open_rendezvous(host)
        return host, self._store.port

    def load(self) -> None:
        spec = self.spec
        if spec.emulate:
            profile = load_profile(spec.emulate)
            self.model = TimedTarget(profile, EmulatedDevice(), kv_slots=spec.kv_slots)
            self.manifest = emulated_manifest(profile)
        else:
            shard = Shard()
            if spec.tensor_parallel > 1:
                shard = join_group("", 0, 0, spec.tensor_parallel, self.device, GROUP_TIMEOUT, self._store)
            self.model, plan = load_target(spec, self.device, shard)
            self.manifest = plan.manifest(self.model.fingerprint, spec.allow_manifest_mismatch)
        self.vocab_size = self.model.vocab_size
        self.feature_width = self.model.feature_width
        self.max_positions = self.model.max_seq_len

    def rank_info(self) -> RankInfo:
        """What rank 0 holds (the whole worker when it is not a group)."""
        return rank_info(self.model, self.device)

    def info_extra(self) -> dict:
        return {"eos_token_ids": tuple(sorted(eos_token_ids(self.model.generation_config, self.model.tokenizer)))}

    def health_extra(self) -> dict:
        return {"options_offered": self.options_offered, "options_taken": self.options_taken}

    def endpoints(self) -> dict:
        return {"Prefill": (pb.Prefill, self.prefill), "Verify": (pb.VerifyRequest, self.verify), "Commit": (pb.Commit, self.commit)}

    def measure(self) -> tuple[list[int], list[float]]:
        return measure_verify(self.model)

    def session_kv_bytes(self, session: TargetSession) -> int:
        return session.kv_bytes()

    def prefill(self, msg: pb.Prefill, clock: Clock) -> Steps[pb.PrefillReply]:
        """Open a session holding the KV of `tokens` (every committed token but the append-required root)."""
        self.new_session(msg.ref)
        tokens = self.check_tokens(msg.tokens, "tokens")
        clock.lap("decode")
        session = TargetSession(self.model)
        try:
            features = yield from session.prefill_steps(msg.ref.version, tokens)
        except BaseException:
            session.close()
            raise
        self.sessions[msg.ref.request_id] = session
        clock.lap("compute")
        reply = pb.PrefillReply(ref=msg.ref, features=wire.tensor_fields(features))
        clock.lap("encode")
        return reply

    def verify(self, msg: pb.VerifyRequest, clock: Clock) -> Steps[pb.Verification]:
        """Apply the carried commit (if any), then verify the tree that builds on msg.ref.version; of `options`, the one
        that builds on the outcome this worker decided (a refusal of the chosen one's fields names `options.`)."""
        session = self.session(msg.ref)
        request_id = msg.ref.request_id
        if msg.options:
            self.options_offered += 1
            option, field = self.chosen(msg), "options."
            tree_msg, commit_msg = option.tree, option.commit
        elif not msg.HasField("tree"):
            raise wire.WireError("tree", "is missing")
        else:
            tree_msg, commit_msg, field = msg.tree, msg.commit if msg.HasField("commit") else None, ""
        if tree_msg.ref != msg.ref:
            raise wire.WireError(f"{field}tree.ref", "the tree names another request, version or manifest than the call")
        tree = wire.tree_from_proto(tree_msg)
        params = wire.sampling_from_proto(msg.sampling)
        limit = self.spec.tree_limit.budget
        if not msg.round_id or len(msg.round_id.encode()) > MAX_ROUND_ID_BYTES:
            raise wire.WireError("round_id", f"must be 1 to {MAX_ROUND_ID_BYTES} bytes")
        commit = None
        version, prefix = session.version, session.committed
        pending = self.provisional_round.get(request_id)
        if commit_msg is not None:
            self.same_request(msg.ref, commit_msg.ref, f"{field}commit.ref")
            commit = (commit_msg.ref.version, tuple(commit_msg.accepted_rows))
            if self.check_round(request_id, session, commit, commit_msg.round_id, f"{field}commit.round_id"):
                commit = None  # a retried commit, already applied
            else:
                pending = None  # the carried commit consumes the provisional tree
                # Check the tree against the state after the commit before applying it: a refusal changes nothing.
                version, prefix = commit[0] + 1, session.committed + len(commit[1])
        if pending is not None and pending != msg.round_id:
            raise ServiceError(PRECONDITION, "round_id", "another round's tree is provisional; commit or release it first")
        if msg.ref.version != version:
            raise VersionError("target cache", version, msg.ref.version)
        try:
            validate_tree(tree, vocab_size=self.vocab_size, prefix_len=prefix, budget=limit)  # the tree's one receipt check
        except TreeError as exc:
            raise renamed(exc, field + exc.field) from None
        clock.lap("decode")
        if commit is not None:
            self.apply_commit(request_id, session, commit)
        verification = yield from session.verify_steps(tree, msg.ref.version, params)
        self.options_taken += bool(field)
        decision = verification.decision
        self.provisional_round[request_id] = msg.round_id
        outcome = tuple(map(int, (*decision.accepted_tokens, decision.frontier_token)))
        self.decided[request_id] = (msg.round_id, msg.ref.version, tuple(map(int, decision.accepted_rows)), outcome)
        clock.lap("compute")
        reply = wire.verification_to_proto(verification, msg.ref)
        reply.round_id = msg.round_id
        clock.lap("encode")
        return reply

    def commit(self, msg: pb.Commit, clock: Clock) -> pb.Ack:
        """The target side of a publish, sent on its own: keep the accepted rows' KV."""
        session = self.session(msg.ref)
        commit = (msg.ref.version, tuple(msg.accepted_rows))
        applied = self.check_round(msg.ref.request_id, session, commit, msg.round_id, "round_id")
        clock.lap("decode")
        if not applied:
            self.apply_commit(msg.ref.request_id, session, commit)
        clock.lap("compute")
        return pb.Ack(ref=msg.ref)
