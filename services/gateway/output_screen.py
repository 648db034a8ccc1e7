"""The engine's text as the client gets it: released against the output screen, by policy.

Every screen sends the whole text so far to the safety service (`CheckOutput`, under the tenant's
policy). What reaches the client before a verdict depends on `OutputScreening.release`
(THERMOCLINE_GATEWAY_OUTPUT_RELEASE):

- `strict` (the default): text is held back and released only after the text up to its end
  passed the screen, in windows of `window_tokens` tokens and at the end. No text the screen
  blocks ever reaches the client; the time to first token carries `window_tokens` decode steps
  and one screen.
- `growing`: the same guarantee and the same holding, but the windows start at
  `first_window_tokens` and double until they reach `window_tokens` (with 2 and 16: screens after
  2, 4, 8, 16, 32, 48, ... tokens). The first token waits for `first_window_tokens` decode steps
  and one screen; a stream costs about log2(window / first) more screens.
- `trailing`: text is released as it arrives, while the screen runs alongside decode, one screen
  at a time, in the growing windows. What remains: the released text never runs more than
  `window_tokens` tokens past the longest prefix that passed the screen (the relay stops
  releasing and waits for the screen when it would); a block ends the stream with the safe
  message and FINISH_REASON_SAFETY, so at most `window_tokens` tokens of blocked text reach the
  client first; and a STOP or LENGTH finish is sent only after the whole completion passed, so a
  client that acts on a completion only once it finishes never acts on blocked text. The tokens
  sent ahead of their screen have still passed the engine's in-loop gate, which judges every
  decode step (unless THERMOCLINE_ENGINE_GATE_SOURCE=off); it does not know the tenant's policy.
  Under trailing the prompt check, too, runs alongside the engine's prefill instead of before it
  (servicer.py): nothing is sent before the prompt passed, but the engine does start on a prompt
  that is then blocked, and is cancelled.

A block cancels the engine request and is audited before the client hears of it; so is the first
verdict per stream that passed only because of the tenant's policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from services.common import tasks
from services.common.errors import Unavailable
from services.gateway.config import OutputScreening, ReleasePolicy
from services.gateway.loop import discard
from services.gateway.upstream import Upstreams, upstream_error
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.safety.v1 import safety_pb2

_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # the end-of-stream sentinel of call.read()

_FINISH_FROM_ENGINE = {
    engine_pb2.FINISH_REASON_STOP: pb.FINISH_REASON_STOP,
    engine_pb2.FINISH_REASON_LENGTH: pb.FINISH_REASON_LENGTH,
    engine_pb2.FINISH_REASON_SAFETY: pb.FINISH_REASON_SAFETY,
    engine_pb2.FINISH_REASON_CANCELLED: pb.FINISH_REASON_CANCELLED,
}

NO_FINAL_MESSAGE = "engine ended the stream without a final message; retry the request"
ENGINE_FAILED = "engine failed while generating and ended the stream with no detail; retry the request"
# The event on the gateway's Generate span when the engine's last message has reached it.
ENGINE_FINISHED_EVENT = "engine.finished"
# The event on that span timed when the engine message that completed the first released text
# reached the gateway (added at the release, with the arrival's timestamp). With the prompt's and
# output's screens, it bounds what the first text waited for; bench/gateway_spans.py reads the
# gateway's own time to the first text (FIRST_TEXT_EVENT, servicer.py) from it.
FIRST_TEXT_ARRIVED_EVENT = "engine.first_text_arrived"

# Writes the audit event of a verdict that blocked, or passed only under the tenant's policy;
# called before the client sees the outcome. Arguments: the layer ("prompt", "output") and verdict.
VerdictAudit = Callable[[str, safety_pb2.CheckResponse], Awaitable[None]]


# Told the completion's token count when the engine's last message arrives, before its text is
# screened (the servicer starts charging it there; see completion_charge.py).
CompletionCounted = Callable[[int], None]


async def no_audit(layer: str, verdict: safety_pb2.CheckResponse) -> None:
    """A VerdictAudit that records nothing."""


def ignore_count(num_tokens: int) -> None:
    """A CompletionCounted that does nothing."""


def needs_audit(verdict: safety_pb2.CheckResponse) -> bool:
    """Whether a verdict gets its own audit event: it blocked, or the tenant's policy waived a category."""
    return verdict.decision == safety_pb2.DECISION_BLOCK or bool(verdict.waived)


@dataclass(frozen=True)
class RelaySettings:
    """What one relay needs besides the engine request."""

    prompt_text: str
    tenant: str
    model: str
    trace_id: str
    safety_timeout_s: float
    deadline_s: float | None
    screening: OutputScreening = field(default_factory=OutputScreening)
    prompt_tokens: int = 0  # as the gateway counted them: the usage of a stream cut by a block
    # The tenant's categories off and loosened thresholds, sent with every output check.
    safety_policy: safety_pb2.TenantPolicy = field(default_factory=safety_pb2.TenantPolicy)


@dataclass
class HeldOutput:
    """Generated text not yet released, and everything generated so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    full_text: str = ""
    num_tokens: int = 0  # generated so far, released or not

    def add(self, message: engine_pb2.GenerateResponse) -> None:
        """Holds back one engine message."""
        self.text += message.text
        self.full_text += message.text
        self.token_ids.extend(message.token_ids)
        self.num_tokens += len(message.token_ids)

    def release(self) -> pb.GenerateResponse | None:
        """The held text as one delta, emptying the hold; None when nothing is held."""
        if not self.text and not self.token_ids:
            return None
        delta = pb.GenerateResponse(delta=pb.TextDelta(text=self.text, token_ids=self.token_ids))
        self.text, self.token_ids = "", []
        return delta


def final_message(
    reason: int, settings: RelaySettings, usage: engine_pb2.Usage | None = None
) -> pb.GenerateResponse:
    """The closing message of a stream."""
    message = pb.GenerateResponse(
        done=pb.Completion(finish_reason=reason, trace_id=settings.trace_id, model=settings.model)
    )
    if usage is not None:
        message.done.usage.prompt_tokens = usage.prompt_tokens
        message.done.usage.completion_tokens = usage.completion_tokens
        message.done.usage.cached_prompt_tokens = usage.cached_prompt_tokens
        message.done.usage.tiers.hot_tokens = usage.tiers.hot_tokens
        message.done.usage.tiers.warm_tokens = usage.tiers.warm_tokens
        message.done.usage.tiers.cold_tokens = usage.tiers.cold_tokens
    return message


def blocked_messages(
    safe_message: str, settings: RelaySettings, usage: engine_pb2.Usage | None
) -> list[pb.GenerateResponse]:
    """The safe message and a SAFETY finish, which replace a blocked prompt or output."""
    return [
        pb.GenerateResponse(delta=pb.TextDelta(text=safe_message)),
        final_message(pb.FINISH_REASON_SAFETY, settings, usage),
    ]


def screened(
    upstreams: Upstreams,
    call: grpc.aio.UnaryStreamCall,
    first: Any,
    settings: RelaySettings,
    audit: VerdictAudit,
    on_counted: CompletionCounted = ignore_count,
) -> AsyncGenerator[pb.GenerateResponse, None]:
    """The engine stream from its first message, released as the settings' policy says."""
    stream = _OutputStream(upstreams, call, settings, audit, on_counted)
    if settings.screening.release is ReleasePolicy.TRAILING:
        return stream.trailing(first)
    return stream.held(first)


class _OutputStream:
    """One engine stream and its screens; `held` and `trailing` are the two ways to release it."""

    def __init__(
        self,
        upstreams: Upstreams,
        call: grpc.aio.UnaryStreamCall,
        settings: RelaySettings,
        audit: VerdictAudit,
        on_counted: CompletionCounted,
    ) -> None:
        self.upstreams, self.call, self.settings, self.audit = upstreams, call, settings, audit
        self.on_counted = on_counted
        self.output = HeldOutput()
        self.final: engine_pb2.GenerateResponse | None = None
        self.num_screened = 0  # tokens of the longest prefix that passed the screen
        self.num_chars_screened = 0  # its characters
        self._has_audited_waiver = False  # each window re-screens the whole text: one waiver event
        self._is_abandoned = False  # cancelled and read out by a block
        # When the latest engine message was read (time.time_ns); the first was read just before.
        self._arrived_ns = time.time_ns()
        self._has_released = False

    async def held(self, first: Any) -> AsyncGenerator[pb.GenerateResponse, None]:
        """strict and growing: text reaches the client only once the text up to its end passed."""
        message = first
        try:
            while message is not _EOF:
                self._add(message)
                window = self.settings.screening.window_after(self.num_screened)
                if self.final is not None or self.output.num_tokens - self.num_screened >= window:
                    verdict = await self._screen(self.output.full_text)
                    if await self._act_on(verdict):
                        for blocked in await self._block(verdict):
                            yield blocked
                        return
                    self._passed(self.output.num_tokens, len(self.output.full_text))
                    if (delta := self.output.release()) is not None:
                        self._trace_first_release()
                        yield delta
                if self.final is not None:
                    break  # the stream's end is read after the done message (_end_call)
                message = await self._read()
        except grpc.aio.AioRpcError as error:
            raise upstream_error("engine", error) from None
        finally:
            self._end_call()
        yield self._finish()

    async def trailing(self, first: Any) -> AsyncGenerator[pb.GenerateResponse, None]:
        """trailing: text goes out as it arrives, at most `window_tokens` past the screened prefix."""
        release = _TrailingRelease(self.settings.screening.window_tokens)
        reading: asyncio.Task[Any] | None = None
        screening: asyncio.Task[safety_pb2.CheckResponse] | None = None
        covered = (0, 0)  # tokens and characters the screen in flight covers
        message = first
        try:
            while True:
                if message is _EOF:  # before the last message: the engine broke off
                    raise Unavailable(NO_FINAL_MESSAGE)
                if message is not None:
                    self._add(message)
                    release.arrive(message)
                message = None
                # The screen starts before the release: yielding waits for the caller (under this
                # policy, for the prompt's verdict first), and the screen need not.
                if screening is None and self._is_due():
                    covered = (self.output.num_tokens, len(self.output.full_text))
                    screening = asyncio.create_task(self._screen(self.output.full_text))
                if (delta := release.take(self.num_screened)) is not None:
                    self._trace_first_release()
                    yield delta
                if self.final is not None and screening is None and not release.pending:
                    break  # the stream's end is read after the done message (_end_call)
                if self.final is None and reading is None:
                    reading = asyncio.create_task(self._read())
                waits: set[asyncio.Task[Any]] = {t for t in (reading, screening) if t is not None}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if screening in done:
                    verdict, screening = screening.result(), None
                    if await self._act_on(verdict):
                        await _cancelled(reading)  # the call has one reader: _block reads it out
                        for blocked in await self._block(verdict):
                            yield blocked
                        return
                    self._passed(*covered)
                if reading in done:
                    message, reading = reading.result(), None
        except grpc.aio.AioRpcError as error:
            raise upstream_error("engine", error) from None
        finally:
            for task in (reading, screening):
                if task is not None:
                    discard(task)
            self._end_call()
        yield self._finish()

    def _end_call(self) -> None:
        """Ends the engine call as the relay leaves it. After the engine's last message the call
        is over but for its status, so its end is read in the background and the done message
        does not wait for it (nor the gateway's span: about 0.3 ms on a small box); before it,
        the call is cancelled (a block, an error, or the caller went away). The end is read even
        when the status has come: a call traced by an interceptor ends its span only when read."""
        if self.final is None or self._is_abandoned:
            self.call.cancel()
            return
        tasks.hold(asyncio.ensure_future(_read_out(self.call)))

    def _trace_first_release(self) -> None:
        if not self._has_released:
            self._has_released = True
            trace.get_current_span().add_event(FIRST_TEXT_ARRIVED_EVENT, timestamp=self._arrived_ns)

    async def _read(self) -> Any:
        """The engine stream's next message, its arrival timed."""
        message = await self.call.read()
        self._arrived_ns = time.time_ns()
        return message

    def _add(self, message: engine_pb2.GenerateResponse) -> None:
        self.output.add(message)
        if message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            self.final = message
            # In a trace, what follows this event is the gateway's: the last screen, the release
            # of held text and the done message (bench/gateway_spans.py reads it so).
            trace.get_current_span().add_event(ENGINE_FINISHED_EVENT)
            self.on_counted(message.usage.completion_tokens)

    def _passed(self, num_tokens: int, num_chars: int) -> None:
        self.num_screened, self.num_chars_screened = num_tokens, num_chars

    def _is_due(self) -> bool:
        """trailing: whether to start a screen now (none is in flight): a window is full, or the
        engine has finished and some text is unscreened."""
        if self.final is not None:
            return len(self.output.full_text) > self.num_chars_screened
        num_unscreened = self.output.num_tokens - self.num_screened
        return num_unscreened >= self.settings.screening.window_after(self.num_screened)

    async def _screen(self, text: str) -> safety_pb2.CheckResponse:
        """The safety service's verdict on the text so far."""
        settings = self.settings
        return await self.upstreams.check_output(
            text, settings.prompt_text, settings.tenant, settings.safety_policy, settings.safety_timeout_s
        )

    async def _act_on(self, verdict: safety_pb2.CheckResponse) -> bool:
        """Audits a verdict the stream acts on (a block, the first waiver); whether it blocked.
        Not done inside the screen: under trailing a screen may finish before the prompt's verdict,
        and a stream whose prompt is blocked never acts on its output's verdict."""
        is_blocked = verdict.decision == safety_pb2.DECISION_BLOCK
        if is_blocked or (verdict.waived and not self._has_audited_waiver):
            self._has_audited_waiver = True
            await self.audit("output", verdict)
        return is_blocked

    async def _block(self, verdict: safety_pb2.CheckResponse) -> list[pb.GenerateResponse]:
        """Ends a blocked stream: cancels the engine call; the safe message and a SAFETY finish."""
        self._is_abandoned = True
        await _abandon(self.call)
        record_verdict("output", verdict)
        return blocked_messages(verdict.safe_message, self.settings, self._usage_so_far())

    def _finish(self) -> pb.GenerateResponse:
        """The final message of a stream whose whole text passed."""
        if self.final is None:
            raise Unavailable(NO_FINAL_MESSAGE)
        _record_finish(self.final)
        if self.final.finish_reason == engine_pb2.FINISH_REASON_ERROR:  # an engine that ends a failed
            raise Unavailable(ENGINE_FAILED)  # request with status OK: still not a whole completion
        return final_message(_FINISH_FROM_ENGINE[self.final.finish_reason], self.settings, self.final.usage)

    def _usage_so_far(self) -> engine_pb2.Usage:
        """The engine's usage on its last message; before that, what the gateway has seen (a block
        mid-stream still reports and charges the tokens generated until then)."""
        if self.final is not None:
            return self.final.usage
        return engine_pb2.Usage(
            prompt_tokens=self.settings.prompt_tokens, completion_tokens=self.output.num_tokens
        )


class _TrailingRelease:
    """trailing: engine messages not yet sent, let out while they end within `window_tokens`
    tokens of the screened prefix."""

    def __init__(self, window_tokens: int) -> None:
        self.window_tokens = window_tokens
        self.pending: list[engine_pb2.GenerateResponse] = []
        self.num_released = 0  # tokens sent to the client

    def arrive(self, message: engine_pb2.GenerateResponse) -> None:
        """Queues one engine message."""
        self.pending.append(message)

    def take(self, num_screened: int) -> pb.GenerateResponse | None:
        """The messages that may go out now, as one delta; None when none may."""
        limit = num_screened + self.window_tokens
        text, token_ids = "", []
        while self.pending and self.num_released + len(self.pending[0].token_ids) <= limit:
            message = self.pending.pop(0)
            text += message.text
            token_ids.extend(message.token_ids)
            self.num_released += len(message.token_ids)
        if not text and not token_ids:
            return None
        return pb.GenerateResponse(delta=pb.TextDelta(text=text, token_ids=token_ids))


async def _cancelled(task: asyncio.Task[Any] | None) -> None:
    """Cancels `task` and waits until it has stopped."""
    if task is not None:
        task.cancel()
        with _own_cancel_ended():
            await task


@contextlib.contextmanager
def _own_cancel_ended() -> Iterator[None]:
    """Ends the error of a task or engine call this relay has just cancelled (CancelledError, or the
    call's own error), and no other: a cancellation of the stream's own task that lands meanwhile
    (the drain's cut, the caller gone, the stream's own timers) goes on, to be ended where the
    stream is (GatewayServicer.Generate audits a cut as stream.cut). `contextlib.suppress` swallowed
    both alike, and such a cut came out as a stream that finished normally, unaudited."""
    task = asyncio.current_task()
    assert task is not None
    num_cancelling = task.cancelling()
    try:
        yield
    except asyncio.CancelledError:
        if task.cancelling() > num_cancelling:
            raise
    except grpc.aio.AioRpcError:
        pass


# How long an engine that sent its last message may take to end the stream before it is cancelled.
READ_OUT_TIMEOUT_S = 30.0


async def _read_out(call: grpc.aio.UnaryStreamCall) -> None:
    """Reads an engine stream whose last message came to its end. It holds the call until its
    status arrives (a call collected before that is cancelled, and its span would say so), and a
    call traced by an interceptor ends its span only when read. Nothing the engine says now can
    change the answer already sent; one that never ends its stream is cancelled after
    READ_OUT_TIMEOUT_S."""
    try:
        async with asyncio.timeout(READ_OUT_TIMEOUT_S):
            while await call.read() is not _EOF:
                pass
    except (grpc.aio.AioRpcError, TimeoutError):
        call.cancel()


async def _abandon(call: grpc.aio.UnaryStreamCall) -> None:
    """Cancels the engine call (freeing its KV) and reads the stream out so its span ends."""
    call.cancel()
    with _own_cancel_ended():  # a cancelled call's read raises CancelledError
        while await call.read() is not _EOF:
            pass


def record_verdict(layer: str, verdict: safety_pb2.CheckResponse) -> None:
    """Puts a safety verdict on the current span: decision, per-category scores, and a block event."""
    span = trace.get_current_span()
    is_blocked = verdict.decision == safety_pb2.DECISION_BLOCK
    span.set_attribute(f"thermocline.safety.{layer}.decision", "block" if is_blocked else "allow")
    span.set_attribute(f"thermocline.safety.{layer}.policy_version", verdict.policy_version)
    for score in verdict.scores:
        span.set_attribute(f"thermocline.safety.{layer}.score.{score.category}", score.score)
    if is_blocked:
        span.add_event(
            "safety.block",
            {"thermocline.safety.layer": layer, "thermocline.safety.reasons": list(verdict.reasons)},
        )


def _record_finish(message: engine_pb2.GenerateResponse) -> None:
    span = trace.get_current_span()
    span.set_attribute("gen_ai.usage.input_tokens", message.usage.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", message.usage.completion_tokens)
    span.set_attribute(
        "gen_ai.response.finish_reasons", [engine_pb2.FinishReason.Name(message.finish_reason).lower()[14:]]
    )
