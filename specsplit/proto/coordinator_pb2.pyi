import common_pb2 as _common_pb2
import verifier_pb2 as _verifier_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "max_tokens", "sampling", "stop", "ignore_eos", "num_speculative_tokens", "stop_token_ids", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    num_speculative_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "spec_stats", "index", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPEC_STATS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    spec_stats: _common_pb2.SpecStats
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., spec_stats: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("include_iterations",)
    INCLUDE_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    include_iterations: bool
    def __init__(self, include_iterations: _Optional[bool] = ...) -> None: ...

class IterationTiming(_message.Message):
    __slots__ = ("iteration", "batch_size", "num_draft_tokens", "schedule_start_ns", "verify_sent_ns", "verify_received_ns", "post_step_end_ns", "verifier")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_START_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    POST_STEP_END_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    batch_size: int
    num_draft_tokens: int
    schedule_start_ns: int
    verify_sent_ns: int
    verify_received_ns: int
    post_step_end_ns: int
    verifier: _verifier_pb2.VerifyTiming
    def __init__(self, iteration: _Optional[int] = ..., batch_size: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., schedule_start_ns: _Optional[int] = ..., verify_sent_ns: _Optional[int] = ..., verify_received_ns: _Optional[int] = ..., post_step_end_ns: _Optional[int] = ..., verifier: _Optional[_Union[_verifier_pb2.VerifyTiming, _Mapping]] = ...) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("spec_stats", "num_finished_requests", "num_waiting", "num_running", "iterations")
    SPEC_STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    spec_stats: _common_pb2.SpecStats
    num_finished_requests: int
    num_waiting: int
    num_running: int
    iterations: _containers.RepeatedCompositeFieldContainer[IterationTiming]
    def __init__(self, spec_stats: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ..., num_finished_requests: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., iterations: _Optional[_Iterable[_Union[IterationTiming, _Mapping]]] = ...) -> None: ...
