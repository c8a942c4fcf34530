import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeItem(_message.Message):
    __slots__ = ("request_id", "start_position", "next_token_ids", "num_rejected", "num_spec_tokens", "sampling", "num_rows", "output_token_ids", "cached_block_hashes", "output_offset")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_position: int
    next_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_rejected: int
    num_spec_tokens: int
    sampling: _common_pb2.SamplingParams
    num_rows: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    output_offset: int
    def __init__(self, request_id: _Optional[str] = ..., start_position: _Optional[int] = ..., next_token_ids: _Optional[_Iterable[int]] = ..., num_rejected: _Optional[int] = ..., num_spec_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_rows: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., cached_block_hashes: _Optional[_Iterable[bytes]] = ..., output_offset: _Optional[int] = ...) -> None: ...

class CachedBlock(_message.Message):
    __slots__ = ("request_id", "block_index", "block_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_index: int
    block_hash: bytes
    def __init__(self, request_id: _Optional[str] = ..., block_index: _Optional[int] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("iteration", "requests", "hidden_states", "hidden_states_handle", "finished_request_ids", "trace_context", "cached_blocks")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    requests: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    hidden_states: _common_pb2.Tensor
    hidden_states_handle: HiddenStatesHandle
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    trace_context: _containers.ScalarMap[str, str]
    cached_blocks: _containers.RepeatedCompositeFieldContainer[CachedBlock]
    def __init__(self, iteration: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ..., hidden_states: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., hidden_states_handle: _Optional[_Union[HiddenStatesHandle, _Mapping]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., cached_blocks: _Optional[_Iterable[_Union[CachedBlock, _Mapping]]] = ...) -> None: ...

class Drafts(_message.Message):
    __slots__ = ("request_id", "token_ids", "draft_probs", "output_wanted")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_WANTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.DraftProbs
    output_wanted: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.DraftProbs, _Mapping]] = ..., output_wanted: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("drafts", "step0_ns", "later_steps_ns", "received_ns", "replied_ns")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    STEP0_NS_FIELD_NUMBER: _ClassVar[int]
    LATER_STEPS_NS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    REPLIED_NS_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[Drafts]
    step0_ns: int
    later_steps_ns: int
    received_ns: int
    replied_ns: int
    def __init__(self, drafts: _Optional[_Iterable[_Union[Drafts, _Mapping]]] = ..., step0_ns: _Optional[int] = ..., later_steps_ns: _Optional[int] = ..., received_ns: _Optional[int] = ..., replied_ns: _Optional[int] = ...) -> None: ...

class DrafterFreeRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DrafterFreeResponse(_message.Message):
    __slots__ = ("num_free_blocks",)
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    def __init__(self, num_free_blocks: _Optional[int] = ...) -> None: ...

class HiddenStatesHandle(_message.Message):
    __slots__ = ("generation", "sequence", "dtype", "num_rows", "hidden_size", "slot", "offset", "tokens_on_device", "token_width")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_WIDTH_FIELD_NUMBER: _ClassVar[int]
    generation: int
    sequence: int
    dtype: _common_pb2.DType
    num_rows: int
    hidden_size: int
    slot: int
    offset: int
    tokens_on_device: bool
    token_width: int
    def __init__(self, generation: _Optional[int] = ..., sequence: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., num_rows: _Optional[int] = ..., hidden_size: _Optional[int] = ..., slot: _Optional[int] = ..., offset: _Optional[int] = ..., tokens_on_device: _Optional[bool] = ..., token_width: _Optional[int] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class OpenHiddenTransportRequest(_message.Message):
    __slots__ = ("transport", "generation", "dtype", "hidden_size", "buffers", "slot_rows", "device_uuid", "rendezvous", "backend", "timeout_s", "token_buffers", "event_handles", "slot_tokens")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SLOT_ROWS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SLOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    generation: int
    dtype: _common_pb2.DType
    hidden_size: int
    buffers: _containers.RepeatedCompositeFieldContainer[CudaIpcBuffer]
    slot_rows: int
    device_uuid: str
    rendezvous: str
    backend: str
    timeout_s: float
    token_buffers: _containers.RepeatedCompositeFieldContainer[CudaIpcBuffer]
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    slot_tokens: int
    def __init__(self, transport: _Optional[str] = ..., generation: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., hidden_size: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[CudaIpcBuffer, _Mapping]]] = ..., slot_rows: _Optional[int] = ..., device_uuid: _Optional[str] = ..., rendezvous: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ..., token_buffers: _Optional[_Iterable[_Union[CudaIpcBuffer, _Mapping]]] = ..., event_handles: _Optional[_Iterable[bytes]] = ..., slot_tokens: _Optional[int] = ...) -> None: ...

class OpenHiddenTransportResponse(_message.Message):
    __slots__ = ("device", "device_hand_off")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HAND_OFF_FIELD_NUMBER: _ClassVar[int]
    device: str
    device_hand_off: bool
    def __init__(self, device: _Optional[str] = ..., device_hand_off: _Optional[bool] = ...) -> None: ...
