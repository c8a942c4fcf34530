import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeItem(_message.Message):
    __slots__ = ("request_id", "start_position", "next_token_ids", "num_rejected", "num_spec_tokens", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_position: int
    next_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_rejected: int
    num_spec_tokens: int
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., start_position: _Optional[int] = ..., next_token_ids: _Optional[_Iterable[int]] = ..., num_rejected: _Optional[int] = ..., num_spec_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("iteration", "requests", "hidden_states", "finished_request_ids", "trace_context")
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
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    requests: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    hidden_states: _common_pb2.Tensor
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, iteration: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ..., hidden_states: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Drafts(_message.Message):
    __slots__ = ("request_id", "token_ids", "draft_probs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.DraftProbs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.DraftProbs, _Mapping]] = ...) -> None: ...

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
