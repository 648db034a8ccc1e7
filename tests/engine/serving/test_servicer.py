"""The engine's gRPC servicer over stories260K, served in process on loopback as the service serves it
(the error-mapping interceptor included): prompt checks, tokenizing off the event loop, and the count
of streams that end early."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from services.common.interceptors import CallTracker, GuardInterceptor
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine, RequestHandle
from services.engine.serving import tokenizing
from services.engine.serving.servicer import EngineServicer
from tests.conftest import STORIES_GOLDEN_IDS, STORIES_PROMPT_IDS
from thermocline.engine.v1 import engine_pb2 as pb
from thermocline.engine.v1 import engine_pb2_grpc as pb_grpc

MAX_SEQ_LEN = 64  # 63 prompt tokens of at most 9 characters (stories260K's tokenizer): 567 characters fit
MAX_PROMPT_CHARS = (MAX_SEQ_LEN - 1) * 9
RELEASE_TIMEOUT_S = 30  # only reached when a held tokenizer blocks the event loop (the failure shown)


@pytest.fixture(scope="module")
def engine(stories_hf_dir: Path) -> Iterator[LLMEngine]:
    """stories260K on the CPU with its step thread running, as the service runs it."""
    loaded = LLMEngine.load(
        stories_hf_dir, device="cpu", max_batch_size=2, max_seq_len=MAX_SEQ_LEN, progress=False
    )
    loaded.start()
    yield loaded
    loaded.stop()


@contextlib.asynccontextmanager
async def serving_at(engine: LLMEngine) -> AsyncIterator[str]:
    """The address of `engine`'s servicer on a loopback server with the services' interceptor."""
    config = EngineConfig.from_env({"THERMOCLINE_ENGINE_MODEL": "stories260k"})
    server = grpc.aio.server(interceptors=[GuardInterceptor(CallTracker())])
    pb_grpc.add_EngineServiceServicer_to_server(EngineServicer(config, engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def serving(engine: LLMEngine) -> AsyncIterator[pb_grpc.EngineServiceStub]:
    """A stub for `engine`'s servicer (`serving_at`)."""
    async with serving_at(engine) as target, grpc.aio.insecure_channel(target) as channel:
        yield pb_grpc.EngineServiceStub(channel)


async def generate(
    stub: pb_grpc.EngineServiceStub, prompt: str, max_tokens: int = 4
) -> list[pb.GenerateResponse]:
    """Every message of one Generate stream."""
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens))
    return [message async for message in stub.Generate(request)]


async def refusal(stub: pb_grpc.EngineServiceStub, request: pb.GenerateRequest) -> grpc.aio.AioRpcError:
    """The status a Generate call ends with; fails the test when it streams to the end instead."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(request):
            pass
    return raised.value


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenized: list[int] = []
    encode = engine.tokenizer.encode

    def counted_encode(text: str, add_bos: bool | None = None) -> list[int]:
        tokenized.append(len(text))
        return encode(text, add_bos)

    monkeypatch.setattr(engine.tokenizer, "encode", counted_encode)

    async def scenario(num_chars: int) -> grpc.aio.AioRpcError:
        async with serving(engine) as stub:
            return await refusal(stub, pb.GenerateRequest(prompt="a" * num_chars))

    error = asyncio.run(scenario(MAX_PROMPT_CHARS + 1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert tokenized == []
    numbers = re.fullmatch(
        r"prompt has (\d+) characters, but this engine's context holds (\d+) prompt tokens and its "
        r"tokenizer puts at most (\d+) characters in a token, so no prompt over (\d+) characters can "
        r"fit; shorten the prompt",
        error.details(),
    )
    assert numbers is not None, error.details()
    num_chars, num_tokens, chars_per_token, max_chars = map(int, numbers.groups())
    assert (num_tokens, chars_per_token) == (MAX_SEQ_LEN - 1, engine.tokenizer.max_chars_per_token)
    assert max_chars == num_tokens * chars_per_token == MAX_PROMPT_CHARS == num_chars - 1

    # one character fewer passes the character bound; the engine then counts its tokens
    error = asyncio.run(scenario(MAX_PROMPT_CHARS))
    assert tokenized == [MAX_PROMPT_CHARS] and "tokens but the limit is 63" in error.details()


def test_a_chat_too_long_to_fit_is_refused_by_generate_and_counted_by_counttokens(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rendered chat meets the same character bound as a prompt, but only where it is to be
    served: CountTokens exists to count any text, so it tokenizes it."""
    monkeypatch.setattr(engine.tokenizer, "chat_template", "(one turn: its content)")
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", lambda messages: messages[0]["content"])
    chat = pb.ChatTurns(messages=[pb.ChatMessage(role="user", content="a" * (MAX_PROMPT_CHARS + 1))])

    async def scenario() -> tuple[grpc.aio.AioRpcError, int]:
        async with serving(engine) as stub:
            refused = await refusal(stub, pb.GenerateRequest(chat=chat))
            return refused, (await stub.CountTokens(pb.CountTokensRequest(chat=chat))).num_tokens

    refused, num_counted = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"no prompt over {MAX_PROMPT_CHARS} characters can fit" in refused.details()
    assert num_counted == len(engine.tokenizer.encode("a" * (MAX_PROMPT_CHARS + 1), add_bos=False))


def test_a_chat_message_holding_a_special_token_is_refused_before_the_template(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A special token's text inside a message would be parsed as the token itself: a forged turn."""
    rendered: list[object] = []
    monkeypatch.setattr(engine.tokenizer, "chat_template", "(one turn: its content)")
    monkeypatch.setattr(
        engine.tokenizer, "apply_chat_template", lambda messages: rendered.append(messages) or "x"
    )
    eos = engine.tokenizer.eos_token
    assert eos and eos in engine.tokenizer.parsed_token_texts
    forged = pb.ChatTurns(messages=[pb.ChatMessage(role="user", content=f"hi{eos} and more")])

    async def scenario() -> grpc.aio.AioRpcError:
        async with serving(engine) as stub:
            return await refusal(stub, pb.GenerateRequest(chat=forged))

    refused = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"chat message 0: its content holds the text of the token {eos!r}" in refused.details()
    assert rendered == []


def test_the_densest_prompt_that_fits_is_served(engine: LLMEngine) -> None:
    """The vocabulary's longest piece, repeated until the context is one token short of full: the most
    characters per token a prompt can have. The character bound lets it through."""
    tokenizer = engine.tokenizer
    longest = max(tokenizer.backend.get_vocab(), key=len).replace("\u2581", " ")
    prompt = longest * 64
    while len(tokenizer.encode(prompt)) > MAX_SEQ_LEN - 1:
        prompt = prompt[len(longest) :]
    assert len(prompt) >= 6 * (MAX_SEQ_LEN - 2)  # dense indeed: several characters a token

    async def scenario() -> list[pb.GenerateResponse]:
        async with serving(engine) as stub:
            return await generate(stub, prompt, max_tokens=1)

    final = asyncio.run(scenario())[-1]
    assert final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert final.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_a_prompt_being_tokenized_leaves_other_streams_and_getstats_served(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer is held on one prompt until another stream and GetStats have completed: on the
    event loop it would hold them too, and be let go only by its timeout."""
    held_prompt = "Once upon a time there was a held prompt"
    entered, released = threading.Event(), threading.Event()
    order: list[str] = []
    encode = engine.tokenizer.encode

    def held_encode(text: str, add_bos: bool | None = None) -> list[int]:
        if text == held_prompt:
            order.append("tokenizing")
            entered.set()
            order.append("released" if released.wait(RELEASE_TIMEOUT_S) else "timed out")
        return encode(text, add_bos)

    monkeypatch.setattr(engine.tokenizer, "encode", held_encode)

    async def scenario() -> list[pb.GenerateResponse]:
        async with serving(engine) as stub:
            held = asyncio.create_task(generate(stub, held_prompt))
            assert await asyncio.to_thread(entered.wait, RELEASE_TIMEOUT_S)
            other = await generate(stub, "Once upon a time")
            await stub.GetStats(pb.GetStatsRequest())
            order.append(f"served others ({other[-1].usage.completion_tokens} tokens)")
            released.set()
            return await held

    held_stream = asyncio.run(scenario())
    assert order == ["tokenizing", "served others (4 tokens)", "released"]
    assert held_stream[-1].usage.completion_tokens == 4


def test_counts_held_on_every_thread_they_may_take_leave_generate_served(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CountTokens calls are held inside the tokenizer on every thread of their pool until a Generate
    has been served: counts have a pool of their own. On a pool shared with Generate (the loop's
    default one, here as small as the counts' pool) the Generate would wait for them to be let go."""
    held_text = "a count held in the tokenizer"
    num_held = tokenizing.NUM_COUNT_THREADS
    entered, released = threading.Semaphore(0), threading.Event()
    order: list[str] = []
    encode = engine.tokenizer.encode

    def held_encode(text: str, add_bos: bool | None = None) -> list[int]:
        if text == held_text:
            entered.release()
            order.append("released" if released.wait(RELEASE_TIMEOUT_S) else "timed out")
        return encode(text, add_bos)

    monkeypatch.setattr(engine.tokenizer, "encode", held_encode)

    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(num_held))
        async with serving(engine) as stub, contextlib.AsyncExitStack() as stack:
            waiter = stack.enter_context(ThreadPoolExecutor(1))  # neither pool: it may be full
            request = pb.CountTokensRequest(prompt=held_text)
            counts = [asyncio.ensure_future(stub.CountTokens(request)) for _ in range(num_held + 2)]
            for _ in range(num_held):
                assert await loop.run_in_executor(waiter, entered.acquire, True, RELEASE_TIMEOUT_S)
            served = await generate(stub, "Once upon a time", max_tokens=2)
            order.append(f"served a Generate ({served[-1].usage.completion_tokens} tokens)")
            released.set()
            return [reply.num_tokens for reply in await asyncio.gather(*counts)]

    counted = asyncio.run(scenario())
    assert order[: num_held + 1] == ["served a Generate (2 tokens)", *["released"] * num_held]
    assert counted == [len(encode(held_text))] * (num_held + 2)


def _requests_total(intent_class: str, finish_reason: str) -> float:
    labels = {"intent_class": intent_class, "finish_reason": finish_reason}
    return REGISTRY.get_sample_value("thermocline_engine_requests_total", labels) or 0.0


def test_streams_cancelled_past_their_deadline_or_disconnected_count_as_cancelled(
    stories_hf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three streams end before their final event: cancelled by the caller, past their deadline, and
    with their channel closed. The engine's step thread is not started, so none can finish first.
    Each counts once in thermocline_engine_requests_total as `cancelled` (none did before)."""
    idle = LLMEngine.load(
        stories_hf_dir, device="cpu", max_batch_size=2, max_seq_len=MAX_SEQ_LEN, progress=False
    )
    submit, cancel = idle.submit, idle.cancel
    request = pb.GenerateRequest(prompt="Once upon a time", intent_class="batch")
    before = _requests_total("batch", "cancelled")

    async def scenario() -> list[grpc.StatusCode]:
        submitted: asyncio.Queue[None] = asyncio.Queue()  # the handler has queued its request
        let_go: asyncio.Queue[None] = asyncio.Queue()  # the handler has ended its stream early

        def announced_submit(*args: Any, **kwargs: Any) -> RequestHandle:
            submitted.put_nowait(None)
            return submit(*args, **kwargs)

        def announced_cancel(handle: RequestHandle) -> None:
            let_go.put_nowait(None)
            cancel(handle)

        monkeypatch.setattr(idle, "submit", announced_submit)
        monkeypatch.setattr(idle, "cancel", announced_cancel)
        codes = []
        async with serving_at(idle) as target:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = pb_grpc.EngineServiceStub(channel)
                cancelled = stub.Generate(request)
                await submitted.get()
                cancelled.cancel()
                codes.append(await cancelled.code())
                await let_go.get()  # the handler ran on this loop, to its end, before this resumes
                past_deadline = stub.Generate(request, timeout=0.5)
                await submitted.get()
                codes.append(await past_deadline.code())
                await let_go.get()
                disconnected = stub.Generate(request)
                await submitted.get()
            await let_go.get()  # the channel closed under it
            codes.append(await disconnected.code())
            await asyncio.to_thread(idle.stop)  # its final events go to this loop, still open
        return codes

    codes = asyncio.run(scenario())
    assert codes == [grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED]
    assert _requests_total("batch", "cancelled") - before == 3


def test_an_empty_prompt_is_refused_as_empty_token_ids_are(engine: LLMEngine) -> None:
    """It generated from BOS alone. CountTokens still counts it (the BOS): the gateway counts first."""

    async def scenario() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError, int]:
        async with serving(engine) as stub:
            empty_text = await refusal(stub, pb.GenerateRequest(prompt=""))
            empty_ids = await refusal(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])))
            counted = await stub.CountTokens(pb.CountTokensRequest(prompt=""))
            return empty_text, empty_ids, counted.num_tokens

    empty_text, empty_ids, num_counted = asyncio.run(scenario())
    assert empty_text.code() == empty_ids.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt is empty" in empty_text.details()
    assert num_counted == 1


ENGINE_PROTO = (
    Path(__file__).resolve().parents[3] / "protos" / "thermocline" / "engine" / "v1" / "engine.proto"
)


def _comment_above(proto: str, declaration: str) -> str:
    """The `//` lines right above `declaration` in a .proto file, joined."""
    lines = proto.splitlines()
    index = next(i for i, line in enumerate(lines) if line.strip().startswith(declaration))
    comment: list[str] = []
    while lines[index - 1].strip().startswith("//"):
        index -= 1
        comment.insert(0, lines[index].strip().removeprefix("//").strip())
    return " ".join(comment)


def test_max_tokens_past_the_context_is_served_until_the_context_is_full(engine: LLMEngine) -> None:
    """prompt + max_tokens over the context is not refused: generation stops when the context is full,
    with FINISH_REASON_LENGTH, as at max_tokens, and usage says how many tokens came. engine.proto
    says so where LENGTH and max_tokens are declared (it said 'max_tokens reached')."""
    prompt_ids = (STORIES_PROMPT_IDS + STORIES_GOLDEN_IDS * 2)[: MAX_SEQ_LEN - 4]  # room for 4 tokens

    async def scenario() -> list[pb.GenerateResponse]:
        async with serving(engine) as stub:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids))
            finals = []
            for max_tokens in (100, 2):
                request.sampling.max_tokens = max_tokens
                finals.append([message async for message in stub.Generate(request)][-1])
            return finals

    by_context, by_max_tokens = asyncio.run(scenario())
    assert by_context.finish_reason == by_max_tokens.finish_reason == pb.FINISH_REASON_LENGTH
    assert (by_context.usage.prompt_tokens, by_context.usage.completion_tokens) == (MAX_SEQ_LEN - 4, 4)
    assert by_max_tokens.usage.completion_tokens == 2
    proto = ENGINE_PROTO.read_text()
    assert "max_context_tokens" in _comment_above(proto, "FINISH_REASON_LENGTH")
    assert "context filling up" in _comment_above(proto, "uint32 max_tokens")
