"""What the gateway sends the safety service to screen: the prompt, or a chat and its turns."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.gateway.gatekeeper import prompt_roles, prompt_text, prompt_turns
from thermocline.gateway.v1 import gateway_pb2 as pb


def _chat(*turns: tuple[str, str]) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=role, content=content) for role, content in turns]
    return pb.GenerateRequest(chat=pb.ChatTurns(messages=messages))


def test_a_chat_is_screened_whole_and_turn_by_turn_and_a_raw_prompt_as_it_is() -> None:
    chat = _chat(("system", "Be brief."), ("user", "Hi?"))
    assert prompt_text(chat) == "system: Be brief.\nuser: Hi?"
    assert prompt_turns(chat) == ("Be brief.", "Hi?")  # no role labels: as the gate was calibrated
    assert prompt_roles(chat) == ("system", "user")  # beside them, one per turn
    raw = pb.GenerateRequest(prompt="Hi?")
    assert (prompt_text(raw), prompt_turns(raw), prompt_roles(raw)) == ("Hi?", (), ())


def test_an_empty_chat_or_request_is_refused_with_what_to_send() -> None:
    with pytest.raises(InvalidArgument, match="send at least one turn"):
        prompt_text(_chat())
    with pytest.raises(InvalidArgument, match="set either prompt or chat"):
        prompt_text(pb.GenerateRequest())
    with pytest.raises(InvalidArgument, match="prompt is empty; send some text"):
        prompt_text(pb.GenerateRequest(prompt=""))  # set, and empty: refused before its screen
