"""One kvstore process per data dir: a second one over the same dir refuses to start, with a
message that names the holder, and leaves the first one's segments alone."""

from __future__ import annotations

from services.common.kvstore_api import FetchedBlock
from tests.kvstore.conftest import SMALL_SEGMENTS, KVStoreProcess, RedisServer, raw_block


def test_a_second_kvstore_on_the_same_data_dir_exits_with_a_clear_message(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    before = raw_block("before-the-second-process")
    with kvstore.client() as client:
        client.put([before])
    # with a pass every 50 ms, a second process that started would compact the first one's active
    # segment (it looks sealed from there) and delete it under the first
    second = KVStoreProcess(
        kvstore.data_dir, redis_server.url, SMALL_SEGMENTS | {"THERMOCLINE_KVSTORE_MAINTENANCE_S": "0.05"}
    )
    exit_code = second.start_or_exit()
    if exit_code is None:
        second.stop()
    assert exit_code not in (None, 0)
    assert kvstore.process is not None
    assert f"is in use by another kvstore process (pid {kvstore.process.pid} on" in second.log_tail()
    assert "Traceback" not in second.log_tail()
    after = raw_block("after-the-second-process")
    with kvstore.client() as client:
        assert client.put([after]).stored == [after.block_hash]
        fetched = client.get([before.block_hash, after.block_hash])
    assert [f.payload for f in fetched.values() if isinstance(f, FetchedBlock)] == [
        before.payload,
        after.payload,
    ]
