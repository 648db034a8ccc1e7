"""CountTokens' queue in front of its tokenizing pool is bounded: the engine's servicer over
stories260K, served in process on loopback with the services' interceptor, its tokenizer held."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from services.common.interceptors import CallTracker, GuardInterceptor
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.serving.servicer import EngineServicer
from thermocline.engine.v1 import engine_pb2 as pb
from thermocline.engine.v1 import engine_pb2_grpc as pb_grpc

MAX_QUEUED_COUNTS = 3
RELEASE_TIMEOUT_S = 30  # only reached when no count is refused (the failure shown)
HELD_TEXT = "a count held in the tokenizer"


@pytest.fixture(scope="module")
def engine(stories_hf_dir: Path) -> Iterator[LLMEngine]:
    """stories260K on the CPU with its step thread running, as the service runs it."""
    loaded = LLMEngine.load(stories_hf_dir, device="cpu", max_batch_size=2, max_seq_len=64, progress=False)
    loaded.start()
    yield loaded
    loaded.stop()


@contextlib.asynccontextmanager
async def serving(engine: LLMEngine) -> AsyncIterator[pb_grpc.EngineServiceStub]:
    """A stub for `engine`'s servicer, configured as THERMOCLINE_ENGINE_MAX_QUEUED_COUNTS says."""
    config = EngineConfig.from_env(
        {
            "THERMOCLINE_ENGINE_MODEL": "stories260k",
            "THERMOCLINE_ENGINE_MAX_QUEUED_COUNTS": str(MAX_QUEUED_COUNTS),
        }
    )
    server = grpc.aio.server(interceptors=[GuardInterceptor(CallTracker())])
    pb_grpc.add_EngineServiceServicer_to_server(EngineServicer(config, engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.EngineServiceStub(channel)
    finally:
        await server.stop(None)


@pytest.fixture
def released(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Set it to let go of the counts of HELD_TEXT, which wait inside the tokenizer until then (or
    until the test ends, failed or not)."""
    event = threading.Event()
    encode = engine.tokenizer.encode

    def held_encode(text: str, add_bos: bool | None = None) -> list[int]:
        if text == HELD_TEXT:
            event.wait(RELEASE_TIMEOUT_S)
        return encode(text, add_bos)

    monkeypatch.setattr(engine.tokenizer, "encode", held_encode)
    yield event
    event.set()


def test_counts_past_the_queue_bound_are_refused_and_those_queued_are_served(
    engine: LLMEngine, released: threading.Event
) -> None:
    """Five counts while none can finish: three queue (on the pool's thread or waiting for it), two
    are refused at once; once the three are let go they are served, and the queue has room again."""
    num_over = 2

    async def scenario() -> tuple[list[grpc.aio.AioRpcError], list[int], int]:
        async with serving(engine) as stub:
            request = pb.CountTokensRequest(prompt=HELD_TEXT)
            pending = {
                asyncio.ensure_future(stub.CountTokens(request)) for _ in range(MAX_QUEUED_COUNTS + num_over)
            }
            refused: list[grpc.aio.AioRpcError] = []
            while len(refused) < num_over:
                done, pending = await asyncio.wait(
                    pending, timeout=RELEASE_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
                )
                assert done, f"no count was refused while {MAX_QUEUED_COUNTS + num_over} were held"
                refused += [
                    error for call in done if isinstance(error := call.exception(), grpc.aio.AioRpcError)
                ]
            released.set()
            served = [reply.num_tokens for reply in await asyncio.gather(*pending)]
            again = await stub.CountTokens(pb.CountTokensRequest(prompt="once upon a time"))
            return refused, served, again.num_tokens

    refused, served, again = asyncio.run(scenario())
    assert len(refused) == num_over
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert f"already has {MAX_QUEUED_COUNTS} CountTokens calls queued or running" in error.details()
        assert "THERMOCLINE_ENGINE_MAX_QUEUED_COUNTS" in error.details()
    assert served == [len(engine.tokenizer.encode(HELD_TEXT))] * MAX_QUEUED_COUNTS
    assert again > 1
