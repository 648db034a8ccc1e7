"""Writes to a frozen kvstore hold a bounded amount of host memory: past the write buffer, a new
write is dropped at once (a metric and a span event), and the request goes on.

Against a real kvstore process over a real redis-server, frozen with SIGSTOP (alive, holding its
port, answering nothing), so every put waits out its transfer deadline. Synchronisation is by the
cold tier's barrier (`flush`), never sleeps.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from services.common.kvstore_api import BlockHash, Codec
from services.engine.config import EngineConfig
from services.engine.kv.cold_tier import BlockToStore, ColdTier, ColdTierConfig, Degradation, Job, Operation
from services.engine.kv.write_buffer import WriteBuffer
from tests.engine.kv.test_cold_tier import (
    STORY,
    degradations,
    degraded_events,
    kvstore,
    load_engine,
    run,
)
from tests.kvstore.conftest import KVStoreProcess

__all__ = ["kvstore"]

MIB = 2**20
BLOCK_SHAPE = (2, 16, 4, 256)  # [L, T, KVH, D] fp32: keys and values 128 KiB each, a write 256 KiB


def store_job(index: int) -> Job:
    """A prompt block's write of 256 KiB of host memory."""
    keys = torch.full(BLOCK_SHAPE, float(index))
    block = BlockToStore(BlockHash(f"{index:02x}" * 32), keys, -keys, Codec.RAW)
    return Job(Operation.STORE_PREFIX, f"request {index}", "", (), blocks=(block,))


def test_writes_behind_a_frozen_store_hold_at_most_the_write_buffer(kvstore: KVStoreProcess) -> None:
    config = ColdTierConfig(target=kvstore.target, write_buffer_mb=1, transfer_deadline_ms=120_000)
    tier = ColdTier(config, "m", page_tokens=16)
    assert kvstore.process is not None
    kvstore.process.send_signal(signal.SIGSTOP)
    for index in range(10):
        tier.submit(store_job(index))

    dropped = tier.take_outcomes()  # reported at once, while the four that fit wait for the store
    assert [o.owner for o in dropped] == [f"request {i}" for i in range(4, 10)]
    assert {o.degraded for o in dropped} == {Degradation.DROPPED}
    assert "write buffer full" in dropped[0].detail
    assert tier.num_write_bytes == 1 * MIB
    kvstore.process.send_signal(signal.SIGCONT)
    tier.flush()
    stored = tier.take_outcomes()
    assert sorted(o.owner for o in stored) == [f"request {i}" for i in range(4)]
    assert all(o.degraded is None and len(o.stored) == 1 for o in stored)
    assert tier.num_write_bytes == 0
    tier.submit(store_job(10))  # room again
    tier.flush()
    (again,) = tier.take_outcomes()
    assert again.degraded is None and again.stored == (BlockHash("0a" * 32),)
    tier.close()


def test_a_prompt_whose_blocks_find_no_room_is_served_and_the_drop_counted(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """With room for one write, the first prompt's blocks wait for the frozen store; the second's are
    dropped, and both requests complete."""
    cold = ColdTierConfig(
        target=kvstore.target,
        deadline_ms=300,
        retry_after_s=600,
        transfer_deadline_ms=120_000,
        write_buffer_mb=0,
    )
    engine = load_engine(stories_hf_dir, cold)
    assert engine.cold is not None and kvstore.process is not None
    kvstore.process.send_signal(signal.SIGSTOP)
    before = degradations("store_prefix", "dropped")
    prompts = [engine.tokenizer.encode(STORY.replace("Lily", name) * 2)[:200] for name in ("Sam", "Ann")]

    first, second = (run(engine, prompt) for prompt in prompts)

    assert first.result().error is None and second.result().error is None
    assert degradations("store_prefix", "dropped") == before + 1
    stores = [e for e in degraded_events(second) if e["thermocline.kv.operation"] == "store_prefix"]
    assert [e["thermocline.kv.reason"] for e in stores] == ["dropped"]
    assert engine.cold.tier.num_write_bytes > 0  # the first prompt's blocks, still waiting
    kvstore.process.send_signal(signal.SIGCONT)
    engine.cold.tier.flush()
    assert engine.cold.tier.num_write_bytes == 0
    engine.stop()


def test_one_write_is_taken_when_none_waits_however_large() -> None:
    buffer = WriteBuffer(max_bytes=100)
    assert buffer.take(1000)  # alone: taken
    assert not buffer.take(1)
    buffer.give_back(1000)
    assert buffer.take(60) and buffer.take(40) and not buffer.take(1)


def test_the_write_buffer_is_a_setting() -> None:
    assert EngineConfig.from_env({}).cold.write_buffer_mb == 2048
    environ = {"THERMOCLINE_ENGINE_KVSTORE_WRITE_BUFFER_MB": "64"}
    assert EngineConfig.from_env(environ).cold.write_buffer_mb == 64
