from eyas.v1 import round_pb2 as _round_pb2
from eyas.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "manifest_id", "text", "token_ids", "max_new_tokens", "sampling", "stop", "ignore_eos", "tree", "trace")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    manifest_id: str
    text: str
    token_ids: TokenIds
    max_new_tokens: int
    sampling: _round_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    tree: _round_pb2.TreePolicy
    trace: bool
    def __init__(self, request_id: _Optional[str] = ..., manifest_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_round_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., tree: _Optional[_Union[_round_pb2.TreePolicy, _Mapping]] = ..., trace: _Optional[bool] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("rounds", "target_forwards", "tokens", "accepted_length_histogram", "mean_accept_length", "seconds", "service_seconds", "rebuilds", "ahead_rounds", "ahead_tokens")
    class SecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ServiceSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTH_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REBUILDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    target_forwards: int
    tokens: int
    accepted_length_histogram: _containers.RepeatedScalarFieldContainer[int]
    mean_accept_length: float
    seconds: _containers.ScalarMap[str, float]
    service_seconds: _containers.ScalarMap[str, float]
    rebuilds: int
    ahead_rounds: int
    ahead_tokens: int
    def __init__(self, rounds: _Optional[int] = ..., target_forwards: _Optional[int] = ..., tokens: _Optional[int] = ..., accepted_length_histogram: _Optional[_Iterable[int]] = ..., mean_accept_length: _Optional[float] = ..., seconds: _Optional[_Mapping[str, float]] = ..., service_seconds: _Optional[_Mapping[str, float]] = ..., rebuilds: _Optional[int] = ..., ahead_rounds: _Optional[int] = ..., ahead_tokens: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("ref", "token_ids", "text", "finish_reason", "stats", "trace")
    REF_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: RequestStats
    trace: bytes
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., trace: _Optional[bytes] = ...) -> None: ...

class JobItem(_message.Message):
    __slots__ = ("id", "request")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    id: str
    request: GenerateRequest
    def __init__(self, id: _Optional[str] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("code", "field", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    field: str
    message: str
    def __init__(self, code: _Optional[str] = ..., field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("id", "ref", "token_ids", "text", "finish_reason", "stats", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    ref: _tensor_pb2.RequestRef
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: RequestStats
    error: JobError
    def __init__(self, id: _Optional[str] = ..., ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., error: _Optional[_Union[JobError, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.RequestRef
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.RequestRef, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "state", "node_id", "address", "pid", "assigned", "sessions", "kv_bytes", "rss_bytes", "calls", "busy_seconds", "ranks", "forwards", "forward_calls", "forward_seconds", "options_offered", "options_taken")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_OFFERED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_TAKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: str
    node_id: str
    address: str
    pid: int
    assigned: int
    sessions: int
    kv_bytes: int
    rss_bytes: int
    calls: int
    busy_seconds: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    forwards: int
    forward_calls: int
    forward_seconds: float
    options_offered: int
    options_taken: int
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[str] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., assigned: _Optional[int] = ..., sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., calls: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., forwards: _Optional[int] = ..., forward_calls: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., options_offered: _Optional[int] = ..., options_taken: _Optional[int] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node_id", "pid", "device", "weight_bytes", "kv_pool_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    pid: int
    device: str
    weight_bytes: int
    kv_pool_bytes: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., pid: _Optional[int] = ..., device: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., kv_pool_bytes: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("name", "size", "workers", "tensor_parallel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    tensor_parallel: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., tensor_parallel: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("manifest_id", "pools", "active", "queued", "completed", "failed", "tokens", "rounds", "mean_accept_length", "rebuilds", "tree", "uptime_seconds", "service_seconds", "metrics_address", "metrics", "cancelled", "ray_address", "tree_auto", "tree_chosen", "emulation", "tree_exploring", "coordinator_rss_bytes")
    class ServiceSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TreeChosenEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _round_pb2.TreePolicy
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_round_pb2.TreePolicy, _Mapping]] = ...) -> None: ...
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REBUILDS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    RAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TREE_AUTO_FIELD_NUMBER: _ClassVar[int]
    TREE_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    EMULATION_FIELD_NUMBER: _ClassVar[int]
    TREE_EXPLORING_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    manifest_id: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    active: int
    queued: int
    completed: int
    failed: int
    tokens: int
    rounds: int
    mean_accept_length: float
    rebuilds: int
    tree: _round_pb2.TreePolicy
    uptime_seconds: float
    service_seconds: _containers.ScalarMap[str, float]
    metrics_address: str
    metrics: _containers.ScalarMap[str, float]
    cancelled: int
    ray_address: str
    tree_auto: bool
    tree_chosen: _containers.MessageMap[str, _round_pb2.TreePolicy]
    emulation: str
    tree_exploring: int
    coordinator_rss_bytes: int
    def __init__(self, manifest_id: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., active: _Optional[int] = ..., queued: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., mean_accept_length: _Optional[float] = ..., rebuilds: _Optional[int] = ..., tree: _Optional[_Union[_round_pb2.TreePolicy, _Mapping]] = ..., uptime_seconds: _Optional[float] = ..., service_seconds: _Optional[_Mapping[str, float]] = ..., metrics_address: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., cancelled: _Optional[int] = ..., ray_address: _Optional[str] = ..., tree_auto: _Optional[bool] = ..., tree_chosen: _Optional[_Mapping[str, _round_pb2.TreePolicy]] = ..., emulation: _Optional[str] = ..., tree_exploring: _Optional[int] = ..., coordinator_rss_bytes: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("draft", "target")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    draft: int
    target: int
    def __init__(self, draft: _Optional[int] = ..., target: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status", "manifest_id", "max_request_bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    status: str
    manifest_id: str
    max_request_bytes: int
    def __init__(self, status: _Optional[str] = ..., manifest_id: _Optional[str] = ..., max_request_bytes: _Optional[int] = ...) -> None: ...
