"""The index in Redis is checked before it is trusted: a Redis that comes back from an older
snapshot (it lacks acknowledged puts and deletes, but its marker is there) is rebuilt from the
segments, whether the store was running or starting, and compaction never deletes a segment on
its word. A Redis that lost nothing is trusted as it is (no rebuild at every restart)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NamedTuple

from services.common.kvstore_api import FetchedBlock, KVStoreClient
from services.kvstore.blocks import BlockIn, MissReason
from services.kvstore.compactor import Compactor
from services.kvstore.keys import BlockHash, Namespace
from services.kvstore.segments import list_segments
from services.kvstore.store import BlockStore
from tests.kvstore.conftest import KVStoreProcess, RedisServer, raw_block, run_store

NAMESPACE = Namespace("tenant-a", "tiny-llama")


class WritesPastSnapshot(NamedTuple):
    """Three acknowledged writes that a Redis snapshot falls behind: it still holds `deleted` and
    lacks `later`; only `kept` is the same in the snapshot and in the store."""

    deleted: BlockIn
    kept: BlockIn
    later: BlockIn

    @property
    def hashes(self) -> list[BlockHash]:
        """The three blocks' hashes, in field order."""
        return [block.block_hash for block in self]

    @property
    def live_hashes(self) -> list[BlockHash]:
        """What an index that lost no acknowledged write finds: `kept` and `later`."""
        return [self.kept.block_hash, self.later.block_hash]


def write_past_a_snapshot(client: KVStoreClient, redis_server: RedisServer) -> WritesPastSnapshot:
    """Puts two blocks, has Redis save the snapshot it will come back from, then puts a third and
    deletes the first."""
    writes = WritesPastSnapshot(raw_block("deleted"), raw_block("kept"), raw_block("put-after-the-snapshot"))
    client.put([writes.deleted, writes.kept])
    redis_server.client().save()
    client.put([writes.later])
    assert client.delete([writes.deleted.block_hash]) == 1
    return writes


def test_a_redis_back_from_an_older_snapshot_under_a_running_store_is_rebuilt(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    with kvstore.client() as client:
        writes = write_past_a_snapshot(client, redis_server)
        rebuilds_before = client.stats().index_rebuilds
        redis_server.restart()
        assert client.lookup(writes.hashes) == writes.live_hashes
        fetched = client.get(writes.hashes)
        assert client.stats().index_rebuilds == rebuilds_before + 1
    assert fetched[writes.deleted.block_hash] is MissReason.ABSENT  # an acknowledged delete stays deleted
    served = fetched[writes.later.block_hash]
    assert isinstance(served, FetchedBlock) and served.payload == writes.later.payload


def test_a_store_started_on_a_redis_back_from_an_older_snapshot_rebuilds(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    with kvstore.client() as client:
        writes = write_past_a_snapshot(client, redis_server)
    kvstore.stop()
    redis_server.restart()
    kvstore.start()
    with kvstore.client() as client:
        assert client.lookup(writes.hashes) == writes.live_hashes
        assert client.stats().index_rebuilds == 1


def test_an_index_that_lost_nothing_is_trusted_without_a_rebuild(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    """A restart of the store alone, and a Redis back from a snapshot taken after the store's
    clean close, both hold every acknowledged write: no rebuild (a rebuild blocks every call)."""
    blocks = [raw_block(f"block-{n}") for n in range(4)]
    hashes = [b.block_hash for b in blocks]
    with kvstore.client() as client:
        client.put(blocks)
        assert client.delete(hashes[:1]) == 1
    kvstore.stop()
    kvstore.start()
    with kvstore.client() as client:
        assert client.lookup(hashes) == hashes[1:]
        assert client.stats().index_rebuilds == 0
    kvstore.stop()
    redis_server.client().save()  # after the clean close: the snapshot holds everything
    redis_server.restart()
    kvstore.start()
    with kvstore.client() as client:
        assert client.lookup(hashes) == hashes[1:]
        assert client.stats().index_rebuilds == 0


def test_compaction_never_deletes_a_segment_on_the_word_of_a_stale_index(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Blocks put after the snapshot are in no segment's live count of the stale index, so their
    segments look dead: compacting them would lose acknowledged blocks even for a later rebuild."""

    async def scenario(store: BlockStore) -> None:
        kept = [raw_block(f"kept-{n}") for n in range(2)]
        await store.put(NAMESPACE, kept)
        await store.index.client.save()
        later = [raw_block(f"later-{n}") for n in range(6)]  # two records fill an 8 KiB segment
        await store.put(NAMESPACE, later)
        assert await store.delete(NAMESPACE, [kept[0].block_hash]) == 1
        segments = list_segments(store.config.segments_dir)
        await asyncio.to_thread(redis_server.restart)
        result = await Compactor(store).compact()
        assert result.num_segments == 0 and list_segments(store.config.segments_dir) == segments
        hashes = [b.block_hash for b in kept + later]
        assert await store.lookup(NAMESPACE, hashes) == hashes[1:]

    run_store(tmp_path, redis_server, scenario, max_segment_bytes=8192)
