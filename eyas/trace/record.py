"""Recording one request: its start, every round, its end, as trace frames handed to a sink.

The sink is a `TraceWriter.write`, a buffer streamed to a client, or both; the recorder only encodes.
Requests that are not traced have no recorder, so tracing off costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

from .. import wire
from ..request import RequestState
from ..rounds import RoundRecord
from ..tree import TreePolicy
from .format import RequestEnd, RequestStart, Round, encode


def local_messages(record: RoundRecord, request_id: str, manifest_id: str) -> tuple[bytes, bytes]:
    """(FlattenedTree, AcceptanceDecision) bytes of an in-process round, as the service would send them."""
    ref = wire.ref(request_id, record.version, manifest_id)
    tree = wire.tree_to_proto(record.tree, ref).SerializeToString()
    return tree, wire.decision_to_proto(record.decision, record.features, ref).SerializeToString()


class RequestRecorder:
    """Encodes one request's records for `sink`; the start record is written at once."""

    def __init__(
        self,
        sink: Callable[[bytes], None],
        request: RequestState,
        policy: TreePolicy,
        manifest_id: str,
        manifest: dict | None,
        source: str,
    ):
        self.sink = sink
        self.request_id = request.request_id
        self.manifest_id = manifest_id
        self.policy = asdict(policy)
        self.sampling = request.sampling.to_dict()
        self.rounds = 0
        stop = request.stop
        sink(
            encode(
                RequestStart(
                    request=request.request_id,
                    prompt_ids=list(request.prompt_ids),
                    sampling=self.sampling,
                    stop={
                        "max_new_tokens": stop.max_new_tokens,
                        "eos_token_ids": sorted(stop.eos_token_ids),
                        "stop_strings": list(stop.stop_strings),
                    },
                    policy=self.policy,
                    manifest_id=manifest_id,
                    manifest=manifest,
                    source=source,
                    time=time.time(),
                )
            )
        )

    def round(self, record: RoundRecord, tree: bytes, decision: bytes, service_seconds: dict | None = None) -> None:
        """Record a round with its FlattenedTree and AcceptanceDecision bytes exactly as they were sent."""
        self.sink(
            encode(
                Round(
                    request=self.request_id,
                    round=self.rounds,
                    version=record.version,
                    manifest_id=self.manifest_id,
                    tree=tree,
                    decision=decision,
                    policy=asdict(record.policy) if record.policy is not None else self.policy,
                    sampling=self.sampling,
                    emitted=list(record.emitted),
                    seconds=dict(record.seconds),
                    service_seconds=dict(service_seconds or {}),
                    nodes_expanded=record.nodes_expanded,
                    nodes_recorded=record.nodes_recorded,
                )
            )
        )
        self.rounds += 1

    def local_round(self, record: RoundRecord) -> None:
        """Record an in-process round, its messages encoded with the wire codec."""
        self.round(record, *local_messages(record, self.request_id, self.manifest_id))

    def end(self, request: RequestState, error: str = "") -> None:
        self.sink(
            encode(
                RequestEnd(
                    request=self.request_id,
                    version=request.version,
                    finish_reason=request.finish_reason or "",
                    output_ids=list(request.output),
                    error=error,
                )
            )
        )
