from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    DECISION_ALLOW: _ClassVar[Decision]
    DECISION_BLOCK: _ClassVar[Decision]
DECISION_UNSPECIFIED: Decision
DECISION_ALLOW: Decision
DECISION_BLOCK: Decision

class CheckPromptRequest(_message.Message):
    __slots__ = ("text", "tenant", "policy", "turns", "roles")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    text: str
    tenant: str
    policy: TenantPolicy
    turns: _containers.RepeatedScalarFieldContainer[str]
    roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, text: _Optional[str] = ..., tenant: _Optional[str] = ..., policy: _Optional[_Union[TenantPolicy, _Mapping]] = ..., turns: _Optional[_Iterable[str]] = ..., roles: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckOutputRequest(_message.Message):
    __slots__ = ("text", "prompt", "tenant", "policy")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    text: str
    prompt: str
    tenant: str
    policy: TenantPolicy
    def __init__(self, text: _Optional[str] = ..., prompt: _Optional[str] = ..., tenant: _Optional[str] = ..., policy: _Optional[_Union[TenantPolicy, _Mapping]] = ...) -> None: ...

class TenantPolicy(_message.Message):
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

class CategoryScore(_message.Message):
    __slots__ = ("category", "score", "threshold", "is_off")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    IS_OFF_FIELD_NUMBER: _ClassVar[int]
    category: str
    score: float
    threshold: float
    is_off: bool
    def __init__(self, category: _Optional[str] = ..., score: _Optional[float] = ..., threshold: _Optional[float] = ..., is_off: _Optional[bool] = ...) -> None: ...

class CheckResponse(_message.Message):
    __slots__ = ("decision", "scores", "reasons", "policy_version", "safe_message", "tenant_policy", "waived")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAFE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TENANT_POLICY_FIELD_NUMBER: _ClassVar[int]
    WAIVED_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    scores: _containers.RepeatedCompositeFieldContainer[CategoryScore]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    policy_version: str
    safe_message: str
    tenant_policy: str
    waived: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., scores: _Optional[_Iterable[_Union[CategoryScore, _Mapping]]] = ..., reasons: _Optional[_Iterable[str]] = ..., policy_version: _Optional[str] = ..., safe_message: _Optional[str] = ..., tenant_policy: _Optional[str] = ..., waived: _Optional[_Iterable[str]] = ...) -> None: ...

class GetGateRequest(_message.Message):
    __slots__ = ("metadata_only",)
    METADATA_ONLY_FIELD_NUMBER: _ClassVar[int]
    metadata_only: bool
    def __init__(self, metadata_only: _Optional[bool] = ...) -> None: ...

class GetGateResponse(_message.Message):
    __slots__ = ("version", "sha256", "weights", "manifest_json", "categories")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    version: str
    sha256: str
    weights: bytes
    manifest_json: str
    categories: _containers.RepeatedCompositeFieldContainer[GateCategory]
    def __init__(self, version: _Optional[str] = ..., sha256: _Optional[str] = ..., weights: _Optional[bytes] = ..., manifest_json: _Optional[str] = ..., categories: _Optional[_Iterable[_Union[GateCategory, _Mapping]]] = ...) -> None: ...

class GateCategory(_message.Message):
    __slots__ = ("name", "prompt_threshold", "output_threshold")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    name: str
    prompt_threshold: float
    output_threshold: float
    def __init__(self, name: _Optional[str] = ..., prompt_threshold: _Optional[float] = ..., output_threshold: _Optional[float] = ...) -> None: ...
