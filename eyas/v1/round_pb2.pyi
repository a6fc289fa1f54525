from eyas.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TreePolicy(_message.Message):
    __slots__ = ("width", "depth", "budget", "stop")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    width: int
    depth: int
    budget: int
    stop: float
    def __init__(self, width: _Optional[int] = ..., depth: _Optional[int] = ..., budget: _Optional[int] = ..., stop: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class AssumedOutcome(_message.Message):
    __slots__ = ("accepted_tokens", "frontier_token")
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    frontier_token: int
    def __init__(self, accepted_tokens: _Optional[_Iterable[int]] = ..., frontier_token: _Optional[int] = ...) -> None: ...

class FlattenedTree(_message.Message):
    __slots__ = ("ref", "tokens", "parents", "depths", "positions", "mask", "retrieve", "draft_probs", "prefix_len", "assumed")
    REF_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    RETRIEVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    tokens: _tensor_pb2.Tensor
    parents: _tensor_pb2.Tensor
    depths: _tensor_pb2.Tensor
    positions: _tensor_pb2.Tensor
    mask: _tensor_pb2.Tensor
    retrieve: _tensor_pb2.Tensor
    draft_probs: _tensor_pb2.Tensor
    prefix_len: int
    assumed: AssumedOutcome
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., tokens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., parents: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., depths: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., positions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., mask: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., retrieve: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., draft_probs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefix_len: _Optional[int] = ..., assumed: _Optional[_Union[AssumedOutcome, _Mapping]] = ...) -> None: ...

class DraftStart(_message.Message):
    __slots__ = ("ref", "features", "tokens", "target", "prefill")
    REF_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    features: _tensor_pb2.Tensor
    tokens: _containers.RepeatedScalarFieldContainer[int]
    target: str
    prefill: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., features: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., target: _Optional[str] = ..., prefill: _Optional[_Iterable[int]] = ...) -> None: ...

class Reseed(_message.Message):
    __slots__ = ("ref", "features", "tokens")
    REF_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    features: _tensor_pb2.Tensor
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., features: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("ref", "root_token", "policy", "assumed", "with_records")
    REF_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    WITH_RECORDS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    root_token: int
    policy: TreePolicy
    assumed: AssumedOutcome
    with_records: bool
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., root_token: _Optional[int] = ..., policy: _Optional[_Union[TreePolicy, _Mapping]] = ..., assumed: _Optional[_Union[AssumedOutcome, _Mapping]] = ..., with_records: _Optional[bool] = ...) -> None: ...

class RoundRequest(_message.Message):
    __slots__ = ("draft", "publish", "sampling", "round_id", "target", "with_features", "draft_next", "next_round_id")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    WITH_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NEXT_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    draft: DraftRequest
    publish: Publish
    sampling: SamplingParams
    round_id: str
    target: str
    with_features: bool
    draft_next: bool
    next_round_id: str
    def __init__(self, draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., publish: _Optional[_Union[Publish, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., round_id: _Optional[str] = ..., target: _Optional[str] = ..., with_features: _Optional[bool] = ..., draft_next: _Optional[bool] = ..., next_round_id: _Optional[str] = ...) -> None: ...

class Publish(_message.Message):
    __slots__ = ("ref", "round_id", "accepted_rows", "tokens")
    REF_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    round_id: str
    accepted_rows: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., round_id: _Optional[str] = ..., accepted_rows: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class RoundReply(_message.Message):
    __slots__ = ("ref", "proposal", "verify_request", "verification", "target_seconds", "target_forwards", "sent_ahead_s")
    REF_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_REQUEST_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    SENT_AHEAD_S_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    proposal: Proposal
    verify_request: bytes
    verification: bytes
    target_seconds: _containers.RepeatedScalarFieldContainer[float]
    target_forwards: _containers.RepeatedCompositeFieldContainer[ForwardCost]
    sent_ahead_s: float
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., verify_request: _Optional[bytes] = ..., verification: _Optional[bytes] = ..., target_seconds: _Optional[_Iterable[float]] = ..., target_forwards: _Optional[_Iterable[_Union[ForwardCost, _Mapping]]] = ..., sent_ahead_s: _Optional[float] = ...) -> None: ...

class DraftRecords(_message.Message):
    __slots__ = ("tokens", "parents", "confidences", "row_nodes")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    ROW_NODES_FIELD_NUMBER: _ClassVar[int]
    tokens: _tensor_pb2.Tensor
    parents: _tensor_pb2.Tensor
    confidences: _tensor_pb2.Tensor
    row_nodes: _tensor_pb2.Tensor
    def __init__(self, tokens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., parents: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., confidences: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., row_nodes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("ref", "nodes_expanded", "nodes_recorded", "draft_kv_bytes", "tree_seconds", "records")
    REF_FIELD_NUMBER: _ClassVar[int]
    NODES_EXPANDED_FIELD_NUMBER: _ClassVar[int]
    NODES_RECORDED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TREE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    nodes_expanded: int
    nodes_recorded: int
    draft_kv_bytes: int
    tree_seconds: float
    records: DraftRecords
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., nodes_expanded: _Optional[int] = ..., nodes_recorded: _Optional[int] = ..., draft_kv_bytes: _Optional[int] = ..., tree_seconds: _Optional[float] = ..., records: _Optional[_Union[DraftRecords, _Mapping]] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("ref", "tokens")
    REF_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("ref", "features")
    REF_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    features: _tensor_pb2.Tensor
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., features: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("ref", "accepted_rows", "round_id")
    REF_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    accepted_rows: _containers.RepeatedScalarFieldContainer[int]
    round_id: str
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., accepted_rows: _Optional[_Iterable[int]] = ..., round_id: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("ref", "tree", "sampling", "commit", "round_id", "options")
    REF_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    tree: FlattenedTree
    sampling: SamplingParams
    commit: Commit
    round_id: str
    options: _containers.RepeatedCompositeFieldContainer[VerifyOption]
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., tree: _Optional[_Union[FlattenedTree, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., round_id: _Optional[str] = ..., options: _Optional[_Iterable[_Union[VerifyOption, _Mapping]]] = ...) -> None: ...

class VerifyOption(_message.Message):
    __slots__ = ("tree", "commit")
    TREE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    tree: FlattenedTree
    commit: Commit
    def __init__(self, tree: _Optional[_Union[FlattenedTree, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ...) -> None: ...

class AcceptanceDecision(_message.Message):
    __slots__ = ("ref", "accepted_rows", "accepted_tokens", "frontier_token", "frontier_prob", "accepted_features", "token_probs")
    REF_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_PROB_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    accepted_rows: _containers.RepeatedScalarFieldContainer[int]
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    frontier_token: int
    frontier_prob: float
    accepted_features: _tensor_pb2.Tensor
    token_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., accepted_rows: _Optional[_Iterable[int]] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., frontier_token: _Optional[int] = ..., frontier_prob: _Optional[float] = ..., accepted_features: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., token_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Expert(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class Verification(_message.Message):
    __slots__ = ("ref", "decision", "experts", "branch_kv_bytes", "round_id", "row_acceptance")
    REF_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    decision: AcceptanceDecision
    experts: _containers.RepeatedCompositeFieldContainer[Expert]
    branch_kv_bytes: int
    round_id: str
    row_acceptance: _tensor_pb2.Tensor
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., decision: _Optional[_Union[AcceptanceDecision, _Mapping]] = ..., experts: _Optional[_Iterable[_Union[Expert, _Mapping]]] = ..., branch_kv_bytes: _Optional[int] = ..., round_id: _Optional[str] = ..., row_acceptance: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class CostsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CostCurve(_message.Message):
    __slots__ = ("rows", "seconds")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rows: _Optional[_Iterable[int]] = ..., seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ...) -> None: ...

class Released(_message.Message):
    __slots__ = ("ref", "freed_kv_bytes")
    REF_FIELD_NUMBER: _ClassVar[int]
    FREED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    freed_kv_bytes: int
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., freed_kv_bytes: _Optional[int] = ...) -> None: ...

class WorkerHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerHealth(_message.Message):
    __slots__ = ("role", "manifest_id", "sessions", "kv_bytes", "rss_bytes", "calls", "busy_seconds", "forwards", "forward_calls", "forward_seconds", "options_offered", "options_taken")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_OFFERED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_TAKEN_FIELD_NUMBER: _ClassVar[int]
    role: str
    manifest_id: str
    sessions: int
    kv_bytes: int
    rss_bytes: int
    calls: int
    busy_seconds: float
    forwards: int
    forward_calls: int
    forward_seconds: float
    options_offered: int
    options_taken: int
    def __init__(self, role: _Optional[str] = ..., manifest_id: _Optional[str] = ..., sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., calls: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., forwards: _Optional[int] = ..., forward_calls: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., options_offered: _Optional[int] = ..., options_taken: _Optional[int] = ...) -> None: ...

class CallBatch(_message.Message):
    __slots__ = ("method", "calls", "id")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    method: str
    calls: _containers.RepeatedScalarFieldContainer[bytes]
    id: int
    def __init__(self, method: _Optional[str] = ..., calls: _Optional[_Iterable[bytes]] = ..., id: _Optional[int] = ...) -> None: ...

class CallResult(_message.Message):
    __slots__ = ("code", "field", "details", "reply", "seconds", "forwards", "role")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    code: int
    field: str
    details: str
    reply: bytes
    seconds: _containers.RepeatedScalarFieldContainer[float]
    forwards: _containers.RepeatedCompositeFieldContainer[ForwardCost]
    role: str
    def __init__(self, code: _Optional[int] = ..., field: _Optional[str] = ..., details: _Optional[str] = ..., reply: _Optional[bytes] = ..., seconds: _Optional[_Iterable[float]] = ..., forwards: _Optional[_Iterable[_Union[ForwardCost, _Mapping]]] = ..., role: _Optional[str] = ...) -> None: ...

class ForwardCost(_message.Message):
    __slots__ = ("rows", "seconds")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    seconds: float
    def __init__(self, rows: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CallBatchReply(_message.Message):
    __slots__ = ("results", "id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CallResult]
    id: int
    def __init__(self, results: _Optional[_Iterable[_Union[CallResult, _Mapping]]] = ..., id: _Optional[int] = ...) -> None: ...
