"""A request that fails in an engine process ends with an error status that says why, never with
status OK: here a real numerical fault (a checkpoint whose head overflows at the lowest
temperature, tests/engine/overflow_stories.py), beside a request that is served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import STORIES_GOLDEN_IDS, STORIES_PROMPT
from tests.engine.engine_process import start_engine
from tests.engine.overflow_stories import FAULTING_TEMPERATURE, make_overflow_stories
from thermocline.engine.v1 import engine_pb2 as pb
from thermocline.engine.v1 import engine_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub(
    stories_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[pb_grpc.EngineServiceStub]:
    """A stub for an engine process serving the overflowing copy of stories260K."""
    model = make_overflow_stories(stories_hf_dir, tmp_path_factory.mktemp("overflow") / "model")
    mesh = start_engine(
        model, tmp_path_factory.mktemp("overflow-engine"), THERMOCLINE_ENGINE_MAX_SEQ_LEN="128"
    )
    with mesh.channel("engine") as channel:
        yield pb_grpc.EngineServiceStub(channel)
    mesh.stop()


def _request(temperature: float, max_tokens: int = 8) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1)
    return pb.GenerateRequest(prompt=STORIES_PROMPT, sampling=sampling)


def test_a_sampling_fault_ends_with_internal_and_its_message(stub: pb_grpc.EngineServiceStub) -> None:
    failing = stub.Generate(_request(FAULTING_TEMPERATURE), timeout=60)
    served = stub.Generate(_request(0.0, max_tokens=len(STORIES_GOLDEN_IDS)), timeout=60)  # beside it
    with pytest.raises(grpc.RpcError) as raised:
        list(failing)
    assert raised.value.code() == grpc.StatusCode.INTERNAL, raised.value.details()
    assert "numerical fault in sampling (non-finite logits)" in raised.value.details()
    messages = list(served)
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [t for m in messages for t in m.token_ids] == STORIES_GOLDEN_IDS
