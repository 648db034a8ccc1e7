from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_RAW: _ClassVar[Codec]
    CODEC_INT2_SPARSE: _ClassVar[Codec]
CODEC_UNSPECIFIED: Codec
CODEC_RAW: Codec
CODEC_INT2_SPARSE: Codec

class Block(_message.Message):
    __slots__ = ("block_hash", "codec", "shape", "payload", "model")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    block_hash: str
    codec: Codec
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    model: str
    def __init__(self, block_hash: _Optional[str] = ..., codec: _Optional[_Union[Codec, str]] = ..., shape: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ..., model: _Optional[str] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("block",)
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    block: Block
    def __init__(self, block: _Optional[_Union[Block, _Mapping]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("stored_hashes", "duplicate_hashes")
    STORED_HASHES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_HASHES_FIELD_NUMBER: _ClassVar[int]
    stored_hashes: _containers.RepeatedScalarFieldContainer[str]
    duplicate_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stored_hashes: _Optional[_Iterable[str]] = ..., duplicate_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("block", "missing_hash")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    MISSING_HASH_FIELD_NUMBER: _ClassVar[int]
    block: Block
    missing_hash: str
    def __init__(self, block: _Optional[_Union[Block, _Mapping]] = ..., missing_hash: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("present_hashes",)
    PRESENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    present_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, present_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_blocks", "used_bytes", "capacity_bytes", "staged_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    used_bytes: int
    capacity_bytes: int
    staged_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., staged_blocks: _Optional[int] = ...) -> None: ...
