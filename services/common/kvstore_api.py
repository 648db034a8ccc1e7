"""The kvstore's API in domain types, and a blocking client: chunking on the way in, reassembly out.

The engine (the cold tier's caller) and the kvstore (the server) share these types; neither
imports the other's package. This is the reference caller of the contract in
protos/thermocline/kvstore/v1/kvstore.proto; docs/kvstore.md shows how the engine uses it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType

import grpc

from services.common.config import MIB, channel_options
from services.common.errors import InvalidArgument
from services.common.service_auth import ServiceToken, authenticated, token_from_env
from thermocline.kvstore.v1 import kvstore_pb2 as pb
from thermocline.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

BlockHash = NewType("BlockHash", str)  # the caller's content hash, lowercase hex
MAX_NAME_BYTES = 255  # tenant and model names; the record header holds their lengths in a byte


@dataclass(frozen=True)
class Namespace:
    """Whose blocks: a tenant and a model."""

    tenant: str
    model: str

    def __post_init__(self) -> None:
        for field_name, value in (("tenant", self.tenant), ("model", self.model)):
            if not value:
                raise InvalidArgument(
                    f"namespace.{field_name} is required: blocks are stored per tenant and model"
                )
            if len(value.encode()) > MAX_NAME_BYTES or not value.isprintable():
                raise InvalidArgument(
                    f"namespace.{field_name} must be printable and at most {MAX_NAME_BYTES} bytes, "
                    f"got {value[:40]!r}"
                )


class Codec(IntEnum):
    """Payload encodings; the numbers are the proto's `Codec` values."""

    RAW = 1
    INT2_SPARSE = 2


class BlockSource(IntEnum):
    """Where a served block came from; the proto's `BlockSource` values."""

    STAGING = 1
    DISK = 2


class MissReason(IntEnum):
    """Why a block was not served; the proto's `MissReason` values."""

    ABSENT = 1
    CORRUPT = 2


@dataclass(frozen=True)
class BlockIn:
    """A block to store."""

    block_hash: BlockHash
    codec: Codec
    shape: tuple[int, ...]
    payload: bytes


@dataclass(frozen=True)
class PutResult:
    """Which blocks a put stored and which it found present already."""

    stored: list[BlockHash] = field(default_factory=list)
    duplicates: list[BlockHash] = field(default_factory=list)


@dataclass(frozen=True)
class PrefetchResult:
    """How a prefetch hint was taken."""

    queued: int
    already_staged: int


@dataclass(frozen=True)
class FetchedBlock:
    """A block as GetBlocks served it."""

    block_hash: str
    codec: Codec
    shape: tuple[int, ...]
    payload: bytes
    source: BlockSource


@dataclass(frozen=True)
class BlockLocation:
    """Where a block's record lies on the store's host (LocateBlocks); services/common/kv_record.py
    says what its bytes are."""

    block_hash: str
    codec: Codec
    segment_path: str
    segment_id: int
    offset: int
    length: int  # the whole record, header and payload


@dataclass(frozen=True)
class CallOptions:
    """Per-call overrides: another namespace, a tighter deadline, metadata (a trace's `traceparent`)."""

    namespace: Namespace | None = None
    timeout_s: float | None = None
    metadata: tuple[tuple[str, str], ...] = ()


NO_OPTIONS = CallOptions()


class KVStoreClient:
    """Calls one kvstore for one namespace (tenant and model), with the service token
    (`service_token`, or by default this process's, from THERMOCLINE_SERVICE_TOKEN_FILE)."""

    def __init__(
        self,
        target: str,
        namespace: Namespace,
        *,
        chunk_bytes: int = 1 * MIB,
        timeout_s: float = 30.0,
        max_message_bytes: int = 16 * MIB,
        service_token: ServiceToken | None = None,
    ) -> None:
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        channel = grpc.insecure_channel(target, options=channel_options(max_message_bytes))
        self.channel = authenticated(channel, service_token or token_from_env())
        self.stub = pb_grpc.KVStoreServiceStub(self.channel)

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def _namespace_pb(self, namespace: Namespace | None) -> pb.Namespace:
        namespace = namespace or self.namespace
        return pb.Namespace(tenant=namespace.tenant, model=namespace.model)

    def put_requests(
        self, blocks: Iterable[BlockIn], namespace: Namespace | None = None
    ) -> Iterator[pb.PutBlocksRequest]:
        """The PutBlocks stream for `blocks`: each payload in chunks of at most `chunk_bytes`."""
        first = True
        for block in blocks:
            header = pb.BlockHeader(
                block_hash=block.block_hash,
                codec=block.codec,
                shape=block.shape,
                payload_bytes=len(block.payload),
            )
            payload = memoryview(block.payload)
            for start in range(0, max(len(payload), 1), self.chunk_bytes):
                yield pb.PutBlocksRequest(
                    namespace=self._namespace_pb(namespace) if first else None,
                    header=header if start == 0 else None,
                    data=bytes(payload[start : start + self.chunk_bytes]),
                )
                first = False

    def put(self, blocks: Iterable[BlockIn], call: CallOptions = NO_OPTIONS) -> PutResult:
        """Stores blocks; returns once the store says they are durable."""
        reply = self.stub.PutBlocks(self.put_requests(blocks, call.namespace), **self._call_kwargs(call))
        return PutResult(list(reply.stored_hashes), list(reply.duplicate_hashes))

    def get(
        self, block_hashes: list[str], call: CallOptions = NO_OPTIONS
    ) -> dict[str, FetchedBlock | MissReason]:
        """Each hash's block, or why it was not served."""
        request = pb.GetBlocksRequest(namespace=self._namespace_pb(call.namespace), block_hashes=block_hashes)
        results: dict[str, FetchedBlock | MissReason] = {}
        header: pb.BlockHeader | None = None
        source, parts = BlockSource.DISK, list[bytes]()
        for reply in self.stub.GetBlocks(request, **self._call_kwargs(call)):
            if reply.missing_hash:
                results[reply.missing_hash] = MissReason(reply.miss_reason)
                continue
            if reply.HasField("header"):
                header, source, parts = reply.header, BlockSource(reply.source), []
            parts.append(reply.data)
            assert header is not None, "GetBlocks sent payload bytes before a header"
            if sum(map(len, parts)) == header.payload_bytes:
                payload = b"".join(parts)
                results[header.block_hash] = FetchedBlock(
                    header.block_hash, Codec(header.codec), tuple(header.shape), payload, source
                )
        return results

    def get_into(
        self,
        block_hashes: list[str],
        buffers: list[memoryview],
        shape: tuple[int, ...],
        call: CallOptions = NO_OPTIONS,
        codec: Codec = Codec.RAW,
    ) -> list[MissReason | None]:
        """Streams each block's payload straight into its buffer (bytes, exactly the payload's size),
        with no per-block objects; per hash, None once filled, else why not (ABSENT when not served,
        CORRUPT when served in another codec, `shape` or size: its bytes are not written, and a
        warning says what came). The codec pins the dtype (CODEC_RAW is BF16). The shape is checked,
        not only the size: the same byte count in another layout (another head count, say) would be
        copied in and attended as the caller's."""
        position = {h: i for i, h in enumerate(block_hashes)}
        results: list[MissReason | None] = [MissReason.ABSENT] * len(block_hashes)
        request = pb.GetBlocksRequest(namespace=self._namespace_pb(call.namespace), block_hashes=block_hashes)
        target: memoryview | None = None
        index = filled = 0
        for reply in self.stub.GetBlocks(request, **self._call_kwargs(call)):
            if reply.missing_hash:
                results[position[reply.missing_hash]] = MissReason(reply.miss_reason)
                continue
            if reply.HasField("header"):
                index, filled = position[reply.header.block_hash], 0
                mismatch = _header_mismatch(reply.header, codec, shape, len(buffers[index]))
                if mismatch is not None:
                    logger.warning("kvstore block %s is a miss: %s", reply.header.block_hash[:16], mismatch)
                target = buffers[index] if mismatch is None else None
                results[index] = MissReason.ABSENT if mismatch is None else MissReason.CORRUPT
            if target is not None and filled + len(reply.data) > len(target):
                logger.warning(
                    "kvstore block %s is a miss: more bytes than its header said", block_hashes[index][:16]
                )
                results[index], target = MissReason.CORRUPT, None
            if target is not None:
                target[filled : filled + len(reply.data)] = reply.data
                filled += len(reply.data)
                if filled == len(target):
                    results[index], target = None, None
        return results

    def locate(self, block_hashes: list[str], call: CallOptions = NO_OPTIONS) -> list[BlockLocation]:
        """Where the present blocks' records lie, in request order (FAILED_PRECONDITION when the
        store does not hand out locations)."""
        request = pb.LocateBlocksRequest(
            namespace=self._namespace_pb(call.namespace), block_hashes=block_hashes
        )
        reply = self.stub.LocateBlocks(request, **self._call_kwargs(call))
        return [
            BlockLocation(b.block_hash, Codec(b.codec), b.segment_path, b.segment_id, b.offset, b.length)
            for b in reply.locations
        ]

    def lookup(self, block_hashes: list[str], call: CallOptions = NO_OPTIONS) -> list[str]:
        """The hashes that are stored."""
        request = pb.LookupRequest(namespace=self._namespace_pb(call.namespace), block_hashes=block_hashes)
        return list(self.stub.Lookup(request, **self._call_kwargs(call)).present_hashes)

    def prefetch(self, block_hashes: list[str], call: CallOptions = NO_OPTIONS) -> PrefetchResult:
        """Asks the store to stage blocks in RAM; returns before they are."""
        request = pb.PrefetchRequest(namespace=self._namespace_pb(call.namespace), block_hashes=block_hashes)
        reply = self.stub.Prefetch(request, **self._call_kwargs(call))
        return PrefetchResult(reply.queued, reply.already_staged)

    def delete(self, block_hashes: list[str], call: CallOptions = NO_OPTIONS) -> int:
        """Deletes blocks; returns how many were present."""
        request = pb.DeleteRequest(namespace=self._namespace_pb(call.namespace), block_hashes=block_hashes)
        return int(self.stub.Delete(request, **self._call_kwargs(call)).deleted)

    def stats(self) -> pb.GetStatsResponse:
        """The store's occupancy and counters."""
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout_s)

    def _call_kwargs(self, call: CallOptions) -> dict[str, object]:
        timeout = self.timeout_s if call.timeout_s is None else call.timeout_s
        return {"timeout": timeout, "metadata": call.metadata or None}


def _header_mismatch(
    header: pb.BlockHeader, codec: Codec, shape: tuple[int, ...], num_bytes: int
) -> str | None:
    """How a served block's header differs from the block the caller's buffer holds; None when it
    does not."""
    if header.codec != codec:
        return f"served in codec {header.codec}, expected {int(codec)} ({codec.name})"
    if tuple(header.shape) != tuple(shape):
        return f"served as {list(header.shape)}, expected {list(shape)}"
    if header.payload_bytes != num_bytes:
        return f"served {header.payload_bytes:,} B, expected {num_bytes:,} B"
    return None
