"""The draft worker: drafter weights (plus only the target's embedding and LM head) and draft KV per request.

Serves Start (seed a session from a prefill), Draft (the next EAGLE-2 tree, after applying a
carried Reseed) and Reseed. Sessions are `eyas.proposer.DraftSession`s: the worker adds receipt
checks in front of them so that a rejected message changes no state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import grpc
import torch

from eyas import wire
from eyas.autotree import measure_draft
from eyas.drafters import load_drafter
from eyas.emulation import EmulatedDevice, SyntheticDrafter, emulated_manifest, load_profile
from eyas.errors import VersionError
from eyas.manifest import fingerprint_target
from eyas.pairing import load_embedding_and_head, plan_drafter, target_num_layers
from eyas.runtime.device import resolve_draft_dtype, resolve_dtype, stored_dtype
from eyas.proposer import DraftModel, DraftSession
from eyas.runtime.batch import Operation
from eyas.steps import Steps
from eyas.tree import TreeError
from eyas.v1 import round_pb2 as pb

from .errors import ServiceError
from .server import Clock
from .worker import Worker


class DraftWorker(Worker):
    """Ray actor: one drafter, a DraftSession per request, served over gRPC (service eyas.v1.DraftWorker)."""

    role = "draft"
    service = "DraftWorker"
    batched = ("Draft",)

    def load(self) -> None:
        spec = self.spec
        if spec.emulate:
            profile = load_profile(spec.emulate)
            self.manifest = emulated_manifest(profile)
            self.drafter = SyntheticDrafter(profile.law, profile.draft, EmulatedDevice())
            self.vocab_size, self.feature_width, self.max_positions = profile.law.vocab, profile.feature_width, profile.max_positions
        else:
            self._load_drafter()
        self.model = DraftModel(self.drafter, spec.kv_slots, self.max_positions, spec.draft_ahead, self._draft_ahead)

    def _load_drafter(self) -> None:
        """The drafter checkpoint, bound to the target's embedding and LM head (only those of the target are read)."""
        spec = self.spec
        plan = plan_drafter(spec.drafter, target_num_layers(spec.target), spec.feature_layers)
        config = json.loads(Path(spec.target, "config.json").read_text())
        self.manifest = plan.manifest(fingerprint_target(spec.target, config), spec.allow_manifest_mismatch)
        dtype = resolve_draft_dtype(spec.draft_dtype, resolve_dtype(spec.dtype, self.device, stored_dtype(spec.target)), self.device)
        embed, lm_head = load_embedding_and_head(spec.target)
        embed, lm_head = embed.to(self.device, dtype), lm_head.to(self.device, dtype)  # bound by reference: cast here
        drafter, _ = load_drafter(spec.drafter, embed, lm_head)
        self.drafter = drafter.to(device=self.device, dtype=dtype)
        self.vocab_size = int(embed.weight.shape[0])
        self.feature_width = self.manifest.feature.width(int(embed.weight.shape[1]))
        self.max_positions = int((config.get("text_config") or config).get("max_position_embeddings", 0))

    def _draft_ahead(self, steps: Steps[None], guessing: Callable[[], bool]) -> Future:
        """A session's drafting ahead runs on the compute thread in the steps no call waits for, while it is a guess
        (`Lockstep`: it never widens a batch that requests wait on); once the request's next call has arrived, which
        waits for it (`followup`), it ends at the drafter step it waits for, without running it."""
        settled: Future = Future()

        def ended(submitted: "Future[Operation]") -> None:
            op = submitted.result()
            if op.error is not None:
                settled.set_exception(op.error)
            else:
                settled.set_result(None)

        self.scheduler.submit(steps, guessing).add_done_callback(ended)
        return settled

    def followup(self, request_id: str) -> Future | None:
        session = self.sessions.get(request_id)
        return None if session is None else session.ahead_job

    def interrupt(self, request_id: str) -> None:
        """The request's next call means its round was decided: its drafting ahead stops at the next drafter step."""
        session = self.sessions.get(request_id)
        if session is not None:
            session.interrupt_ahead()

    def endpoints(self) -> dict:
        return {"Start": (pb.DraftStart, self.start_session), "Draft": (pb.DraftRequest, self.draft), "Reseed": (pb.Reseed, self.reseed)}

    def measure(self) -> tuple[list[int], list[float]]:
        return measure_draft(self.model)

    def session_kv_bytes(self, session: DraftSession) -> int:
        pending = session.pending_features
        return session.kv_bytes() + (pending.numel() * pending.element_size() if pending is not None else 0)

    def _features(self, msg: pb.Reseed | pb.DraftStart, field: str) -> tuple[torch.Tensor, list[int]]:
        # a reseed carries the accepted tokens and the frontier token: at most the tree depth plus one
        limit = self.spec.tree_limit.depth + 1 if isinstance(msg, pb.Reseed) else None
        tokens = self.check_tokens(msg.tokens, f"{field}tokens", limit)
        if isinstance(msg, pb.Reseed) and not tokens:
            raise wire.WireError(f"{field}tokens", "a reseed carries at least the frontier token")
        return wire.features_from_proto(msg.features, f"{field}features", len(tokens), self.feature_width), tokens

    def start_session(self, msg: pb.DraftStart, clock: Clock) -> Steps[pb.Ack]:
        """Seed a new session from the target's features of the committed tokens (the drafter's prefill)."""
        self.new_session(msg.ref)
        features, tokens = self._features(msg, "")
        clock.lap("decode")
        session = DraftSession(self.model)
        try:
            yield from session.start_steps(msg.ref.version, features, tokens)
        except BaseException:
            session.close()
            raise
        self.sessions[msg.ref.request_id] = session
        clock.lap("compute")
        return pb.Ack(ref=msg.ref)

    def draft(self, msg: pb.DraftRequest, clock: Clock) -> Steps[pb.Proposal]:
        """Apply the carried reseed (if any), then propose the tree that builds on msg.ref.version."""
        session = self.session(msg.ref)
        if msg.HasField("assumed"):
            raise ServiceError(grpc.StatusCode.UNIMPLEMENTED, "assumed", "this worker does not draft ahead yet")
        if not msg.HasField("policy"):
            raise wire.WireError("policy", "is missing")
        policy = wire.policy_from_proto(msg.policy)
        self.check_policy(policy)
        root = self.check_tokens([msg.root_token], "root_token")[0]
        expected = session.version
        reseed = None
        if msg.HasField("reseed"):
            self.same_request(msg.ref, msg.reseed.ref, "reseed.ref")
            features, tokens = self._features(msg.reseed, "reseed.")
            reseed = (msg.reseed.ref.version, features, tokens)
            expected = msg.reseed.ref.version + 1
            if tokens[-1:] != [root]:
                raise TreeError("root_token", f"{root} is not the last reseeded token {tokens[-1:]}")
        if msg.ref.version != expected:
            raise VersionError("draft cache", expected, msg.ref.version)
        clock.lap("decode")
        if reseed is not None:
            session.reseed(*reseed)
        proposal = yield from session.propose_steps(msg.ref.version, root, policy)
        clock.lap("compute")
        reply = wire.proposal_to_proto(proposal, msg.ref, msg.with_records)
        clock.lap("encode")
        return reply

    def reseed(self, msg: pb.Reseed, clock: Clock) -> pb.Ack:
        """The draft side of a publish, sent on its own."""
        session = self.session(msg.ref)
        features, tokens = self._features(msg, "")
        clock.lap("decode")
        session.reseed(msg.ref.version, features, tokens)
        clock.lap("compute")
        return pb.Ack(ref=msg.ref)
