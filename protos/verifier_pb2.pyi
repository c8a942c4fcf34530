from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class ScheduledRequest(_message.Message):
    __slots__ = ("request_id", "num_computed_tokens", "token_ids", "num_draft_tokens", "sample", "next_token_id", "sampling", "num_spec_tokens", "draft_probs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_computed_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    sample: bool
    next_token_id: int
    sampling: _common_pb2.SamplingParams
    num_spec_tokens: int
    draft_probs: _common_pb2.DraftProbs
    def __init__(self, request_id: str | None = ..., num_computed_tokens: int | None = ..., token_ids: _Iterable[int] | None = ..., num_draft_tokens: int | None = ..., sample: bool | None = ..., next_token_id: int | None = ..., sampling: _common_pb2.SamplingParams | _Mapping | None = ..., num_spec_tokens: int | None = ..., draft_probs: _common_pb2.DraftProbs | _Mapping | None = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("iteration", "requests", "finished_request_ids", "coordinator_id")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    requests: _containers.RepeatedCompositeFieldContainer[ScheduledRequest]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    coordinator_id: str
    def __init__(self, iteration: int | None = ..., requests: _Iterable[ScheduledRequest | _Mapping] | None = ..., finished_request_ids: _Iterable[str] | None = ..., coordinator_id: str | None = ...) -> None: ...

class VerifiedRequest(_message.Message):
    __slots__ = ("request_id", "sampled_token_ids", "num_rejected", "draft_token_ids", "draft_probs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_rejected: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.DraftProbs
    def __init__(self, request_id: str | None = ..., sampled_token_ids: _Iterable[int] | None = ..., num_rejected: int | None = ..., draft_token_ids: _Iterable[int] | None = ..., draft_probs: _common_pb2.DraftProbs | _Mapping | None = ...) -> None: ...

class VerifyTiming(_message.Message):
    __slots__ = ("prepare_ns", "forward_ns", "sample_ns", "propose_ns")
    PREPARE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_NS_FIELD_NUMBER: _ClassVar[int]
    prepare_ns: int
    forward_ns: int
    sample_ns: int
    propose_ns: int
    def __init__(self, prepare_ns: int | None = ..., forward_ns: int | None = ..., sample_ns: int | None = ..., propose_ns: int | None = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "drafter_ok", "drafter_error", "timing", "hidden_state_bytes")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_OK_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifiedRequest]
    drafter_ok: bool
    drafter_error: str
    timing: VerifyTiming
    hidden_state_bytes: int
    def __init__(self, results: _Iterable[VerifiedRequest | _Mapping] | None = ..., drafter_ok: bool | None = ..., drafter_error: str | None = ..., timing: VerifyTiming | _Mapping | None = ..., hidden_state_bytes: int | None = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Iterable[str] | None = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_free_blocks",)
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    def __init__(self, num_free_blocks: int | None = ...) -> None: ...
