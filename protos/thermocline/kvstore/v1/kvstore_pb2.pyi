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

class BlockSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_SOURCE_UNSPECIFIED: _ClassVar[BlockSource]
    BLOCK_SOURCE_STAGING: _ClassVar[BlockSource]
    BLOCK_SOURCE_DISK: _ClassVar[BlockSource]

class MissReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISS_REASON_UNSPECIFIED: _ClassVar[MissReason]
    MISS_REASON_ABSENT: _ClassVar[MissReason]
    MISS_REASON_CORRUPT: _ClassVar[MissReason]
CODEC_UNSPECIFIED: Codec
CODEC_RAW: Codec
CODEC_INT2_SPARSE: Codec
BLOCK_SOURCE_UNSPECIFIED: BlockSource
BLOCK_SOURCE_STAGING: BlockSource
BLOCK_SOURCE_DISK: BlockSource
MISS_REASON_UNSPECIFIED: MissReason
MISS_REASON_ABSENT: MissReason
MISS_REASON_CORRUPT: MissReason

class Namespace(_message.Message):
    __slots__ = ("tenant", "model")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class BlockHeader(_message.Message):
    __slots__ = ("block_hash", "codec", "shape", "payload_bytes")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_hash: str
    codec: Codec
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload_bytes: int
    def __init__(self, block_hash: _Optional[str] = ..., codec: _Optional[_Union[Codec, str]] = ..., shape: _Optional[_Iterable[int]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("namespace", "header", "data")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    header: BlockHeader
    data: bytes
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("stored_hashes", "duplicate_hashes")
    STORED_HASHES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_HASHES_FIELD_NUMBER: _ClassVar[int]
    stored_hashes: _containers.RepeatedScalarFieldContainer[str]
    duplicate_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stored_hashes: _Optional[_Iterable[str]] = ..., duplicate_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("header", "data", "missing_hash", "miss_reason", "source")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MISSING_HASH_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    missing_hash: str
    miss_reason: MissReason
    source: BlockSource
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., missing_hash: _Optional[str] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., source: _Optional[_Union[BlockSource, str]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("present_hashes",)
    PRESENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    present_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, present_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued", "already_staged")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STAGED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    already_staged: int
    def __init__(self, queued: _Optional[int] = ..., already_staged: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class LocateBlocksRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("block_hash", "codec", "segment_path", "segment_id", "offset", "length")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    block_hash: str
    codec: Codec
    segment_path: str
    segment_id: int
    offset: int
    length: int
    def __init__(self, block_hash: _Optional[str] = ..., codec: _Optional[_Union[Codec, str]] = ..., segment_path: _Optional[str] = ..., segment_id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class LocateBlocksResponse(_message.Message):
    __slots__ = ("locations",)
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    def __init__(self, locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_blocks", "used_bytes", "capacity_bytes", "staged_blocks", "staged_bytes", "disk_bytes", "num_segments", "evicted_blocks", "expired_blocks", "corrupt_records", "compacted_segments", "staging_hits", "disk_reads", "index_rebuilds", "located_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    COMPACTED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    STAGING_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_READS_FIELD_NUMBER: _ClassVar[int]
    INDEX_REBUILDS_FIELD_NUMBER: _ClassVar[int]
    LOCATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    used_bytes: int
    capacity_bytes: int
    staged_blocks: int
    staged_bytes: int
    disk_bytes: int
    num_segments: int
    evicted_blocks: int
    expired_blocks: int
    corrupt_records: int
    compacted_segments: int
    staging_hits: int
    disk_reads: int
    index_rebuilds: int
    located_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., staged_blocks: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., num_segments: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., expired_blocks: _Optional[int] = ..., corrupt_records: _Optional[int] = ..., compacted_segments: _Optional[int] = ..., staging_hits: _Optional[int] = ..., disk_reads: _Optional[int] = ..., index_rebuilds: _Optional[int] = ..., located_blocks: _Optional[int] = ...) -> None: ...
