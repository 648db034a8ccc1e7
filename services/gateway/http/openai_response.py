"""The gateway's Generate stream rendered as OpenAI JSON: one body, or SSE chunks ending [DONE]."""

from __future__ import annotations

import json
import time
from typing import Any

from services.common.errors import Unavailable
from services.gateway.http.openai_request import Endpoint, OpenAIRequest
from thermocline.gateway.v1 import gateway_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_SAFETY: "content_filter",
}
# Finishes of an answer cut short: OpenAI has no reason for them, and "stop" would pass such an
# answer off as whole, so the caller gets an error (503, or a stream's error event) instead.
_CUT_SHORT = {
    pb.FINISH_REASON_ERROR: "the engine failed while generating this answer; retry the request",
    pb.FINISH_REASON_CANCELLED: "the engine cancelled this answer before it was complete; retry the request",
}
SSE_DONE = b"data: [DONE]\n\n"


def usage_json(usage: pb.Usage) -> dict[str, Any]:
    """OpenAI's usage object; cached prompt tokens in its details, as OpenAI reports them."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def completed(message: pb.GenerateResponse) -> pb.Completion:
    """The final message's completion; Unavailable when the answer was cut short."""
    if (reason := _CUT_SHORT.get(message.done.finish_reason)) is not None:
        raise Unavailable(reason)
    return message.done


class Rendering:
    """The fixed parts of one answer: its id, creation time, model and shape.

    `model` is the model the answer names: the one the request named, else the default the gateway
    routed it to, which is what the final message reports. A stream's chunks all carry it, the
    first ones included, which go out before the final message says it."""

    def __init__(self, parsed: OpenAIRequest, request_id: str, model: str) -> None:
        self.endpoint = parsed.endpoint
        self.include_usage = parsed.include_usage
        prefix = "chatcmpl" if parsed.endpoint is Endpoint.CHAT else "cmpl"
        self.request_id = request_id
        self.id = f"{prefix}-{request_id}"
        self.created = int(time.time())
        self.model = model

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def body(self, text: str, done: pb.Completion) -> dict[str, Any]:
        """The whole answer of a non-streaming call."""
        self.model = done.model or self.model
        reason = FINISH_REASONS.get(done.finish_reason, "stop")
        if self.endpoint is Endpoint.CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        answer = self._envelope(self.endpoint.value, [choice | {"finish_reason": reason}])
        return answer | {"usage": usage_json(done.usage)}

    def chunk(self, text: str, finish_reason: str | None = None, is_first: bool = False) -> bytes:
        """One SSE event carrying a piece of text (and the finish reason on the last)."""
        if self.endpoint is Endpoint.CHAT:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if is_first else {"content": text}
            if finish_reason is not None:
                delta = {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice, kind = {"index": 0, "text": text, "logprobs": None}, "text_completion"
        event = self._envelope(kind, [choice | {"finish_reason": finish_reason}])
        if self.include_usage:
            event["usage"] = None
        return sse(event)

    def closing(self, done: pb.Completion) -> list[bytes]:
        """The finish-reason chunk, the usage chunk when asked for, and [DONE]; they name the
        model the stream's first chunks named."""
        events = [self.chunk("", FINISH_REASONS.get(done.finish_reason, "stop"))]
        if self.include_usage:
            kind = "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else "text_completion"
            events.append(sse(self._envelope(kind, []) | {"usage": usage_json(done.usage)}))
        return [*events, SSE_DONE]


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
