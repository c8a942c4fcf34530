import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScheduledRequest(_message.Message):
    __slots__ = ("request_id", "num_computed_tokens", "token_ids", "num_draft_tokens", "sample", "next_token_id", "sampling", "num_spec_tokens", "draft_probs", "num_held_drafts", "num_prompt_tokens", "cached_block_hashes", "drafter_block_hashes", "cached_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_computed_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    sample: bool
    next_token_id: int
    sampling: _common_pb2.SamplingParams
    num_spec_tokens: int
    draft_probs: _common_pb2.DraftProbs
    num_held_drafts: int
    num_prompt_tokens: int
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    drafter_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    cached_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., num_computed_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., sample: _Optional[bool] = ..., next_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_spec_tokens: _Optional[int] = ..., draft_probs: _Optional[_Union[_common_pb2.DraftProbs, _Mapping]] = ..., num_held_drafts: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., cached_block_hashes: _Optional[_Iterable[bytes]] = ..., drafter_block_hashes: _Optional[_Iterable[bytes]] = ..., cached_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixBlock(_message.Message):
    __slots__ = ("request_id", "block_index", "block_hash", "drafter_block_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_index: int
    block_hash: bytes
    drafter_block_hash: bytes
    def __init__(self, request_id: _Optional[str] = ..., block_index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., drafter_block_hash: _Optional[bytes] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("iteration", "requests", "finished_request_ids", "coordinator_id", "trace_context", "reset_prefix_cache", "registered_blocks", "evicted_block_hashes")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    requests: _containers.RepeatedCompositeFieldContainer[ScheduledRequest]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    coordinator_id: str
    trace_context: _containers.ScalarMap[str, str]
    reset_prefix_cache: bool
    registered_blocks: _containers.RepeatedCompositeFieldContainer[PrefixBlock]
    evicted_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, iteration: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[ScheduledRequest, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., coordinator_id: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., reset_prefix_cache: _Optional[bool] = ..., registered_blocks: _Optional[_Iterable[_Union[PrefixBlock, _Mapping]]] = ..., evicted_block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class VerifiedRequest(_message.Message):
    __slots__ = ("request_id", "sampled_token_ids", "num_rejected", "num_draft_tokens", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_rejected: int
    num_draft_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., num_rejected: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class VerifyTiming(_message.Message):
    __slots__ = ("prepare_ns", "forward_ns", "sample_ns", "propose_ns", "received_ns", "replied_ns", "propose_sent_ns", "propose_received_ns", "drafter_received_ns", "drafter_replied_ns", "step0_ns", "later_steps_ns", "drafts_wait_ns")
    PREPARE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_NS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    REPLIED_NS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_REPLIED_NS_FIELD_NUMBER: _ClassVar[int]
    STEP0_NS_FIELD_NUMBER: _ClassVar[int]
    LATER_STEPS_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    prepare_ns: int
    forward_ns: int
    sample_ns: int
    propose_ns: int
    received_ns: int
    replied_ns: int
    propose_sent_ns: int
    propose_received_ns: int
    drafter_received_ns: int
    drafter_replied_ns: int
    step0_ns: int
    later_steps_ns: int
    drafts_wait_ns: int
    def __init__(self, prepare_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., propose_ns: _Optional[int] = ..., received_ns: _Optional[int] = ..., replied_ns: _Optional[int] = ..., propose_sent_ns: _Optional[int] = ..., propose_received_ns: _Optional[int] = ..., drafter_received_ns: _Optional[int] = ..., drafter_replied_ns: _Optional[int] = ..., step0_ns: _Optional[int] = ..., later_steps_ns: _Optional[int] = ..., drafts_wait_ns: _Optional[int] = ...) -> None: ...

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
    def __init__(self, results: _Optional[_Iterable[_Union[VerifiedRequest, _Mapping]]] = ..., drafter_ok: _Optional[bool] = ..., drafter_error: _Optional[str] = ..., timing: _Optional[_Union[VerifyTiming, _Mapping]] = ..., hidden_state_bytes: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_free_blocks",)
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    def __init__(self, num_free_blocks: _Optional[int] = ...) -> None: ...
