"""The kvstore's gRPC face. The cold tier's storage arrives in its own change; until then every
block RPC answers UNIMPLEMENTED, so no caller mistakes it for a store that holds data."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from services.common.errors import Unimplemented
from services.kvstore.config import KVStoreConfig
from services.kvstore.kvstore_metrics import init_kvstore_metrics
from thermocline.kvstore.v1 import kvstore_pb2 as pb
from thermocline.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

_NOT_YET = "this kvstore version does not store blocks yet; the engine keeps its KV cache in device memory"


class KVStoreServicer(pb_grpc.KVStoreServiceServicer):
    """Answers the block RPCs honestly until the segment store exists."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config

    async def PutBlocks(self, request_iterator: AsyncIterator[pb.PutBlocksRequest], context: Any) -> Any:
        raise Unimplemented(f"PutBlocks: {_NOT_YET}")

    async def GetBlocks(self, request: pb.GetBlocksRequest, context: Any) -> AsyncIterator[Any]:
        _annotate(len(request.block_hashes))
        raise Unimplemented(f"GetBlocks: {_NOT_YET}")
        yield  # pragma: no cover - makes this an async generator, as a streaming RPC must be

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> Any:
        _annotate(len(request.block_hashes))
        raise Unimplemented(f"Lookup: {_NOT_YET}")

    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> Any:
        _annotate(len(request.block_hashes))
        raise Unimplemented(f"Prefetch: {_NOT_YET}")

    async def Delete(self, request: pb.DeleteRequest, context: Any) -> Any:
        raise Unimplemented(f"Delete: {_NOT_YET}")

    async def GetStats(self, request: pb.GetStatsRequest, context: Any) -> Any:
        raise Unimplemented(f"GetStats: {_NOT_YET}")


def _annotate(num_blocks: int) -> None:
    """The block count on the RPC's server span, so a trace shows how much each hop asked for."""
    trace.get_current_span().set_attribute("thermocline.kvstore.num_blocks", num_blocks)


def register(server: grpc.aio.Server, config: KVStoreConfig) -> list[str]:
    """Adds the kvstore servicer; returns its full service name."""
    pb_grpc.add_KVStoreServiceServicer_to_server(KVStoreServicer(config), server)
    init_kvstore_metrics(config.capacity_bytes)
    return [pb.DESCRIPTOR.services_by_name["KVStoreService"].full_name]
