"""The kvstore as a real process over a real redis-server and real segment files, through gRPC."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1.health_pb2 import HealthCheckResponse

from services.common.kv_codec import codec_format
from services.common.kvstore_api import BlockIn, FetchedBlock
from services.kvstore.blocks import BlockSource, Codec, MissReason
from tests.kvstore.conftest import KVStoreProcess, RedisServer, block_hash, raw_block
from thermocline.kvstore.v1 import kvstore_pb2 as pb
from thermocline.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

NAMES = [f"block-{n}" for n in range(6)]


def test_put_then_get_returns_every_byte_through_chunks(shared_kvstore: KVStoreProcess) -> None:
    blocks = [raw_block(name) for name in NAMES]  # 6000 B each: two 4 KiB chunks per block
    with shared_kvstore.client("tenant-get") as client:
        assert client.put(blocks).stored == [b.block_hash for b in blocks]
        assert client.put(blocks[:2]).duplicates == [b.block_hash for b in blocks[:2]]
        fetched = client.get([b.block_hash for b in blocks])
        assert client.lookup([block_hash("absent"), blocks[3].block_hash]) == [blocks[3].block_hash]
    for block in blocks:
        got = fetched[block.block_hash]
        assert isinstance(got, FetchedBlock) and got.source is BlockSource.DISK
        assert (got.payload, got.codec, got.shape) == (block.payload, block.codec, block.shape)


def test_get_replies_stay_under_the_chunk_size(tmp_path, redis_server: RedisServer) -> None:
    process = KVStoreProcess(tmp_path / "kv", redis_server.url, {"THERMOCLINE_KVSTORE_CHUNK_KB": "4"}).start()
    try:
        big = raw_block("big", num_values=20_000)  # 40,000 B
        with process.client() as client:
            client.put([big])
            request = pb.GetBlocksRequest(
                namespace=pb.Namespace(tenant="tenant-a", model="tiny-llama"), block_hashes=[big.block_hash]
            )
            replies = list(pb_grpc.KVStoreServiceStub(client.channel).GetBlocks(request, timeout=30))
        assert len(replies) == 10 and all(len(r.data) <= 4096 for r in replies)
        assert b"".join(r.data for r in replies) == big.payload
    finally:
        process.stop()


def test_a_long_put_survives_maintenance_passes_while_it_streams(tmp_path, redis_server: RedisServer) -> None:
    """Segments of 16 KiB (two records each) sealed under a 300-record put, and a maintenance pass
    every 50 ms: no pass may take the put's records, indexed only at its commit, for dead."""
    settings = {
        "THERMOCLINE_KVSTORE_SEGMENT_MB": str(16 / 1024),
        "THERMOCLINE_KVSTORE_MAINTENANCE_S": "0.05",
    }
    process = KVStoreProcess(tmp_path / "kv", redis_server.url, settings).start()
    try:
        blocks = [raw_block(f"long-put-{n}") for n in range(300)]
        with process.client() as client:
            assert client.put(blocks).stored == [b.block_hash for b in blocks]
            fetched = client.get([b.block_hash for b in blocks])
        missing = [b.block_hash for b in blocks if not isinstance(fetched[b.block_hash], FetchedBlock)]
        assert not missing, f"{len(missing)} acknowledged blocks lost"
        assert all(fetched[b.block_hash].payload == b.payload for b in blocks)  # type: ignore[union-attr]
    finally:
        process.stop()


def test_one_tenant_never_reads_another_tenants_blocks(shared_kvstore: KVStoreProcess) -> None:
    blocks = [raw_block(name) for name in NAMES]
    hashes = [b.block_hash for b in blocks]
    with shared_kvstore.client("tenant-a") as alice, shared_kvstore.client("tenant-b") as bob:
        alice.put(blocks)
        assert bob.lookup(hashes) == []
        assert bob.get(hashes) == dict.fromkeys(hashes, MissReason.ABSENT)
        assert bob.prefetch(hashes).queued == 0
        assert bob.delete(hashes) == 0
        # the same hash with other bytes is bob's own block, and alice's stays hers
        impostor = raw_block("not alice's")
        forged = type(impostor)(hashes[0], impostor.codec, impostor.shape, impostor.payload)
        assert bob.put([forged]).stored == [hashes[0]]
        assert alice.lookup(hashes) == hashes
        mine = alice.get(hashes[:1])[hashes[0]]
        assert isinstance(mine, FetchedBlock) and mine.payload == blocks[0].payload
    with shared_kvstore.client("tenant-a", model="another-model") as other_model:
        assert other_model.lookup(hashes) == []


def test_prefetched_blocks_are_served_from_ram(shared_kvstore: KVStoreProcess) -> None:
    blocks = [raw_block(name) for name in NAMES]
    hashes = [b.block_hash for b in blocks]
    with shared_kvstore.client("tenant-prefetch") as client:
        client.put(blocks)
        before = client.stats()
        assert client.prefetch([*hashes[:4], block_hash("absent")]).queued == 4
        fetched = client.get(hashes)
        after = client.stats()
    sources = [fetched[h].source for h in hashes]  # type: ignore[union-attr]
    assert sources == [BlockSource.STAGING] * 4 + [BlockSource.DISK] * 2
    assert [fetched[h].payload for h in hashes] == [b.payload for b in blocks]  # type: ignore[union-attr]
    assert after.staged_blocks - before.staged_blocks == 4
    assert (after.staging_hits - before.staging_hits, after.disk_reads - before.disk_reads) == (4, 2)


def test_flushall_rebuilds_the_index_from_the_segments(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    blocks = [raw_block(name) for name in NAMES]
    hashes = [b.block_hash for b in blocks]
    with kvstore.client() as client:
        client.put(blocks)
        assert client.delete(hashes[:2]) == 2
        rebuilds_before = client.stats().index_rebuilds  # a fresh store builds its (empty) index once
        redis_server.client().flushall()
        assert client.lookup(hashes) == hashes[2:]  # deleted blocks stay deleted: their tombstones count
        fetched = client.get(hashes[2:])
        stats = client.stats()
    assert [fetched[h].payload for h in hashes[2:]] == [b.payload for b in blocks[2:]]  # type: ignore[union-attr]
    assert stats.index_rebuilds == rebuilds_before + 1 and stats.num_blocks == 4 and stats.num_segments > 1


def test_a_flipped_byte_is_a_miss_not_a_block(kvstore: KVStoreProcess) -> None:
    blocks = [raw_block(name) for name in NAMES]
    hashes = [b.block_hash for b in blocks]
    with kvstore.client() as client:
        client.put(blocks)
        segment = next(
            p for p in (kvstore.data_dir / "segments").glob("*.seg") if blocks[2].payload in p.read_bytes()
        )
        data = bytearray(segment.read_bytes())
        data[data.index(blocks[2].payload) + 100] ^= 0x01
        segment.write_bytes(bytes(data))
        first, second = client.get(hashes), client.get(hashes[2:3])
        stats = client.stats()
    assert first[hashes[2]] is MissReason.CORRUPT
    assert second[hashes[2]] is MissReason.ABSENT  # its entry is gone from the index
    assert all(first[h].payload == b.payload for h, b in zip(hashes, blocks, strict=True) if h != hashes[2])  # type: ignore[union-attr]
    assert stats.corrupt_records == 1


def test_redis_down_is_unavailable_and_a_fresh_redis_is_rebuilt(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    blocks = [raw_block(name) for name in NAMES]
    with kvstore.client() as client:
        client.put(blocks)
        redis_server.stop()
        with pytest.raises(grpc.RpcError) as caught:
            client.lookup([blocks[0].block_hash])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "fall back to their hot and warm tiers" in caught.value.details()
        redis_server.start()  # same port, empty: Redis lost everything
        assert client.lookup([b.block_hash for b in blocks]) == [b.block_hash for b in blocks]


def test_readiness_follows_redis_and_liveness_stays(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    """While Redis is down every call fails UNAVAILABLE: the service's name (readiness) says
    NOT_SERVING so routers move away, and "" (liveness) stays SERVING, since a restart mends nothing."""
    service = pb.DESCRIPTOR.services_by_name["KVStoreService"].full_name
    kvstore.wait_health(service, HealthCheckResponse.SERVING)
    redis_server.stop()
    kvstore.wait_health(service, HealthCheckResponse.NOT_SERVING)
    assert kvstore.health("") == HealthCheckResponse.SERVING
    redis_server.start()
    kvstore.wait_health(service, HealthCheckResponse.SERVING)


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([pb.PutBlocksRequest(data=b"x")], "first message must carry the namespace"),
        (
            [pb.PutBlocksRequest(namespace=pb.Namespace(tenant="t", model="m"), data=b"x")],
            "before any BlockHeader",
        ),
        (
            [
                pb.PutBlocksRequest(
                    namespace=pb.Namespace(tenant="t", model="m"),
                    header=pb.BlockHeader(block_hash="NOT-HEX", codec=1, shape=[1], payload_bytes=2),
                )
            ],
            "lowercase hex",
        ),
        (
            [
                pb.PutBlocksRequest(
                    namespace=pb.Namespace(tenant="t", model="m"),
                    header=pb.BlockHeader(block_hash="ab" * 8, codec=1, shape=[4], payload_bytes=2),
                    data=b"xy",
                )
            ],
            "is 8 B of BF16",
        ),
        (
            [
                pb.PutBlocksRequest(
                    namespace=pb.Namespace(tenant="t", model="m"),
                    header=pb.BlockHeader(
                        block_hash="ab" * 8, codec=2, shape=[1, 2, 1, 1, 4], payload_bytes=4
                    ),
                    data=b"junk",
                )
            ],
            "shorter than its",
        ),
        (
            [
                pb.PutBlocksRequest(
                    namespace=pb.Namespace(tenant="t", model="m"),
                    header=pb.BlockHeader(block_hash="ab" * 8, codec=1, shape=[1], payload_bytes=2),
                    data=b"x",
                )
            ],
            "stream ended after 1 of",
        ),
        (
            [
                pb.PutBlocksRequest(
                    namespace=pb.Namespace(tenant="t", model="m"),
                    header=pb.BlockHeader(block_hash="ab" * 8, codec=1, shape=[1], payload_bytes=1 << 40),
                )
            ],
            "the limit is",
        ),
        (
            [
                pb.PutBlocksRequest(
                    namespace=pb.Namespace(tenant="t", model="m"),
                    header=pb.BlockHeader(block_hash="ab" * 8, codec=3, shape=[1], payload_bytes=2),
                )
            ],
            "use CODEC_RAW (1) or CODEC_INT2_SPARSE (2)",
        ),
    ],
    ids=[
        "no-namespace",
        "data-first",
        "bad-hash",
        "raw-size",
        "int2-garbage",
        "cut-short",
        "too-big",
        "codec",
    ],
)
def test_malformed_puts_are_invalid_argument_and_harmless(
    shared_kvstore: KVStoreProcess, requests: list[pb.PutBlocksRequest], message: str
) -> None:
    with shared_kvstore.client() as client:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.KVStoreServiceStub(client.channel).PutBlocks(iter(requests), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()
        result = client.put([raw_block("after")])  # still serving
        assert result.stored + result.duplicates == [block_hash("after")]


@pytest.mark.parametrize(
    ("namespace", "hashes", "message"),
    [
        (pb.Namespace(tenant="", model="m"), ["ab" * 8], "namespace.tenant is required"),
        (pb.Namespace(tenant="t", model="m"), ["xyz"], "lowercase hex"),
        (pb.Namespace(tenant="t", model="m"), ["ab" * 8] * 5000, "split the call"),
    ],
    ids=["no-tenant", "bad-hash", "too-many"],
)
def test_malformed_reads_are_invalid_argument(
    shared_kvstore: KVStoreProcess, namespace: pb.Namespace, hashes: list[str], message: str
) -> None:
    with shared_kvstore.client() as client:
        stub = pb_grpc.KVStoreServiceStub(client.channel)
        for call in (stub.Lookup, stub.Prefetch, stub.Delete):
            request_type = {stub.Lookup: pb.LookupRequest, stub.Prefetch: pb.PrefetchRequest}.get(
                call, pb.DeleteRequest
            )
            with pytest.raises(grpc.RpcError) as caught:
                call(request_type(namespace=namespace, block_hashes=hashes), timeout=30)
            assert (
                caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()
            )
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.GetBlocks(pb.GetBlocksRequest(namespace=namespace, block_hashes=hashes), timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def int2_block(name: str, num_kept: int, mask: list[bool]) -> BlockIn:
    """An INT2-sparse block of 8 tokens whose header keeps `num_kept` and whose mask keeps `mask`
    (codes and scales zero: the store checks a payload's layout, never its numbers)."""
    layout = codec_format.BlockLayout(
        1, len(mask), 1, 4, num_kept, 32, codec_format.ScaleDtype.FLOAT16, codec_format.SparsityTier.TOP_K
    )
    head = codec_format.pack_header(layout, np.array(mask))
    payload = head + bytes(layout.payload_bytes - len(head))
    return BlockIn(block_hash(name), Codec.INT2_SPARSE, tuple(layout.dense_shape), payload)


def test_an_int2_block_whose_mask_disagrees_with_its_kept_count_is_refused(
    shared_kvstore: KVStoreProcess,
) -> None:
    """The engine would drop such a block as corrupt when it decodes it: the put says so instead."""
    mask = [True, False] * 4  # 4 of 8 tokens
    with shared_kvstore.client() as client:
        assert client.put([int2_block("mask-agrees", 4, mask)]).stored == [block_hash("mask-agrees")]
        with pytest.raises(grpc.RpcError) as refused:
            client.put([int2_block("mask-disagrees", 5, mask)])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "keeps 4 tokens" in refused.value.details()


def test_codec_of_a_stored_block_is_kept(shared_kvstore: KVStoreProcess) -> None:
    torch = pytest.importorskip("torch")
    from services.common.kv_codec.codec import decode_block, encode_block, read_layout
    from services.kvstore.blocks import BlockIn

    keys, values = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    payload = encode_block(keys, values, torch.rand(16))
    block = BlockIn(block_hash("int2"), Codec.INT2_SPARSE, tuple(read_layout(payload).dense_shape), payload)
    with shared_kvstore.client() as client:
        client.put([block])
        got = client.get([block.block_hash])[block.block_hash]
    assert isinstance(got, FetchedBlock) and got.codec is Codec.INT2_SPARSE and got.shape == (2, 2, 16, 2, 8)
    assert torch.equal(decode_block(got.payload).keys, decode_block(payload).keys)


def test_a_kvstore_started_before_redis_serves_once_redis_is_up(tmp_path) -> None:
    redis_server = RedisServer(tmp_path)  # its port is chosen, nothing listens on it yet
    process = KVStoreProcess(tmp_path / "kv", redis_server.url).start()
    try:
        with process.client() as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.lookup([block_hash("early")])
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            redis_server.start()
            assert client.put([raw_block("early")]).stored == [block_hash("early")]
    finally:
        process.stop()
        redis_server.stop()
