from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_SAFETY: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class SafetyGateStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAFETY_GATE_STATUS_UNSPECIFIED: _ClassVar[SafetyGateStatus]
    SAFETY_GATE_STATUS_OK: _ClassVar[SafetyGateStatus]
    SAFETY_GATE_STATUS_MISMATCH: _ClassVar[SafetyGateStatus]
    SAFETY_GATE_STATUS_UNVERIFIED: _ClassVar[SafetyGateStatus]
    SAFETY_GATE_STATUS_UNCOVERED: _ClassVar[SafetyGateStatus]
    SAFETY_GATE_STATUS_ABSENT: _ClassVar[SafetyGateStatus]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_SAFETY: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
SAFETY_GATE_STATUS_UNSPECIFIED: SafetyGateStatus
SAFETY_GATE_STATUS_OK: SafetyGateStatus
SAFETY_GATE_STATUS_MISMATCH: SafetyGateStatus
SAFETY_GATE_STATUS_UNVERIFIED: SafetyGateStatus
SAFETY_GATE_STATUS_UNCOVERED: SafetyGateStatus
SAFETY_GATE_STATUS_ABSENT: SafetyGateStatus

class CountTokensRequest(_message.Message):
    __slots__ = ("prompt", "chat")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatTurns
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatTurns, _Mapping]] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("num_tokens", "model")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    model: str
    def __init__(self, num_tokens: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatTurns(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "chat", "token_ids", "sampling", "intent_class", "cache_salt", "retrieval_mode", "gate_policy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    INTENT_CLASS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_MODE_FIELD_NUMBER: _ClassVar[int]
    GATE_POLICY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    chat: ChatTurns
    token_ids: TokenIds
    sampling: SamplingParams
    intent_class: str
    cache_salt: str
    retrieval_mode: str
    gate_policy: GatePolicy
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatTurns, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., intent_class: _Optional[str] = ..., cache_salt: _Optional[str] = ..., retrieval_mode: _Optional[str] = ..., gate_policy: _Optional[_Union[GatePolicy, _Mapping]] = ...) -> None: ...

class GatePolicy(_message.Message):
    __slots__ = ("categories_off", "thresholds")
    class ThresholdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CATEGORIES_OFF_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    categories_off: _containers.RepeatedScalarFieldContainer[str]
    thresholds: _containers.ScalarMap[str, float]
    def __init__(self, categories_off: _Optional[_Iterable[str]] = ..., thresholds: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("hot_tokens", "warm_tokens", "cold_tokens")
    HOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    hot_tokens: int
    warm_tokens: int
    cold_tokens: int
    def __init__(self, hot_tokens: _Optional[int] = ..., warm_tokens: _Optional[int] = ..., cold_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "tiers")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    tiers: TierUsage
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., tiers: _Optional[_Union[TierUsage, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "generated_tokens_total", "max_batch_size", "device")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    generated_tokens_total: int
    max_batch_size: int
    device: str
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "max_context_tokens", "has_chat_template", "vocab_size", "safety_gate", "kv_capacity", "max_tokens_limit", "chat_roles")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAFETY_GATE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CHAT_ROLES_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_context_tokens: int
    has_chat_template: bool
    vocab_size: int
    safety_gate: SafetyGateInfo
    kv_capacity: KVCapacity
    max_tokens_limit: int
    chat_roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., safety_gate: _Optional[_Union[SafetyGateInfo, _Mapping]] = ..., kv_capacity: _Optional[_Union[KVCapacity, _Mapping]] = ..., max_tokens_limit: _Optional[int] = ..., chat_roles: _Optional[_Iterable[str]] = ...) -> None: ...

class KVCapacity(_message.Message):
    __slots__ = ("hot_tokens", "warm_tokens", "concurrent_sequences", "kv_cache_bytes", "budget_bytes")
    HOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONCURRENT_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    hot_tokens: int
    warm_tokens: int
    concurrent_sequences: int
    kv_cache_bytes: int
    budget_bytes: int
    def __init__(self, hot_tokens: _Optional[int] = ..., warm_tokens: _Optional[int] = ..., concurrent_sequences: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class SafetyGateInfo(_message.Message):
    __slots__ = ("status", "version", "sha256", "announced_sha256", "is_active", "is_refusing", "detail")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_SHA256_FIELD_NUMBER: _ClassVar[int]
    IS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    IS_REFUSING_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: SafetyGateStatus
    version: str
    sha256: str
    announced_sha256: str
    is_active: bool
    is_refusing: bool
    detail: str
    def __init__(self, status: _Optional[_Union[SafetyGateStatus, str]] = ..., version: _Optional[str] = ..., sha256: _Optional[str] = ..., announced_sha256: _Optional[str] = ..., is_active: _Optional[bool] = ..., is_refusing: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...
