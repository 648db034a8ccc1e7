"""Block streams are bounded: at most THERMOCLINE_KVSTORE_MAX_STREAMS at once (one more is
RESOURCE_EXHAUSTED), a put stream that idles is ended, and an open put stream holds back
compaction only for the segments holding what it wrote."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from services.kvstore.blocks import BlockIn
from tests.kvstore.conftest import (
    STARTUP_TIMEOUT_S,
    KVStoreProcess,
    RedisServer,
    block_hash,
    raw_block,
    wait_until,
    with_metrics,
)
from thermocline.kvstore.v1 import kvstore_pb2 as pb
from thermocline.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

NAMESPACE = pb.Namespace(tenant="tenant-a", model="tiny-llama")
IN_FLIGHT = "thermocline_rpc_server_in_flight_requests"


def put_messages(block: BlockIn, num_bytes: int | None = None) -> list[pb.PutBlocksRequest]:
    """A put of `block` (its first `num_bytes` payload bytes only, when given), namespace first."""
    header = pb.BlockHeader(
        block_hash=block.block_hash, codec=block.codec, shape=block.shape, payload_bytes=len(block.payload)
    )
    return [
        pb.PutBlocksRequest(namespace=NAMESPACE),
        pb.PutBlocksRequest(header=header, data=block.payload[:num_bytes]),
    ]


class StalledPut:
    """A PutBlocks stream that sends `messages` and then nothing until `release` (a hung client
    with no deadline of its own worth speaking of); `error` is how the call ended, if not OK."""

    def __init__(self, kvstore: KVStoreProcess, messages: list[pb.PutBlocksRequest]) -> None:
        self.release = threading.Event()
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run, args=(kvstore, messages), daemon=True)
        self._thread.start()

    def _run(self, kvstore: KVStoreProcess, messages: list[pb.PutBlocksRequest]) -> None:
        def requests() -> Iterator[pb.PutBlocksRequest]:
            yield from messages
            self.release.wait()

        with kvstore.channel() as channel:
            try:
                pb_grpc.KVStoreServiceStub(channel).PutBlocks(requests(), timeout=300)
            except grpc.RpcError as error:
                self.error = error

    def end(self) -> None:
        """Lets the client finish, and waits for the call to end."""
        self.release.set()
        self.join()

    def join(self) -> bool:
        """Waits for the call to end (the store ending it); whether it did within the startup timeout."""
        self._thread.join(STARTUP_TIMEOUT_S)
        return not self._thread.is_alive()


def in_flight(kvstore: KVStoreProcess) -> float:
    """RPCs the process is serving now."""
    return kvstore.metric(IN_FLIGHT) or 0.0


@pytest.fixture
def limited_kvstore(tmp_path, redis_server: RedisServer) -> Iterator[KVStoreProcess]:
    """A kvstore that serves two block streams at once, and ends a put idle for 2 s."""
    env = with_metrics({"THERMOCLINE_KVSTORE_MAX_STREAMS": "2", "THERMOCLINE_KVSTORE_STREAM_IDLE_S": "2"})
    process = KVStoreProcess(tmp_path / "kvstore", redis_server.url, env)
    yield process.start()
    process.stop()


def test_a_stream_past_the_limit_is_refused_with_resource_exhausted(limited_kvstore: KVStoreProcess) -> None:
    stalled = [StalledPut(limited_kvstore, put_messages(raw_block(f"stalled-{n}"), 100)) for n in range(2)]
    try:
        wait_until(lambda: in_flight(limited_kvstore) == 2, "both stalled puts to be served")
        with limited_kvstore.client() as client:
            for call in (lambda: client.put([raw_block("third")]), lambda: client.get([block_hash("x")])):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "THERMOCLINE_KVSTORE_MAX_STREAMS" in refused.value.details()
            assert limited_kvstore.metric("thermocline_kvstore_streams_refused_total", rpc="put") == 1
            stalled[0].end()
            assert client.put([raw_block("third")]).stored == [block_hash("third")]  # a slot is free again
    finally:
        for put in stalled:
            put.end()


def test_a_put_stream_that_idles_is_ended_and_frees_its_slot(limited_kvstore: KVStoreProcess) -> None:
    stalled = StalledPut(limited_kvstore, put_messages(raw_block("idle"), 100))
    try:
        assert stalled.join(), "the store never ended a put stream that sent nothing more"
        assert stalled.error is not None and stalled.error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "THERMOCLINE_KVSTORE_STREAM_IDLE_S" in stalled.error.details()
        assert in_flight(limited_kvstore) == 0
    finally:
        stalled.end()


def test_an_open_put_stream_does_not_stop_compaction(tmp_path, redis_server: RedisServer) -> None:
    """A put stream that wrote one block and then waits (a hung engine thread, a client with no
    deadline) holds back only the segment holding that block; dead space elsewhere is reclaimed."""
    env = with_metrics(
        {"THERMOCLINE_KVSTORE_SEGMENT_MB": "0.01", "THERMOCLINE_KVSTORE_MAINTENANCE_S": "0.05"}
    )
    kvstore = KVStoreProcess(tmp_path / "kvstore", redis_server.url, env).start()
    stalled = StalledPut(kvstore, [*put_messages(raw_block("written-then-stalled"))])
    try:
        wait_until(lambda: in_flight(kvstore) == 1, "the stalled put to be served")
        with kvstore.client() as client:
            for n in range(8):
                blocks = [raw_block(f"churn-{n}-{part}") for part in range(3)]
                client.put(blocks)
                assert client.delete([b.block_hash for b in blocks]) == 3
            wait_until(
                lambda: client.stats().num_segments <= 4, "compaction to reclaim the dead segments", 30
            )
        stalled.end()
        assert stalled.error is None  # the stalled put's block commits once it ends
        with kvstore.client() as client:
            assert client.lookup([block_hash("written-then-stalled")]) == [block_hash("written-then-stalled")]
    finally:
        stalled.end()
        kvstore.stop()
