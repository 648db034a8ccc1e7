"""A gateway client for the command line, the demo and the tests: credentials, requests, streams."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common import env
from services.gateway.tokens import ensure_dev_keys, mint_token
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc


@dataclass
class StreamResult:
    """Everything one Generate stream returned."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    done: pb.Completion | None = None


def local_state_dir(flag: str | None) -> Path:
    """The local mesh's keys, logs and data: `--state-dir`, else $THERMOCLINE_STATE_DIR, else ./var."""
    return Path(flag or env.get_str("THERMOCLINE_STATE_DIR", "var"))


def dev_token(state_dir: Path, subject: str = "dev-user", tenant: str = "dev") -> str:
    """A token signed with the development key under `state_dir` (made on first use)."""
    private_path, _ = ensure_dev_keys(state_dir / "keys")
    return mint_token(private_path.read_bytes(), subject=subject, tenant=tenant)


def bearer_token(flag: str | None, state_dir: Path, subject: str, tenant: str) -> str:
    """`--token`, else $THERMOCLINE_TOKEN, else a development token (see dev_token)."""
    return flag or env.get_optional_str("THERMOCLINE_TOKEN") or dev_token(state_dir, subject, tenant)


def build_request(
    text: str, *, chat: bool = False, model: str = "", max_tokens: int = 0, temperature: float = 0.0
) -> pb.GenerateRequest:
    """A Generate request for a raw prompt, or for a one-turn chat when `chat` is set."""
    sampling = pb.SamplingOptions(max_tokens=max_tokens, temperature=temperature)
    if chat:
        turns = pb.ChatTurns(messages=[pb.ChatMessage(role="user", content=text)])
        return pb.GenerateRequest(model=model, chat=turns, sampling=sampling)
    return pb.GenerateRequest(model=model, prompt=text, sampling=sampling)


def call_metadata(token: str | None, intent: str | None = None) -> list[tuple[str, str]]:
    """The metadata of a gateway call."""
    metadata = [("authorization", f"Bearer {token}")] if token else []
    if intent:
        metadata.append(("x-intent", intent))
    return metadata


def stream_generate(
    channel: grpc.Channel,
    request: pb.GenerateRequest,
    metadata: list[tuple[str, str]],
    timeout_s: float | None = None,
) -> Iterator[pb.GenerateResponse]:
    """The raw Generate stream."""
    return pb_grpc.GatewayServiceStub(channel).Generate(request, metadata=metadata, timeout=timeout_s)


def finish_name(finish_reason: int) -> str:
    """A FinishReason as a short lower-case word: `length`, `stop`, `safety`, ..."""
    return pb.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()


def collect(responses: Iterator[pb.GenerateResponse], echo: bool = False) -> StreamResult:
    """Reads a whole stream, printing the text as it comes when `echo` is set."""
    result = StreamResult()
    for response in responses:
        if response.HasField("delta"):
            result.text += response.delta.text
            result.token_ids.extend(response.delta.token_ids)
            if echo:
                print(response.delta.text, end="", flush=True)
        else:
            result.done = response.done
    if echo:
        print()
    return result
