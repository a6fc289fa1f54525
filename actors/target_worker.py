"""The target worker: target weights and target KV per request, provisional branch KV until commit.

Serves Prefill (commit the KV of the committed tokens, return their features), Verify (apply a
carried Commit, then verify a tree: the acceptance decision plus the accepted rows' features)
and Commit. Sessions are `eyas.target.TargetSession`s, which check a tree with `validate_tree`
before verifying it; a tree arriving with a commit is checked against the state after that
commit before the commit is applied, so a refused message changes nothing.
"""

from __future__ import annotations

from eyas import wire
from eyas.engine import eos_token_ids
from eyas.errors import VersionError
from eyas.pairing import plan_drafter, target_num_layers
from eyas.target import TargetModel, TargetSession
from eyas.tree import TreeError, validate_tree
from eyas.v1 import round_pb2 as pb

from .server import Clock
from .worker import DTYPES, Worker


class TargetWorker(Worker):
    """Ray actor: one target model, a TargetSession per request, served over gRPC (service eyas.v1.TargetWorker)."""

    role = "target"
    service = "TargetWorker"

    def load(self) -> None:
        spec = self.spec
        plan = plan_drafter(spec.drafter, target_num_layers(spec.target), spec.feature_layers)
        self.model = TargetModel.from_pretrained(spec.target, plan.address, dtype=DTYPES[spec.dtype])
        self.manifest = plan.manifest(self.model.fingerprint, spec.allow_manifest_mismatch)
        self.vocab_size = self.model.vocab_size
        self.feature_width = self.model.feature_width
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    def info_extra(self) -> dict:
        generation_config = getattr(self.model.model, "generation_config", None)
        return {"eos_token_ids": tuple(sorted(eos_token_ids(generation_config, self.model.tokenizer)))}

    def endpoints(self) -> dict:
        return {"Prefill": (pb.Prefill, self.prefill), "Verify": (pb.VerifyRequest, self.verify), "Commit": (pb.Commit, self.commit)}

    def session_kv_bytes(self, session: TargetSession) -> int:
        return session.kv_bytes()

    def prefill(self, msg: pb.Prefill, clock: Clock) -> pb.PrefillReply:
        """Open a session holding the KV of `tokens` (every committed token but the append-required root)."""
        self.new_session(msg.ref)
        tokens = self.check_tokens(msg.tokens, "tokens")
        clock.lap("decode")
        session = TargetSession(self.model)
        features = session.prefill(msg.ref.version, tokens)
        self.sessions[msg.ref.request_id] = session
        clock.lap("compute")
        reply = pb.PrefillReply(ref=msg.ref, features=wire.tensor_to_proto(features))
        clock.lap("encode")
        return reply

    def verify(self, msg: pb.VerifyRequest, clock: Clock) -> pb.Verification:
        """Apply the carried commit (if any), then verify the tree that builds on msg.ref.version."""
        session = self.session(msg.ref)
        if not msg.HasField("tree"):
            raise wire.WireError("tree", "is missing")
        if msg.tree.ref != msg.ref:
            raise wire.WireError("tree.ref", "the tree names another request, version or manifest than the call")
        tree = wire.tree_from_proto(msg.tree)
        params = wire.sampling_from_proto(msg.sampling)
        limit = self.spec.tree_limit.budget
        commit = None
        if msg.HasField("commit"):
            self.same_request(msg.ref, msg.commit.ref, "commit.ref")
            commit = (msg.commit.ref.version, tuple(msg.commit.accepted_rows))
            if session.last_commit != commit or session.version != commit[0] + 1:
                # Check the tree against the state after the commit before applying it: a refusal changes nothing.
                if msg.ref.version != commit[0] + 1:
                    raise VersionError("target cache", commit[0] + 1, msg.ref.version)
                prefix = session.committed + len(commit[1])
                validate_tree(tree, vocab_size=self.vocab_size, prefix_len=prefix, budget=limit)
        if tree.num_rows - 1 > limit:
            raise TreeError("tokens", f"{tree.num_rows - 1} candidate rows exceed the service's verify budget {limit}")
        clock.lap("decode")
        if commit is not None:
            session.commit(*commit)
        verification = session.verify(tree, msg.ref.version, params)  # checks version and tree before any change
        clock.lap("compute")
        reply = wire.verification_to_proto(verification, msg.ref)
        clock.lap("encode")
        return reply

    def commit(self, msg: pb.Commit, clock: Clock) -> pb.Ack:
        """The target side of a publish, sent on its own: keep the accepted rows' KV."""
        session = self.session(msg.ref)
        clock.lap("decode")
        session.commit(msg.ref.version, tuple(msg.accepted_rows))
        clock.lap("compute")
        return pb.Ack(ref=msg.ref)
