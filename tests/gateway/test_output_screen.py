"""Each output release policy's guarantee, on a scripted engine stream and a scripted screen.

The screen here decides by a marker character, and in the trailing tests it answers only when the
test lets it, so what reached the client before each verdict is exact. The real mesh's screen is
exercised per policy in test_output_release.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from services.gateway.config import GatewayConfig, OutputScreening, ReleasePolicy
from services.gateway.in_flight import InFlightStream
from services.gateway.output_screen import RelaySettings, screened
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.safety.v1 import safety_pb2

WINDOW = 4
SAFE = "[withheld]"
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]


def _stream(text: str) -> list[engine_pb2.GenerateResponse]:
    """One message per character (one token each); the last one finishes with LENGTH."""
    messages = [engine_pb2.GenerateResponse(token_ids=[i], text=c) for i, c in enumerate(text)]
    messages[-1].finish_reason = engine_pb2.FINISH_REASON_LENGTH
    messages[-1].usage.completion_tokens = len(text)
    return messages


class _Call:
    """A scripted engine call: its messages, then EOF; `finished` is set once its last message
    was read, `read_out` once EOF was."""

    def __init__(self, messages: list[engine_pb2.GenerateResponse]) -> None:
        self.messages = list(messages)
        self.finished = asyncio.Event()
        self.read_out = asyncio.Event()

    async def read(self) -> Any:
        if not self.messages:
            self.read_out.set()
            return _EOF
        message = self.messages.pop(0)
        if not self.messages:
            self.finished.set()
        return message

    def cancel(self) -> bool:
        return True


class _Screen:
    """Blocks any text holding an 'X'. With `gate`, each verdict waits until the test opens it."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.gate = gate
        self.screened: list[str] = []  # texts, in the order their verdicts were given
        self.num_passed = 0  # tokens (characters) of the longest text that passed

    async def check_output(self, text: str, *args: Any) -> safety_pb2.CheckResponse:
        if self.gate is not None:
            await self.gate.wait()
        self.screened.append(text)
        if "X" in text:
            return safety_pb2.CheckResponse(decision=safety_pb2.DECISION_BLOCK, safe_message=SAFE)
        self.num_passed = len(text)
        return safety_pb2.CheckResponse(decision=safety_pb2.DECISION_ALLOW)


def _settings(release: ReleasePolicy) -> RelaySettings:
    screening = OutputScreening(release=release, window_tokens=WINDOW, first_window_tokens=1)
    return RelaySettings(
        prompt_text="p",
        tenant="t",
        model="m",
        trace_id="",
        safety_timeout_s=5,
        deadline_s=10,
        screening=screening,
    )


async def _relay(
    release: ReleasePolicy, text: str, screen: _Screen, call: _Call
) -> list[tuple[pb.GenerateResponse, int]]:
    """Every message the client got, each with the screened prefix's length when it was sent."""
    first = await call.read()
    stream = screened(screen, call, first, _settings(release), _no_audit)  # type: ignore[arg-type]
    return [(message, screen.num_passed) async for message in stream]


async def _no_audit(layer: str, verdict: safety_pb2.CheckResponse) -> None:
    return None


def _run(release: ReleasePolicy, text: str, gate: asyncio.Event | None = None) -> tuple[list[Any], _Screen]:
    async def scenario() -> tuple[list[Any], _Screen]:
        screen, call = _Screen(gate), _Call(_stream(text))
        if gate is not None:  # the screen answers once the engine's last message has been read
            opener = asyncio.create_task(_open_when(call.finished, gate))
            sent = await _relay(release, text, screen, call)
            opener.cancel()
            return sent, screen
        return await _relay(release, text, screen, call), screen

    return asyncio.run(scenario())


async def _open_when(finished: asyncio.Event, gate: asyncio.Event) -> None:
    await finished.wait()
    gate.set()


def _released(sent: list[tuple[pb.GenerateResponse, int]]) -> str:
    return "".join(m.delta.text for m, _ in sent if m.HasField("delta") and m.delta.token_ids)


def _finish(sent: list[tuple[pb.GenerateResponse, int]]) -> int:
    message, _ = sent[-1]
    assert message.HasField("done")
    return message.done.finish_reason


def test_strict_releases_only_screened_fixed_windows_and_none_of_a_blocked_one() -> None:
    sent, screen = _run(ReleasePolicy.STRICT, "abcdefXhijkl")
    assert [len(t) for t in screen.screened] == [4, 8]
    assert _released(sent) == "abcd" and _finish(sent) == pb.FINISH_REASON_SAFETY
    assert sent[-2][0].delta.text == SAFE
    assert all(len(_released(sent[: i + 1])) <= passed for i, (_, passed) in enumerate(sent))


def test_growing_screens_after_1_2_4_then_every_window_and_holds_the_same_guarantee() -> None:
    sent, screen = _run(ReleasePolicy.GROWING, "abcdefghijXl")
    assert [len(t) for t in screen.screened] == [1, 2, 4, 8, 12]
    assert _released(sent) == "abcdefgh" and _finish(sent) == pb.FINISH_REASON_SAFETY
    assert all(len(_released(sent[: i + 1])) <= passed for i, (_, passed) in enumerate(sent))
    clean, screen = _run(ReleasePolicy.GROWING, "abcdefghijkl")
    assert _released(clean) == "abcdefghijkl" and _finish(clean) == pb.FINISH_REASON_LENGTH


def test_trailing_runs_at_most_one_window_ahead_of_a_screen_that_lags() -> None:
    # The screen answers nothing until the engine's last message was read: the relay must stop
    # releasing WINDOW tokens past what passed (nothing yet), whatever the engine sends.
    sent, screen = _run(ReleasePolicy.TRAILING, "abcdefghijkl", asyncio.Event())
    assert "".join(m.delta.text for m, passed in sent if passed == 0) == "abcd"  # WINDOW tokens
    assert all(len(_released(sent[: i + 1])) <= passed + WINDOW for i, (_, passed) in enumerate(sent))
    assert _released(sent) == "abcdefghijkl" and _finish(sent) == pb.FINISH_REASON_LENGTH
    assert screen.screened[-1] == "abcdefghijkl"  # the finish came after the whole text passed


def test_trailing_cuts_a_blocked_stream_with_at_most_one_window_of_blocked_text_out() -> None:
    sent, screen = _run(ReleasePolicy.TRAILING, "abcdefXhijklmnop", asyncio.Event())
    released = _released(sent)
    assert _finish(sent) == pb.FINISH_REASON_SAFETY and sent[-2][0].delta.text == SAFE
    assert "abcdefXhijklmnop".startswith(released)
    assert len(released) <= max(len(t) for t in screen.screened if "X" not in t) + WINDOW
    assert all(len(_released(sent[: i + 1])) <= passed + WINDOW for i, (_, passed) in enumerate(sent))


def test_the_done_message_goes_out_before_the_engine_stream_is_read_to_its_end() -> None:
    # After the engine's last message only its status is left: the client need not wait for it,
    # and the call is still read to its end (its client span then ends with its status).
    async def scenario(release: ReleasePolicy) -> bool:
        screen, call = _Screen(), _Call(_stream("abcdef"))
        sent = await _relay(release, "abcdef", screen, call)
        assert _finish(sent) == pb.FINISH_REASON_LENGTH and _released(sent) == "abcdef"
        was_read_out = call.read_out.is_set()
        await asyncio.wait_for(call.read_out.wait(), timeout=5)
        return was_read_out

    for release in ReleasePolicy:
        assert asyncio.run(scenario(release)) is False, release


def test_trailing_releases_the_first_token_before_any_verdict() -> None:
    sent, _ = _run(ReleasePolicy.TRAILING, "abcdefghijkl")
    first, passed_then = sent[0]
    assert first.delta.text.startswith("a") and passed_then == 0
    assert _finish(sent) == pb.FINISH_REASON_LENGTH and _released(sent) == "abcdefghijkl"


def test_trailing_screens_while_the_caller_waits_and_audits_only_what_it_acts_on() -> None:
    # Under trailing the caller holds the first release until the prompt's verdict. The screen of
    # the text due by then runs meanwhile; a caller that then ends the stream (its prompt blocked)
    # leaves that verdict unacted on and unaudited, though it blocked.
    async def scenario() -> tuple[list[str], list[str]]:
        screen, audited = _Screen(), []
        call = _Call(_stream("Xy"))

        async def audit(layer: str, verdict: safety_pb2.CheckResponse) -> None:
            audited.append(layer)

        stream = screened(screen, call, await call.read(), _settings(ReleasePolicy.TRAILING), audit)  # type: ignore[arg-type]
        first = await anext(stream)
        assert first.delta.text == "X"  # within the window ahead of the screen, as trailing allows
        for _ in range(5):  # the caller waits on something else for a few loop turns
            await asyncio.sleep(0)
        screened_while_held = list(screen.screened)
        await stream.aclose()  # type: ignore[attr-defined]
        return screened_while_held, audited

    screened_while_held, audited = asyncio.run(scenario())
    assert screened_while_held == ["X"] and audited == []


class _SlowToStopCall(_Call):
    """A scripted engine call that is still decoding: past its messages, a read waits for more. A
    read that is cancelled, or that comes after `cancel`, stops only once the test sets `stop`
    (`is_stopping` is set meanwhile), then raises CancelledError, as a cancelled grpc call's read does."""

    def __init__(self, messages: list[engine_pb2.GenerateResponse]) -> None:
        super().__init__(messages)
        self.is_cancelled = False
        self.is_stopping = asyncio.Event()
        self.stop = asyncio.Event()

    async def read(self) -> Any:
        if self.is_cancelled:
            await self._stopping()
        if self.messages:
            return await super().read()
        try:
            await asyncio.Event().wait()  # the engine's next token, which never comes
        except asyncio.CancelledError:
            await self._stopping()

    async def _stopping(self) -> None:
        self.is_stopping.set()
        await self.stop.wait()
        raise asyncio.CancelledError()

    def cancel(self) -> bool:
        self.is_cancelled = True
        return True


def _relay_cut_while_the_engine_call_stops(
    release: ReleasePolicy, text: str, is_cut: bool
) -> list[Any] | None:
    """Relays `text` (no finish: the engine decodes on) until a block cancels the engine call; while
    that call stops, the drain cuts the relay's task when `is_cut`. What the client got, or None when
    the relay ended cancelled (its handler then reports the cut)."""

    async def scenario() -> list[Any] | None:
        call = _SlowToStopCall(
            [engine_pb2.GenerateResponse(token_ids=[i], text=c) for i, c in enumerate(text)]
        )
        stream = screened(_Screen(), call, await call.read(), _settings(release), _no_audit)  # type: ignore[arg-type]
        relaying = asyncio.create_task(_all(stream))
        await call.is_stopping.wait()
        if is_cut:
            InFlightStream(relaying).cut()
        call.stop.set()
        try:
            sent = await relaying
        except asyncio.CancelledError:
            return None
        assert call.is_cancelled
        return sent

    return asyncio.run(scenario())


async def _all(stream: Any) -> list[pb.GenerateResponse]:
    return [message async for message in stream]


@pytest.mark.parametrize(
    ("release", "text"),
    [
        # trailing: the block cancels the read in flight and waits for it to stop (_cancelled)
        (ReleasePolicy.TRAILING, "X"),
        # strict: the block cancels the engine call and reads it out (_abandon)
        (ReleasePolicy.STRICT, "abcX"),
    ],
)
def test_a_cut_that_lands_while_a_block_stops_the_engine_call_reaches_the_stream(
    release: ReleasePolicy, text: str
) -> None:
    # The engine call's own cancellation ends inside the relay, which then sends the safe message;
    # a cut of the stream's task that lands meanwhile goes on, so the stream can report and audit
    # it (GatewayServicer.Generate), instead of finishing as if nothing had come.
    blocked = _relay_cut_while_the_engine_call_stops(release, text, is_cut=False)
    assert blocked is not None and blocked[-2].delta.text == SAFE
    assert blocked[-1].done.finish_reason == pb.FINISH_REASON_SAFETY
    assert _relay_cut_while_the_engine_call_stops(release, text, is_cut=True) is None


def test_the_release_policy_is_a_validated_setting_with_strict_as_default() -> None:
    environ = {"THERMOCLINE_GATEWAY_JWT_KEY_FILE": "/nonexistent/key.pem"}
    default = GatewayConfig.from_env(environ).output
    assert (default.release, default.window_tokens, default.first_window_tokens) == (
        ReleasePolicy.STRICT,
        16,
        2,
    )
    chosen = GatewayConfig.from_env(
        environ
        | {"THERMOCLINE_GATEWAY_OUTPUT_RELEASE": "trailing", "THERMOCLINE_GATEWAY_OUTPUT_CHECK_TOKENS": "1"}
    ).output
    assert (chosen.release, chosen.window_tokens, chosen.first_window_tokens) == (
        ReleasePolicy.TRAILING,
        1,
        1,
    )
    with pytest.raises(ValueError, match="OUTPUT_RELEASE='eager'; use one of strict, growing, trailing"):
        GatewayConfig.from_env(environ | {"THERMOCLINE_GATEWAY_OUTPUT_RELEASE": "eager"})
    with pytest.raises(ValueError, match=r"OUTPUT_FIRST_WINDOW_TOKENS must lie in 1\.\.16"):
        GatewayConfig.from_env(environ | {"THERMOCLINE_GATEWAY_OUTPUT_FIRST_WINDOW_TOKENS": "32"})
