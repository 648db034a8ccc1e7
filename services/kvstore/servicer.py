"""The kvstore's gRPC face: protobuf in, a BlockStore call, protobuf out.

Errors are raised as `services.common.errors` types; the shared interceptor turns them into
status codes (INVALID_ARGUMENT for a malformed call, UNAVAILABLE while Redis is unreachable).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from opentelemetry import trace

from services.common.errors import InvalidArgument, Unavailable
from services.kvstore import kvstore_metrics as metrics
from services.kvstore.blocks import BlockFound, BlockIn, Codec
from services.kvstore.compactor import Compactor
from services.kvstore.config import KVStoreConfig
from services.kvstore.dir_lock import DataDirLock
from services.kvstore.keys import Namespace, check_hash
from services.kvstore.results import BlockLocated, StoreStats
from services.kvstore.store import BlockStore
from services.kvstore.streams import StreamSlots, within_idle_limit
from thermocline.kvstore.v1 import kvstore_pb2 as pb
from thermocline.kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def namespace_from_pb(namespace: pb.Namespace) -> Namespace:
    """The call's namespace, checked."""
    return Namespace(namespace.tenant, namespace.model)


class BlockAssembler:
    """Reassembles a PutBlocks stream's chunks into blocks, refusing streams that break the framing."""

    def __init__(self, max_block_bytes: int) -> None:
        self.max_block_bytes = max_block_bytes
        self.namespace: Namespace | None = None
        self._header: pb.BlockHeader | None = None
        self._parts: list[bytes] = []
        self._num_bytes = 0

    def feed(self, request: pb.PutBlocksRequest) -> BlockIn | None:
        """Takes one message; returns a block when this message completed one."""
        self._take_namespace(request)
        if request.HasField("header"):
            self._start(request.header)
        if request.data:
            if self._header is None:
                raise InvalidArgument(
                    "PutBlocks: payload bytes arrived before any BlockHeader; send a header first"
                )
            self._parts.append(request.data)
            self._num_bytes += len(request.data)
        return self._complete()

    def _take_namespace(self, request: pb.PutBlocksRequest) -> None:
        if request.HasField("namespace"):
            namespace = namespace_from_pb(request.namespace)
            if self.namespace is not None and namespace != self.namespace:
                raise InvalidArgument("PutBlocks: one stream holds one namespace; open another stream for it")
            self.namespace = namespace
        elif self.namespace is None:
            raise InvalidArgument("PutBlocks: the first message must carry the namespace (tenant and model)")

    def _start(self, header: pb.BlockHeader) -> None:
        if self._header is not None:
            raise InvalidArgument(
                f"PutBlocks: block {self._header.block_hash} got only {self._num_bytes} of its "
                f"{self._header.payload_bytes} payload bytes before the next header"
            )
        check_hash(header.block_hash)
        if header.codec not in Codec._value2member_map_:
            raise InvalidArgument(
                f"PutBlocks: block {header.block_hash} has codec {header.codec}; use CODEC_RAW (1) or "
                "CODEC_INT2_SPARSE (2)"
            )
        if header.payload_bytes > self.max_block_bytes:
            raise InvalidArgument(
                f"PutBlocks: block {header.block_hash} declares {header.payload_bytes} B; the limit is "
                f"{self.max_block_bytes} B (THERMOCLINE_KVSTORE_MAX_BLOCK_MB)"
            )
        self._header, self._parts, self._num_bytes = header, [], 0

    def _complete(self) -> BlockIn | None:
        header = self._header
        if header is None or self._num_bytes < header.payload_bytes:
            return None
        if self._num_bytes > header.payload_bytes:
            raise InvalidArgument(
                f"PutBlocks: block {header.block_hash} got {self._num_bytes} B; its header says "
                f"{header.payload_bytes} B"
            )
        self._header = None
        payload = b"".join(self._parts)
        return BlockIn(check_hash(header.block_hash), Codec(header.codec), tuple(header.shape), payload)

    def finish(self) -> None:
        """The stream ended: a block cut short is an error, and so is a stream without a namespace."""
        if self._header is not None:
            raise InvalidArgument(
                f"PutBlocks: the stream ended after {self._num_bytes} of block {self._header.block_hash}'s "
                f"{self._header.payload_bytes} payload bytes"
            )


def block_chunks(found: BlockFound, chunk_bytes: int) -> Iterator[pb.GetBlocksResponse]:
    """One served block as reply messages: the header with the first chunk, then the rest, each
    copied out of the payload only when it is sent (not the whole block up front)."""
    record = found.record
    header = pb.BlockHeader(
        block_hash=found.block_hash, codec=record.codec, shape=record.shape, payload_bytes=len(record.payload)
    )
    payload = memoryview(record.payload)
    yield pb.GetBlocksResponse(header=header, data=bytes(payload[:chunk_bytes]), source=found.source)
    for start in range(chunk_bytes, len(payload), chunk_bytes):
        yield pb.GetBlocksResponse(data=bytes(payload[start : start + chunk_bytes]))


def stats_to_pb(stats: StoreStats) -> pb.GetStatsResponse:
    """Stats as the wire carries them."""
    c = stats.counters
    return pb.GetStatsResponse(
        num_blocks=stats.num_blocks,
        used_bytes=stats.used_bytes,
        capacity_bytes=stats.capacity_bytes,
        staged_blocks=stats.staged_blocks,
        staged_bytes=stats.staged_bytes,
        disk_bytes=stats.disk_bytes,
        num_segments=stats.num_segments,
        evicted_blocks=c.evicted_blocks,
        expired_blocks=c.expired_blocks,
        corrupt_records=c.corrupt_records,
        compacted_segments=c.compacted_segments,
        staging_hits=c.staging_hits,
        disk_reads=c.disk_reads,
        index_rebuilds=c.index_rebuilds,
        located_blocks=c.located_blocks,
    )


def location_to_pb(located: BlockLocated) -> pb.BlockLocation:
    """A located block as the wire carries it."""
    return pb.BlockLocation(
        block_hash=located.block_hash,
        codec=located.codec,
        segment_path=str(located.segment_path),
        segment_id=located.location.segment_id,
        offset=located.location.offset,
        length=located.location.length,
    )


class KVStoreServicer(pb_grpc.KVStoreServiceServicer):
    """The block RPCs over one BlockStore."""

    def __init__(self, config: KVStoreConfig, dir_lock: DataDirLock | None = None) -> None:
        self.config = config
        self._dir_lock = dir_lock  # taken by the process before it serves; the store releases it
        self._store: BlockStore | None = None
        self.compactor: Compactor | None = None
        self.streams = StreamSlots(config.store.max_streams)

    async def start(self) -> None:
        """Opens the store (rebuilding the index if Redis lost it) and starts its maintenance."""
        self._store = await BlockStore.open(self.config.store, self._dir_lock)
        self.compactor = Compactor(self._store)
        self.compactor.start()

    async def stop(self) -> None:
        """Stops maintenance and closes the store."""
        if self.compactor is not None:
            await self.compactor.stop()
        if self._store is not None:
            await self._store.close()

    def readiness_problem(self) -> str | None:
        """Why the kvstore should get no traffic now (its index is unreachable), or None; polled
        for readiness only: a restart does not bring Redis back."""
        if self._store is None:
            return "it is still opening its segments"
        return self._store.index_problem

    @property
    def store(self) -> BlockStore:
        """The open store; UNAVAILABLE until it is."""
        if self._store is None:
            raise Unavailable("the kvstore is still opening its segments; retry shortly")
        return self._store

    async def PutBlocks(self, request_iterator: AsyncIterator[pb.PutBlocksRequest], context: Any) -> Any:
        started, store, settings = time.perf_counter(), self.store, self.config.store
        assembler = BlockAssembler(settings.max_block_bytes)
        requests = within_idle_limit(request_iterator, settings.stream_idle_s, "PutBlocks")
        # the compactor leaves the put's records alone until it commits (BlockStore.writing)
        with self.streams.open("put"), store.writing() as put:
            async for request in requests:
                block = assembler.feed(request)
                if block is not None:
                    assert assembler.namespace is not None
                    await store.append(put, assembler.namespace, block)
            assembler.finish()
            result = await store.commit(put)
        _annotate(len(result.stored) + len(result.duplicates))
        metrics.OPERATION_DURATION.labels("put").observe(time.perf_counter() - started)
        return pb.PutBlocksResponse(stored_hashes=result.stored, duplicate_hashes=result.duplicates)

    async def GetBlocks(self, request: pb.GetBlocksRequest, context: Any) -> AsyncIterator[Any]:
        _annotate(len(request.block_hashes))
        namespace = namespace_from_pb(request.namespace)
        with self.streams.open("get"):
            async for outcome in self.store.get(namespace, list(request.block_hashes)):
                if isinstance(outcome, BlockFound):
                    for reply in block_chunks(outcome, self.config.store.chunk_bytes):
                        yield reply
                else:
                    yield pb.GetBlocksResponse(missing_hash=outcome.block_hash, miss_reason=outcome.reason)

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> Any:
        _annotate(len(request.block_hashes))
        with metrics.OPERATION_DURATION.labels("lookup").time():
            present = await self.store.lookup(
                namespace_from_pb(request.namespace), list(request.block_hashes)
            )
        return pb.LookupResponse(present_hashes=present)

    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> Any:
        _annotate(len(request.block_hashes))
        with metrics.OPERATION_DURATION.labels("prefetch").time():
            result = await self.store.prefetch(
                namespace_from_pb(request.namespace), list(request.block_hashes)
            )
        return pb.PrefetchResponse(queued=result.queued, already_staged=result.already_staged)

    async def Delete(self, request: pb.DeleteRequest, context: Any) -> Any:
        _annotate(len(request.block_hashes))
        with metrics.OPERATION_DURATION.labels("delete").time():
            deleted = await self.store.delete(
                namespace_from_pb(request.namespace), list(request.block_hashes)
            )
        return pb.DeleteResponse(deleted=deleted)

    async def LocateBlocks(self, request: pb.LocateBlocksRequest, context: Any) -> Any:
        _annotate(len(request.block_hashes))
        with metrics.OPERATION_DURATION.labels("locate").time():
            located = await self.store.locate(
                namespace_from_pb(request.namespace), list(request.block_hashes)
            )
        return pb.LocateBlocksResponse(locations=[location_to_pb(b) for b in located])

    async def GetStats(self, request: pb.GetStatsRequest, context: Any) -> Any:
        return stats_to_pb(await self.store.stats())


def _annotate(num_blocks: int) -> None:
    """The block count on the RPC's server span, so a trace shows how much each hop asked for."""
    trace.get_current_span().set_attribute("thermocline.kvstore.num_blocks", num_blocks)


def register(server: grpc.aio.Server, servicer: KVStoreServicer) -> list[str]:
    """Adds the kvstore servicer; returns its full service name."""
    pb_grpc.add_KVStoreServiceServicer_to_server(servicer, server)
    metrics.init_kvstore_metrics(servicer.config.capacity_bytes)
    return [pb.DESCRIPTOR.services_by_name["KVStoreService"].full_name]
