"""The OpenAI-compatible front driven by the real `openai` client and by curl, against a real mesh."""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import time
from urllib.parse import urlsplit

import grpc
import openai
import pytest

from services.cli.mesh import Mesh
from services.cli.trace_collector import ENGINE_GENERATE, SAFETY_CHECK_PROMPT, TraceCollector
from tests.conftest import STORIES_PROMPT, TEST_SAFE_MESSAGE, engine_stats, wait_for_engine_idle
from tests.gateway.conftest import call
from tests.http.conftest import HTTP_GATEWAY, HttpGateway, http_replica

NUM_TOKENS = 12
HTTP_COMPLETIONS = ("thermocline-gateway", "POST /v1/completions")
INTENT = {"X-Intent": "chat"}  # the test policy names no default intent


def client(gateway: HttpGateway, api_key: str | None = None) -> openai.OpenAI:
    """A sync client that never retries, so every refusal reaches the test."""
    return openai.OpenAI(
        base_url=gateway.base_url,
        api_key=api_key or gateway.user_token,
        max_retries=0,
        default_headers=INTENT,
    )


def complete(gateway: HttpGateway, **kwargs: object) -> openai.types.Completion:
    """One greedy completion of the stories prompt."""
    fields = {"model": "", "prompt": STORIES_PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0.0} | kwargs
    return client(gateway).completions.create(**fields)  # type: ignore[call-overload,no-any-return]


def test_a_completion_matches_the_grpc_answer_with_usage(http_gateway: HttpGateway) -> None:
    answer = complete(http_gateway)
    target = http_gateway.mesh.target(HTTP_GATEWAY)
    grpc_answer = call(target, http_gateway.user_token, max_tokens=NUM_TOKENS, intent="chat")
    assert answer.choices[0].text == grpc_answer.text
    assert answer.choices[0].finish_reason == "length"
    assert answer.object == "text_completion" and answer.model == grpc_answer.done.model
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (5, NUM_TOKENS)
    assert answer.usage.total_tokens == 5 + NUM_TOKENS


def test_async_streaming_gives_the_same_text_then_usage_then_done(http_gateway: HttpGateway) -> None:
    whole = complete(http_gateway).choices[0].text

    async def stream() -> list[openai.types.Completion]:
        async with openai.AsyncOpenAI(
            base_url=http_gateway.base_url,
            api_key=http_gateway.user_token,
            max_retries=0,
            default_headers=INTENT,
        ) as async_client:
            chunks = await async_client.completions.create(
                model="",
                prompt=STORIES_PROMPT,
                max_tokens=NUM_TOKENS,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("is_named", [False, True], ids=["default-model", "named-model"])
def test_every_streamed_chunk_names_the_model_of_the_whole_answer(
    http_gateway: HttpGateway, is_named: bool
) -> None:
    served = complete(http_gateway).model  # a request that names no model gets the default
    assert served
    chunks = list(
        client(http_gateway).completions.create(
            model=served if is_named else "",
            prompt=STORIES_PROMPT,
            max_tokens=NUM_TOKENS,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 2 and {chunk.model for chunk in chunks} == {served}


def test_chat_without_a_template_is_refused_with_the_fix(http_gateway: HttpGateway) -> None:
    # stories260K has no chat template: the engine's refusal reaches the caller as a 400
    with pytest.raises(openai.BadRequestError) as refused:
        client(http_gateway).chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert "no chat template" in str(refused.value) and "plain prompt" in str(refused.value)


def test_sync_chat_streaming_is_refused_before_the_stream_starts(http_gateway: HttpGateway) -> None:
    with pytest.raises(openai.BadRequestError):
        client(http_gateway).chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"n": 2}, "'n'"),
        ({"logprobs": 2}, "'logprobs'"),
        ({"extra_body": {"response_format": {"type": "json_object"}}}, "'response_format'"),
        ({"prompt": ["one", "two"]}, "'prompt'"),
        ({"stream_options": {"include_usage": True}}, "'stream_options'"),
        ({"temperature": 500.0}, "temperature"),
    ],
)
def test_unsupported_fields_get_a_400_naming_them(
    http_gateway: HttpGateway, fields: dict[str, object], named: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        complete(http_gateway, **fields)
    assert refused.value.status_code == 400 and named in refused.value.message


def test_unknown_fields_are_refused_and_seed_stop_user_are_honoured(http_gateway: HttpGateway) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        complete(http_gateway, extra_body={"max_token": 3})
    assert "unknown field 'max_token'" in refused.value.message
    whole = complete(http_gateway).choices[0].text
    stop = whole.split()[2]
    stopped = complete(http_gateway, stop=[stop], seed=7, user="end-user-42", n=1, logprobs=None)
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text


def test_refusals_carry_the_right_status(http_gateway: HttpGateway) -> None:
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        complete_with(http_gateway, "not-a-jwt")
    assert unauthenticated.value.status_code == 401
    with pytest.raises(openai.PermissionDeniedError):
        complete_with(http_gateway, http_gateway.reader_token)
    with pytest.raises(openai.NotFoundError) as missing:
        complete(http_gateway, model="no-such-model")
    assert "is not served here" in missing.value.message
    with pytest.raises(openai.BadRequestError) as bad_intent:
        client(http_gateway).completions.create(
            model="", prompt="x", max_tokens=1, extra_headers={"X-Intent": "no-such-intent"}
        )
    assert "unknown intent" in bad_intent.value.message


def complete_with(gateway: HttpGateway, api_key: str) -> None:
    client(gateway, api_key).completions.create(model="", prompt=STORIES_PROMPT, max_tokens=1)


def test_a_rate_limited_tenant_gets_429_with_retry_after(http_gateway: HttpGateway) -> None:
    tight = http_gateway.token(tenant="tight", roles=["user"])
    client(http_gateway, tight).completions.create(model="", prompt=STORIES_PROMPT, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        client(http_gateway, tight).completions.create(model="", prompt=STORIES_PROMPT, max_tokens=1)
    assert int(limited.value.response.headers["retry-after"]) >= 1
    assert limited.value.body["type"] == "rate_limit_error"  # type: ignore[index]


def test_models_are_filtered_by_rbac(http_gateway: HttpGateway) -> None:
    listed = client(http_gateway, http_gateway.reader_token).models.list()
    assert [m.id for m in listed.data] == [complete(http_gateway).model]
    with pytest.raises(openai.PermissionDeniedError):
        client(http_gateway, http_gateway.token(roles=["nobody"])).models.list()


def test_an_output_block_ends_with_content_filter(http_gateway: HttpGateway) -> None:
    # the open mesh's deny rule matches the golden continuation's third 16-token window
    answer = complete(http_gateway, max_tokens=64)
    assert answer.choices[0].finish_reason == "content_filter"
    assert answer.choices[0].text == TEST_SAFE_MESSAGE
    assert answer.usage is not None and answer.usage.prompt_tokens == 5
    assert 16 <= answer.usage.completion_tokens <= 64  # what ran before the block, charged and reported


def test_top_p_zero_keeps_only_the_most_likely_token(http_gateway: HttpGateway) -> None:
    # the gRPC API's top_p 0 is "off"; OpenAI's is the smallest nucleus, the most likely token
    sampled = {seed: complete(http_gateway, temperature=1.0, seed=seed, max_tokens=24) for seed in (1, 2)}
    assert sampled[1].choices[0].text != sampled[2].choices[0].text  # temperature 1 does sample
    seeds = (1, 2, None, None)
    texts = {
        complete(http_gateway, temperature=1.0, top_p=0, seed=s, max_tokens=24).choices[0].text for s in seeds
    }
    assert texts == {complete(http_gateway, temperature=0.0, max_tokens=24).choices[0].text}


def test_a_whole_answer_under_trailing_release_holds_none_of_the_blocked_text(
    open_mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # trailing streams text up to a window ahead of the screen; a whole answer had carried that
    # text, the deny phrase among it, ahead of the safe message
    settings = {"THERMOCLINE_GATEWAY_OUTPUT_RELEASE": "trailing"}
    with http_replica(open_mesh, tmp_path_factory, "gateway-http-trailing", **settings) as gateway:
        answer = complete(gateway, max_tokens=64)
    assert answer.choices[0].finish_reason == "content_filter"
    assert answer.choices[0].text == TEST_SAFE_MESSAGE


def test_the_http_span_joins_the_callers_trace(http_gateway: HttpGateway, collector: TraceCollector) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    complete(http_gateway, extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    spans = collector.wait_for_spans(trace_id, {HTTP_COMPLETIONS, ENGINE_GENERATE, SAFETY_CHECK_PROMPT}, 30)
    http_span = next(s for s in spans if (s.service, s.name) == HTTP_COMPLETIONS)
    assert http_span.parent_span_id == parent_id
    assert http_span.attributes["gen_ai.request.model"]


# Seeded sampling that runs to the context limit (1024 tokens on stories260K) without meeting the
# test deny rule, so only a hang-up can end the engine request early.
LONG_ANSWER = {"model": "", "prompt": STORIES_PROMPT, "max_tokens": 1500, "temperature": 1.0, "seed": 1}
LONG_ANSWER_TOKENS = 1024


def open_call(gateway: HttpGateway, fields: dict[str, object]) -> http.client.HTTPConnection:
    """A completion request sent on a raw connection whose answer the test may leave unread."""
    headers = {"Authorization": f"Bearer {gateway.user_token}", "Content-Type": "application/json"}
    url = urlsplit(gateway.base_url)
    connection = http.client.HTTPConnection(url.netloc, timeout=60)
    connection.request("POST", f"{url.path}/completions", json.dumps(fields), headers | INTENT)
    return connection


def test_a_client_that_goes_away_cancels_the_engine_request(http_gateway: HttpGateway) -> None:
    before, log_before = engine_stats(http_gateway.mesh).generated_tokens_total, len(http_gateway.log())
    connection = open_call(http_gateway, LONG_ANSWER | {"stream": True})
    answer = connection.getresponse()
    assert answer.status == 200 and answer.readline().startswith(b"data: ")  # streaming has begun
    connection.close()
    generated = wait_for_engine_idle(http_gateway.mesh).generated_tokens_total - before
    assert generated < LONG_ANSWER_TOKENS, "the engine ran the whole answer for a client that left"
    assert "Traceback" not in http_gateway.log()[log_before:]


def test_a_client_that_hangs_up_before_a_whole_answer_cancels_the_engine_request(
    http_gateway: HttpGateway,
) -> None:
    before, log_before = engine_stats(http_gateway.mesh).generated_tokens_total, len(http_gateway.log())
    connection = open_call(http_gateway, LONG_ANSWER)
    deadline = time.monotonic() + 60
    while not (stats := engine_stats(http_gateway.mesh)).num_running + stats.num_waiting:
        assert time.monotonic() < deadline, "the request never reached the engine"
    connection.close()  # no answer read: the gateway is still collecting the whole answer
    generated = wait_for_engine_idle(http_gateway.mesh).generated_tokens_total - before
    assert generated < LONG_ANSWER_TOKENS, "the engine ran the whole answer for a client that left"
    # the handler's cancellation is logged, if at all, before the engine hears of it
    assert "Traceback" not in http_gateway.log()[log_before:], "a hang-up is not an error"


def test_a_deadline_that_passes_is_a_504(http_gateway: HttpGateway) -> None:
    with pytest.raises(openai.APIStatusError) as late:
        complete(http_gateway, max_tokens=1500, extra_headers={"X-Timeout-S": "0.05"})
    assert late.value.status_code == 504


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    """curl, as a deployment check runs it; fails the test on a transport error."""
    command = ["curl", "-sS", "-H", "X-Intent: chat", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)


def test_curl_chat_line_from_the_issue_and_streaming(http_gateway: HttpGateway) -> None:
    bearer = f"Authorization: Bearer {http_gateway.user_token}"
    body = {"model": "", "prompt": STORIES_PROMPT, "temperature": 0.0, "max_tokens": NUM_TOKENS}
    plain = curl("-X", "POST", f"{http_gateway.base_url}/completions", "-H", bearer,
                 "-H", "Content-Type: application/json", "-d", json.dumps(body))  # fmt: skip
    assert json.loads(plain.stdout)["usage"]["completion_tokens"] == NUM_TOKENS
    streamed = curl("-N", "-X", "POST", f"{http_gateway.base_url}/completions", "-H", bearer,
                    "-d", json.dumps(body | {"stream": True}))  # fmt: skip
    events = [line for line in streamed.stdout.splitlines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    unauthenticated = curl("-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                           f"{http_gateway.base_url}/completions", "-d", json.dumps(body))  # fmt: skip
    assert unauthenticated.stdout == "401"


def test_health_and_ready(http_gateway: HttpGateway) -> None:
    for path in ("/health", "/ready"):
        status = curl("-o", "/dev/null", "-w", "%{http_code}", f"{http_gateway.root_url}{path}").stdout
        assert status == "200", path
    ready = json.loads(curl(f"{http_gateway.root_url}/ready").stdout)
    assert ready == {"status": "ready", "engines_serving": 1}  # anyone may ask: no addresses
    assert f"engine replicas serving: {http_gateway.mesh.target('engine')}" in http_gateway.log()


def test_an_unknown_path_gets_an_openai_error_object(http_gateway: HttpGateway) -> None:
    answer = curl("-w", "\n%{http_code}", f"{http_gateway.base_url}/embeddings")
    body, status = answer.stdout.rsplit("\n", 1)
    assert status == "404" and "/v1/completions" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize(("method", "path"), [("GET", "/models/"), ("POST", "/completions/")])
def test_a_trailing_slash_is_an_unknown_path_not_a_redirect(
    http_gateway: HttpGateway, method: str, path: str
) -> None:
    answer = http_gateway.call(method, path, b"{}", {"Host": "evil.example"})
    assert answer.status == 404 and "location" not in answer.headers
    assert answer.error["type"] == "not_found_error" and path in answer.error["message"]


def test_a_wrong_method_is_a_405_that_says_which_method_to_use(http_gateway: HttpGateway) -> None:
    answer = http_gateway.call("GET", "/completions")
    assert answer.status == 405 and answer.headers["allow"] == "POST"
    assert answer.error["type"] == "invalid_request_error" and "takes POST" in answer.error["message"]


def test_grpc_still_serves_beside_http(http_gateway: HttpGateway) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call(http_gateway.mesh.target(HTTP_GATEWAY), None)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
