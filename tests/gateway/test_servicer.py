"""The servicer's late trace of a passing prompt verdict: on the span whether the stream outlives
the engine call's send or ends at once (strict), and after the first text (trailing). And the
order of an admitted call's answer against its allow event's write: the answer starts beside the
write, and the caller hears nothing of it before the write is done."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.errors import NotFound, Unavailable
from services.gateway.loop import TURNS_TO_SEND, let_calls_go_out
from services.gateway.servicer import _released_after, _traced_after, _traced_late
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.safety.v1 import safety_pb2

DECISION = "thermocline.safety.prompt.decision"


def _passed() -> safety_pb2.CheckResponse:
    score = safety_pb2.CategoryScore(category="violence", score=0.125)
    allow = safety_pb2.DECISION_ALLOW
    return safety_pb2.CheckResponse(decision=allow, policy_version="gate-1", scores=[score])


async def _span_of(body_turns: int) -> tuple[ReadableSpan, bool]:
    """The request span after a `_traced_late` body that yields the loop `body_turns` times, and
    whether the verdict was on it before the body ended."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("Generate") as span, _traced_late(_passed()):
        for _ in range(body_turns):
            await asyncio.sleep(0)
        was_traced_inside = DECISION in (span.attributes or {})  # type: ignore[attr-defined]
    (finished,) = exporter.get_finished_spans()
    return finished, was_traced_inside


def test_a_stream_that_outlives_the_calls_send_gets_the_verdict_while_it_runs() -> None:
    span, was_traced_inside = asyncio.run(_span_of(body_turns=TURNS_TO_SEND + 1))
    assert was_traced_inside
    attributes = span.attributes or {}
    assert attributes[DECISION] == "allow" and attributes["thermocline.safety.prompt.score.violence"] == 0.125


def test_a_stream_that_ends_at_once_still_gets_the_verdict_before_its_span_ends() -> None:
    span, was_traced_inside = asyncio.run(_span_of(body_turns=0))
    assert not was_traced_inside
    assert (span.attributes or {})[DECISION] == "allow"


def test_the_verdict_waits_for_the_calls_of_the_bodys_first_turn() -> None:
    async def traced_after_send() -> bool:
        provider = TracerProvider()
        with provider.get_tracer("test").start_as_current_span("Generate") as span, _traced_late(_passed()):
            await asyncio.sleep(0)  # the turn a call started in the body's first turn sends in
            is_traced_early = DECISION in (span.attributes or {})  # type: ignore[attr-defined]
            await let_calls_go_out()
        return is_traced_early

    assert not asyncio.run(traced_after_send())


def test_under_trailing_a_pass_is_traced_after_the_first_text_or_as_the_stream_closes() -> None:
    async def traced(close_after_first: bool) -> tuple[bool, ReadableSpan]:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))

        async def stream() -> AsyncIterator[str]:  # as _behind_prompt_check releases the first text
            with _traced_after(_passed()):
                yield "first text"
            yield "more text"

        with provider.get_tracer("test").start_as_current_span("Generate") as span:
            messages = stream()
            await anext(messages)
            is_traced_with_first_text = DECISION in (span.attributes or {})  # type: ignore[attr-defined]
            if close_after_first:  # the client went away at its first text
                await messages.aclose()
            else:
                assert [m async for m in messages] == ["more text"]
        (finished,) = exporter.get_finished_spans()
        return is_traced_with_first_text, finished

    for close_after_first in (False, True):
        is_traced_with_first_text, span = asyncio.run(traced(close_after_first))
        assert not is_traced_with_first_text, close_after_first
        assert (span.attributes or {})[DECISION] == "allow", close_after_first


TURNS = 20  # loop turns a consumer is given to get ahead of the write, were it free to


async def _written_after_turns(
    caller: Callable[[], Awaitable[None]], recorded: asyncio.Future[None], seen: list[str]
) -> None:
    """Runs `caller`, lets it take TURNS loop turns, then completes the write and waits for it."""
    task = asyncio.ensure_future(caller())
    for _ in range(TURNS):
        await asyncio.sleep(0)
    seen.append("written")
    recorded.set_result(None)
    await task


def test_the_caller_hears_no_message_before_the_allow_event_is_on_disk() -> None:
    async def order() -> list[str]:
        seen: list[str] = []
        recorded: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def answer() -> AsyncIterator[pb.GenerateResponse]:
            seen.append("answer started")
            yield pb.GenerateResponse(delta=pb.TextDelta(text="first"))

        async def caller() -> None:
            async for message in _released_after(recorded, answer()):
                seen.append(f"heard {message.delta.text}")

        await _written_after_turns(caller, recorded, seen)
        return seen

    assert asyncio.run(order()) == ["answer started", "written", "heard first"]


def test_a_failed_write_replaces_the_answer_and_closes_it() -> None:
    async def outcome() -> tuple[BaseException | None, bool]:
        closed = False
        recorded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        recorded.set_exception(Unavailable("the audit log could not be written"))

        async def answer() -> AsyncIterator[pb.GenerateResponse]:
            nonlocal closed
            try:
                yield pb.GenerateResponse(delta=pb.TextDelta(text="first"))
                yield pb.GenerateResponse(delta=pb.TextDelta(text="second"))
            finally:
                closed = True  # where the engine call is cancelled

        heard: list[pb.GenerateResponse] = []
        with pytest.raises(Unavailable) as refused:
            async for message in _released_after(recorded, answer()):
                heard.append(message)
        assert not heard
        return refused.value, closed

    error, closed = asyncio.run(outcome())
    assert "audit log" in str(error) and closed


def test_an_error_of_the_answer_is_heard_after_the_write_too() -> None:
    async def order() -> list[str]:
        seen: list[str] = []
        recorded: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def answer() -> AsyncIterator[pb.GenerateResponse]:
            raise NotFound("the engine has no such model")
            yield pb.GenerateResponse()  # an async generator

        async def caller() -> None:
            try:
                async for _ in _released_after(recorded, answer()):
                    pass
            except NotFound:
                seen.append("heard the error")

        await _written_after_turns(caller, recorded, seen)
        return seen

    assert asyncio.run(order()) == ["written", "heard the error"]
