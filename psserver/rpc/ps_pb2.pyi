from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType

class Chunk(_message.Message):
    __slots__ = ("offset", "dtype", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    dtype: DType
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ParamInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ModelSpecMsg(_message.Message):
    __slots__ = ("params", "hash")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    params: _containers.RepeatedCompositeFieldContainer[ParamInfo]
    hash: str
    def __init__(self, params: _Optional[_Iterable[_Union[ParamInfo, _Mapping]]] = ..., hash: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("spec_hash", "worker_id", "start_clock", "host", "observer")
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    START_CLOCK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    OBSERVER_FIELD_NUMBER: _ClassVar[int]
    spec_hash: str
    worker_id: int
    start_clock: int
    host: str
    observer: bool
    def __init__(self, spec_hash: _Optional[str] = ..., worker_id: _Optional[int] = ..., start_clock: _Optional[int] = ..., host: _Optional[str] = ..., observer: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("worker_id", "start_clock", "mode", "staleness", "backup_workers", "lease_s", "begin", "end", "total_size", "shard_index", "num_shards", "initialized", "version", "tcp_port", "shm_socket", "max_chunk_bytes", "job_tag", "planes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    START_CLOCK_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOB_TAG_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    start_clock: int
    mode: str
    staleness: int
    backup_workers: int
    lease_s: float
    begin: int
    end: int
    total_size: int
    shard_index: int
    num_shards: int
    initialized: bool
    version: int
    tcp_port: int
    shm_socket: str
    max_chunk_bytes: int
    job_tag: str
    planes: _containers.RepeatedCompositeFieldContainer[PlaneOffer]
    def __init__(self, worker_id: _Optional[int] = ..., start_clock: _Optional[int] = ..., mode: _Optional[str] = ..., staleness: _Optional[int] = ..., backup_workers: _Optional[int] = ..., lease_s: _Optional[float] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ..., total_size: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., tcp_port: _Optional[int] = ..., shm_socket: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., job_tag: _Optional[str] = ..., planes: _Optional[_Iterable[_Union[PlaneOffer, _Mapping]]] = ...) -> None: ...

class PlaneOffer(_message.Message):
    __slots__ = ("name", "address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("spec", "num_chunks", "chunk")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    spec: ModelSpecMsg
    num_chunks: int
    chunk: Chunk
    def __init__(self, spec: _Optional[_Union[ModelSpecMsg, _Mapping]] = ..., num_chunks: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("applied", "version")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    version: int
    def __init__(self, applied: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "clock", "chunk_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    chunk_bytes: int
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("version", "num_chunks", "chunk")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_chunks: int
    chunk: Chunk
    def __init__(self, version: _Optional[int] = ..., num_chunks: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("worker_id", "clock", "version", "num_chunks", "chunk")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    version: int
    num_chunks: int
    chunk: Chunk
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., version: _Optional[int] = ..., num_chunks: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("outcome", "version", "staleness", "next_clock")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        APPLIED: _ClassVar[PushReply.Outcome]
        ACCUMULATED: _ClassVar[PushReply.Outcome]
        DROPPED_LATE: _ClassVar[PushReply.Outcome]
        DUPLICATE: _ClassVar[PushReply.Outcome]
    APPLIED: PushReply.Outcome
    ACCUMULATED: PushReply.Outcome
    DROPPED_LATE: PushReply.Outcome
    DUPLICATE: PushReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CLOCK_FIELD_NUMBER: _ClassVar[int]
    outcome: PushReply.Outcome
    version: int
    staleness: int
    next_clock: int
    def __init__(self, outcome: _Optional[_Union[PushReply.Outcome, str]] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., next_clock: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "leaving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    leaving: bool
    def __init__(self, worker_id: _Optional[int] = ..., leaving: _Optional[bool] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "lease_s", "min_clock", "version")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    known: bool
    lease_s: float
    min_clock: int
    version: int
    def __init__(self, known: _Optional[bool] = ..., lease_s: _Optional[float] = ..., min_clock: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemberInfo(_message.Message):
    __slots__ = ("worker_id", "clock", "idle_s", "host")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    idle_s: float
    host: str
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., idle_s: _Optional[float] = ..., host: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("shard_index", "num_shards", "mode", "version", "begin", "end", "members", "min_clock", "max_clock", "pushes", "pulls", "bytes_in", "bytes_out", "applied_updates", "dropped_late", "duplicates", "evictions", "rejected", "staleness_counts", "mean_staleness", "max_staleness", "wait_s_total", "checkpoint", "initialized", "total_size", "waits", "departed", "lost_updates", "restored_version", "stalled_evictions", "revoked_reads", "job_tag", "uncompensated_updates", "momentum", "lr")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    APPLIED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_LATE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    DEPARTED_FIELD_NUMBER: _ClassVar[int]
    LOST_UPDATES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALLED_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_READS_FIELD_NUMBER: _ClassVar[int]
    JOB_TAG_FIELD_NUMBER: _ClassVar[int]
    UNCOMPENSATED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    mode: str
    version: int
    begin: int
    end: int
    members: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    min_clock: int
    max_clock: int
    pushes: int
    pulls: int
    bytes_in: int
    bytes_out: int
    applied_updates: int
    dropped_late: int
    duplicates: int
    evictions: int
    rejected: int
    staleness_counts: _containers.RepeatedScalarFieldContainer[int]
    mean_staleness: float
    max_staleness: int
    wait_s_total: float
    checkpoint: str
    initialized: bool
    total_size: int
    waits: _containers.RepeatedCompositeFieldContainer[WorkerWait]
    departed: _containers.RepeatedScalarFieldContainer[int]
    lost_updates: int
    restored_version: int
    stalled_evictions: int
    revoked_reads: int
    job_tag: str
    uncompensated_updates: int
    momentum: float
    lr: float
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., mode: _Optional[str] = ..., version: _Optional[int] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., min_clock: _Optional[int] = ..., max_clock: _Optional[int] = ..., pushes: _Optional[int] = ..., pulls: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., applied_updates: _Optional[int] = ..., dropped_late: _Optional[int] = ..., duplicates: _Optional[int] = ..., evictions: _Optional[int] = ..., rejected: _Optional[int] = ..., staleness_counts: _Optional[_Iterable[int]] = ..., mean_staleness: _Optional[float] = ..., max_staleness: _Optional[int] = ..., wait_s_total: _Optional[float] = ..., checkpoint: _Optional[str] = ..., initialized: _Optional[bool] = ..., total_size: _Optional[int] = ..., waits: _Optional[_Iterable[_Union[WorkerWait, _Mapping]]] = ..., departed: _Optional[_Iterable[int]] = ..., lost_updates: _Optional[int] = ..., restored_version: _Optional[int] = ..., stalled_evictions: _Optional[int] = ..., revoked_reads: _Optional[int] = ..., job_tag: _Optional[str] = ..., uncompensated_updates: _Optional[int] = ..., momentum: _Optional[float] = ..., lr: _Optional[float] = ...) -> None: ...

class WorkerWait(_message.Message):
    __slots__ = ("worker_id", "seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    seconds: float
    def __init__(self, worker_id: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("initialized", "spec", "mode", "staleness", "backup_workers", "lease_s", "shard_index", "num_shards", "total_size", "begin", "end", "max_chunk_bytes", "planes", "optimizer", "update_device", "job_tag", "version")
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    UPDATE_DEVICE_FIELD_NUMBER: _ClassVar[int]
    JOB_TAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    spec: ModelSpecMsg
    mode: str
    staleness: int
    backup_workers: int
    lease_s: float
    shard_index: int
    num_shards: int
    total_size: int
    begin: int
    end: int
    max_chunk_bytes: int
    planes: _containers.RepeatedCompositeFieldContainer[PlaneOffer]
    optimizer: OptimizerInfo
    update_device: str
    job_tag: str
    version: int
    def __init__(self, initialized: _Optional[bool] = ..., spec: _Optional[_Union[ModelSpecMsg, _Mapping]] = ..., mode: _Optional[str] = ..., staleness: _Optional[int] = ..., backup_workers: _Optional[int] = ..., lease_s: _Optional[float] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., total_size: _Optional[int] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., planes: _Optional[_Iterable[_Union[PlaneOffer, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerInfo, _Mapping]] = ..., update_device: _Optional[str] = ..., job_tag: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class OptimizerInfo(_message.Message):
    __slots__ = ("name", "lr", "momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps", "staleness_compensation", "async_momentum", "lr_schedule", "lr_warmup", "lr_updates")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_COMPENSATION_FIELD_NUMBER: _ClassVar[int]
    ASYNC_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    LR_WARMUP_FIELD_NUMBER: _ClassVar[int]
    LR_UPDATES_FIELD_NUMBER: _ClassVar[int]
    name: str
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    staleness_compensation: str
    async_momentum: str
    lr_schedule: str
    lr_warmup: float
    lr_updates: int
    def __init__(self, name: _Optional[str] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., staleness_compensation: _Optional[str] = ..., async_momentum: _Optional[str] = ..., lr_schedule: _Optional[str] = ..., lr_warmup: _Optional[float] = ..., lr_updates: _Optional[int] = ...) -> None: ...
