"""The relay's retry rule on fake replicas: retry UNAVAILABLE (and a replica's FAILED_PRECONDITION)
before the first token, never after."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.gateway.config import OutputScreening
from services.gateway.relay import RelaySettings, relay
from thermocline.engine.v1 import engine_pb2
from thermocline.safety.v1 import safety_pb2

SETTINGS = RelaySettings(
    prompt_text="p",
    tenant="t",
    model="m",
    trace_id="",
    safety_timeout_s=5,
    deadline_s=10,
    screening=OutputScreening(window_tokens=1, first_window_tokens=1),
)


class _Failure(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class _Call:
    """A scripted engine stream: messages, then optionally an error."""

    def __init__(self, messages: list[engine_pb2.GenerateResponse], error: grpc.StatusCode | None) -> None:
        self._messages, self._error = list(messages), error
        self.is_cancelled = False

    async def read(self) -> Any:
        if self._messages:
            return self._messages.pop(0)
        if self._error is not None:
            raise _Failure(self._error)
        return grpc.aio.EOF  # type: ignore[attr-defined]

    def cancel(self) -> bool:
        self.is_cancelled = True
        return True


class _Replica:
    def __init__(
        self, target: str, messages: list[engine_pb2.GenerateResponse], error: grpc.StatusCode | None
    ) -> None:
        self.target, self.num_calls = target, 0
        self.calls: list[_Call] = []
        self.stub = self
        self.is_serving = True
        self._script = (messages, error)

    def Generate(self, request: Any, timeout: float | None = None) -> _Call:
        self.num_calls += 1
        self.calls.append(_Call(*self._script))
        return self.calls[-1]


class _Upstreams:
    async def check_output(self, *args: Any) -> safety_pb2.CheckResponse:
        return safety_pb2.CheckResponse(decision=safety_pb2.DECISION_ALLOW)


TOKEN = engine_pb2.GenerateResponse(token_ids=[7], text="a")
FINAL = engine_pb2.GenerateResponse(token_ids=[8], text="b", finish_reason=engine_pb2.FINISH_REASON_LENGTH)


async def _collect(replicas: list[_Replica]) -> list[Any]:
    stream: AsyncIterator[Any] = relay(_Upstreams(), engine_pb2.GenerateRequest(), SETTINGS, replicas)  # type: ignore[arg-type]
    return [message async for message in stream]


def test_unavailable_before_the_first_token_moves_to_the_next_replica() -> None:
    draining = _Replica("a", [], grpc.StatusCode.UNAVAILABLE)
    healthy = _Replica("b", [TOKEN, FINAL], None)
    messages = asyncio.run(_collect([draining, healthy]))
    assert (draining.num_calls, healthy.num_calls) == (1, 1)
    assert messages[-1].done.finish_reason != 0


def test_a_replica_that_refuses_every_request_is_passed_over_and_the_last_refusal_reaches_the_client() -> (
    None
):
    mismatched = _Replica("a", [], grpc.StatusCode.FAILED_PRECONDITION)  # its gate differs from safety's
    healthy = _Replica("b", [TOKEN, FINAL], None)
    messages = asyncio.run(_collect([mismatched, healthy]))
    assert (mismatched.num_calls, healthy.num_calls) == (1, 1)
    assert messages[-1].done.finish_reason != 0
    with pytest.raises(FailedPrecondition, match="engine"):  # no replica left to try
        asyncio.run(_collect([_Replica("a", [], grpc.StatusCode.FAILED_PRECONDITION)]))


def test_a_failure_after_the_first_token_is_never_retried() -> None:
    dying = _Replica("a", [TOKEN], grpc.StatusCode.UNAVAILABLE)
    spare = _Replica("b", [TOKEN, FINAL], None)
    with pytest.raises(Unavailable):
        asyncio.run(_collect([dying, spare]))
    assert spare.num_calls == 0


def test_other_errors_are_not_retried() -> None:
    refusing = _Replica("a", [], grpc.StatusCode.RESOURCE_EXHAUSTED)
    spare = _Replica("b", [TOKEN, FINAL], None)
    with pytest.raises(ResourceExhausted, match="engine"):
        asyncio.run(_collect([refusing, spare]))
    assert spare.num_calls == 0


def test_the_engines_invalid_argument_reaches_the_client_with_its_message() -> None:
    refusing = _Replica("a", [], grpc.StatusCode.INVALID_ARGUMENT)
    spare = _Replica("b", [TOKEN, FINAL], None)
    with pytest.raises(InvalidArgument, match="engine: INVALID_ARGUMENT"):  # the fake's details
        asyncio.run(_collect([refusing, spare]))
    assert spare.num_calls == 0


def test_closing_the_relay_cancels_the_engine_call_there_and_then() -> None:
    # A prompt blocked under trailing closes the relay mid-stream: the engine call is cancelled
    # at once, not later when the loop finalizes the generators inside the relay.
    replica = _Replica("a", [TOKEN, TOKEN, FINAL], None)

    async def scenario() -> bool:
        stream = relay(_Upstreams(), engine_pb2.GenerateRequest(), SETTINGS, [replica])  # type: ignore[arg-type]
        first = await anext(stream)
        assert first.delta.text == "a"
        await stream.aclose()  # type: ignore[attr-defined]
        return replica.calls[0].is_cancelled

    assert asyncio.run(scenario())
