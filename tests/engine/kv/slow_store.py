"""A kvstore that is slow on purpose: a real gRPC server of the KVStore service, in the test process.

It fakes only the store's timing (and what it serves), for tests of the engine's client above it:
Lookup says every block is present at once, while GetBlocks for chosen hashes stalls until the test
releases it (or the caller's deadline ends the call), as a store does whose disk is slow, whose
prefix is huge, or that stalls between the two calls. Other hashes are served from `blocks`, or
missed. Puts are taken and acknowledged; or, with `stall_puts`, held like a frozen store's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from services.common.kvstore_api import BlockSource, Codec
from thermocline.kvstore.v1 import kvstore_pb2 as pb
from thermocline.kvstore.v1 import kvstore_pb2_grpc as pb_grpc


class SlowStore(pb_grpc.KVStoreServiceServicer):
    """The servicer; `serve` starts it on a loopback port, `release` ends every stall."""

    def __init__(self) -> None:
        self.stalled_hashes: set[str] = set()  # a GetBlocks that asks for one of these stalls
        self.stall_every_get = False  # every GetBlocks stalls
        self.stall_puts = False
        self.blocks: dict[str, tuple[Codec, tuple[int, ...], bytes]] = {}  # what GetBlocks serves
        self.num_stalled_calls = 0
        self._lock = threading.Lock()
        self._is_released = False
        self._stalls: list[threading.Event] = []
        self._server: grpc.Server | None = None
        self.target = ""

    def serve(self) -> SlowStore:
        """Start the server on a free loopback port (`target`)."""
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_KVStoreServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.target = f"127.0.0.1:{port}"
        return self

    def release(self) -> None:
        """End every stall, now and later: stalled calls go on and answer."""
        with self._lock:
            self._is_released = True
            for stall in self._stalls:
                stall.set()

    def stop(self) -> None:
        """Release the stalls and stop the server."""
        self.release()
        if self._server is not None:
            self._server.stop(grace=None)

    def _stall(self, context: grpc.ServicerContext) -> bool:
        """Hold the call until `release` (True) or until its caller's deadline ends it (False)."""
        ended = threading.Event()
        with self._lock:
            if self._is_released:
                return True
            self.num_stalled_calls += 1
            self._stalls.append(ended)
        context.add_callback(ended.set)
        ended.wait()
        with self._lock:
            return self._is_released

    # --- the RPCs ------------------------------------------------------------------------------

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        return pb.LookupResponse(present_hashes=request.block_hashes)

    def LocateBlocks(self, request: pb.LocateBlocksRequest, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this store hands out no locations")

    def GetBlocks(
        self, request: pb.GetBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetBlocksResponse]:
        is_stalled = self.stall_every_get or bool(self.stalled_hashes & set(request.block_hashes))
        if is_stalled and not self._stall(context):
            return
        for block_hash in request.block_hashes:
            if block_hash not in self.blocks:
                yield pb.GetBlocksResponse(missing_hash=block_hash, miss_reason=pb.MISS_REASON_ABSENT)
                continue
            codec, shape, payload = self.blocks[block_hash]
            header = pb.BlockHeader(
                block_hash=block_hash, codec=codec, shape=shape, payload_bytes=len(payload)
            )
            yield pb.GetBlocksResponse(header=header, data=payload, source=BlockSource.DISK)

    def PutBlocks(
        self, request_iterator: Iterator[pb.PutBlocksRequest], context: grpc.ServicerContext
    ) -> pb.PutBlocksResponse:
        if self.stall_puts and not self._stall(context):
            return pb.PutBlocksResponse()
        stored = [r.header.block_hash for r in request_iterator if r.HasField("header")]
        return pb.PutBlocksResponse(stored_hashes=stored)

    def Prefetch(self, request: pb.PrefetchRequest, context: grpc.ServicerContext) -> pb.PrefetchResponse:
        return pb.PrefetchResponse()

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        return pb.DeleteResponse()
