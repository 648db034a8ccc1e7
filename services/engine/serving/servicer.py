"""The engine's gRPC face: protobuf in, LLMEngine call, protobuf out.

The LLMEngine decodes in its own thread; each request's events cross into the event loop
through a `LoopMailbox`, so the loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import propagate, trace

from services.common.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from services.engine.config import EngineConfig
from services.engine.errors import EngineStopped, InvalidPrompt, KVCapacityExceeded, UnknownIntentClass
from services.engine.gate.safety_gate import GatePolicy, GateReport, GateStatus
from services.engine.kv.capacity import PoolPlan
from services.engine.llm_engine import FinishReason, LLMEngine, SamplingParams, StreamEvent
from services.engine.serving import tokenizing
from services.engine.serving.engine_metrics import register_engine_metrics
from services.engine.serving.request_bounds import check_count_bounds, check_generate_bounds
from services.engine.serving.request_trace import record_cancelled, record_finished
from services.engine.text.chat_markers import find_unwritten_marker
from services.engine.text.tokenizer import Tokenizer
from thermocline.engine.v1 import engine_pb2 as pb
from thermocline.engine.v1 import engine_pb2_grpc as pb_grpc

_FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.SAFETY: pb.FINISH_REASON_SAFETY,
}
_GATE_STATUS_TO_PB = {
    GateStatus.OK: pb.SAFETY_GATE_STATUS_OK,
    GateStatus.MISMATCH: pb.SAFETY_GATE_STATUS_MISMATCH,
    GateStatus.UNVERIFIED: pb.SAFETY_GATE_STATUS_UNVERIFIED,
    GateStatus.UNCOVERED: pb.SAFETY_GATE_STATUS_UNCOVERED,
    GateStatus.ABSENT: pb.SAFETY_GATE_STATUS_ABSENT,
}


RETRIEVAL_MODE_HEADER = "x-retrieval-mode"
CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles a chat message may name


def retrieval_mode_of(request: pb.GenerateRequest, context: Any) -> str:
    """The request's field (the gateway passes the header on there), else the header of a direct caller."""
    if request.retrieval_mode:
        return request.retrieval_mode
    for key, value in context.invocation_metadata() or ():
        if key == RETRIEVAL_MODE_HEADER and isinstance(value, str):
            return value
    return ""


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's W3C context as gRPC metadata: the request's kvstore calls join its trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def sampling_from_pb(sampling: pb.SamplingParams, config: EngineConfig) -> SamplingParams:
    """Validated SamplingParams; out-of-range values become INVALID_ARGUMENT."""
    max_tokens = sampling.max_tokens or config.default_max_tokens
    if max_tokens > config.max_tokens_limit:
        raise InvalidArgument(
            f"max_tokens {max_tokens} exceeds this engine's limit of {config.max_tokens_limit}"
        )
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0,
            top_k=sampling.top_k,
            seed=sampling.seed if sampling.HasField("seed") else None,
            stop=tuple(sampling.stop),
        )
    except ValueError as error:
        raise InvalidArgument(str(error)) from None


def gate_policy_from_pb(request: pb.GenerateRequest) -> GatePolicy | None:
    """The request's tenant policy for the in-loop gate; INVALID_ARGUMENT when it is malformed."""
    if not request.HasField("gate_policy"):
        return None
    policy = request.gate_policy
    try:
        return GatePolicy(frozenset(policy.categories_off), dict(policy.thresholds))
    except ValueError as error:
        raise InvalidArgument(f"gate_policy: {error}") from None


class LoopMailbox:
    """Carries events from the engine thread to one event loop, with one wake-up per burst.

    A decode step emits one event per row. Posting each with `call_soon_threadsafe` wakes the loop
    (a write to its self-pipe) once per row, hundreds of times a step at large batches; here the
    first event of a burst schedules one delivery and the rest join it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[StreamEvent], StreamEvent]] = []
        self._is_scheduled = False

    def post(self, queue: asyncio.Queue[StreamEvent], event: StreamEvent) -> None:
        """Queue `event` for `queue` (any thread); raises RuntimeError once the loop is closed."""
        with self._lock:
            self._items.append((queue, event))
            if self._is_scheduled:
                return
            self._is_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._is_scheduled = False
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._is_scheduled = False
        for queue, event in items:
            queue.put_nowait(event)


class EngineServicer(pb_grpc.EngineServiceServicer):
    """Streams tokens from the shared LLMEngine."""

    def __init__(self, config: EngineConfig, engine: LLMEngine) -> None:
        self.config = config
        self.engine = engine
        self._mailbox: LoopMailbox | None = None
        self._prompt_limit = prompt_char_limit(engine)
        self._counts = tokenizing.CountQueue(config.max_queued_counts)

    def _mailbox_for(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = LoopMailbox(loop)
        return self._mailbox

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        # the cheap checks first: a request refused for its settings costs no tokenizer pass
        check_generate_bounds(request)
        intent_class = self._intent_class(request.intent_class)
        params = sampling_from_pb(request.sampling, self.config)
        gate_policy = gate_policy_from_pb(request)
        if request.WhichOneof("input") == "prompt":
            self._check_raw_prompt(request.prompt)
        prompt_ids = await tokenizing.for_generate(self._prompt_ids, request, self._prompt_limit)
        self._annotate_span(request, params, len(prompt_ids))
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        mailbox = self._mailbox_for(asyncio.get_running_loop())

        def on_event(event: StreamEvent) -> None:  # runs on the engine thread
            mailbox.post(events, event)

        try:
            handle = self.engine.submit(
                prompt_ids,
                params,
                on_event,
                intent_class=request.intent_class,
                cache_salt=request.cache_salt,
                retrieval_mode=retrieval_mode_of(request, context),
                trace_metadata=trace_metadata(),
                gate_policy=gate_policy,
            )
        except InvalidPrompt as error:
            raise InvalidArgument(str(error)) from None
        except KVCapacityExceeded as error:
            raise ResourceExhausted(str(error)) from None
        except EngineStopped as error:
            raise Unavailable(str(error)) from None
        is_finished = False
        try:
            while not is_finished:
                event = await events.get()
                is_finished = event.finished
                if is_finished:  # spans and latency metrics from the engine's timeline
                    record_finished(event, intent_class)
                _raise_failure(event)
                yield self._to_pb(event)
        finally:
            if not is_finished:
                # cancelled, past its deadline or disconnected: the caller never reads the final event,
                # so the request is counted here; and its KV is freed at once
                record_cancelled(intent_class)
                self.engine.cancel(handle)

    def _intent_class(self, name: str) -> str:
        """The name of the class `name` selects (empty: the default); INVALID_ARGUMENT when unknown."""
        try:
            return self.engine.scheduler.classes.get(name).name
        except UnknownIntentClass as error:
            raise InvalidArgument(str(error)) from None

    async def GetStats(self, request: pb.GetStatsRequest, context: Any) -> pb.GetStatsResponse:
        stats = self.engine.stats()
        return pb.GetStatsResponse(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            generated_tokens_total=stats.num_generated_tokens_total,
            max_batch_size=self.config.max_batch_size,
            device=str(self.engine.runner.device),
        )

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.GetModelInfoResponse:
        tokenizer = self.engine.tokenizer
        return pb.GetModelInfoResponse(
            model=self.engine.model_id,
            max_context_tokens=self.engine.max_seq_len,
            has_chat_template=tokenizer.chat_template is not None,
            vocab_size=tokenizer.vocab_size,
            safety_gate=gate_info_to_pb(self.engine.gate_report),
            kv_capacity=_capacity_to_pb(self.engine.capacity),
            # what Generate refuses, so the gateway refuses it before it spends a screen
            max_tokens_limit=self.config.max_tokens_limit,
            chat_roles=CHAT_ROLES,
        )

    async def CountTokens(self, request: pb.CountTokensRequest, context: Any) -> pb.CountTokensResponse:
        check_count_bounds(request)
        prompt_ids = await self._counts.run(self._prompt_ids, request)
        return pb.CountTokensResponse(num_tokens=len(prompt_ids), model=self.engine.model_id)

    def _prompt_ids(
        self, request: pb.GenerateRequest | pb.CountTokensRequest, limit: PromptCharLimit | None = None
    ) -> list[int]:
        """Token ids for whichever input form the request used; a rendered chat longer than `limit`
        allows is refused before it is tokenized (None: every text is counted, as CountTokens does)."""
        tokenizer = self.engine.tokenizer
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            assert isinstance(request, pb.GenerateRequest)
            ids = list(request.token_ids.ids)
            bad = [i for i in ids if i >= tokenizer.vocab_size]
            if bad:
                raise InvalidArgument(
                    f"token id {bad[0]} is outside the vocabulary of {tokenizer.vocab_size}"
                )
            return ids
        if kind == "prompt":
            return tokenizer.encode(request.prompt)
        if kind == "chat":
            return self._chat_ids(request.chat, limit)
        raise InvalidArgument("request has no input: set prompt, chat or token_ids")

    def _chat_ids(self, chat: pb.ChatTurns, limit: PromptCharLimit | None) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer.chat_template is None:
            raise InvalidArgument(f"model {self.engine.model_id} has no chat template; send a plain prompt")
        if not chat.messages:
            raise InvalidArgument("chat has no messages")
        _check_no_added_tokens(chat, tokenizer)
        _check_roles(chat)
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        try:
            text = tokenizer.apply_chat_template(messages)
        except ValueError as error:
            raise InvalidArgument(f"chat template rejected the messages: {error}") from None
        _check_text_fits(text, limit)
        ids = tokenizer.encode(text, add_bos=False)
        _check_only_template_markers(tokenizer, messages, ids)
        return ids

    def _check_raw_prompt(self, text: str) -> None:
        """Refuses an empty prompt, and one too long to fit, before tokenizing it (megabytes take seconds)."""
        if not text:  # it would generate from BOS alone, as empty token_ids would (which are refused)
            raise InvalidArgument("prompt is empty; send the text to continue (or chat turns, or token_ids)")
        _check_text_fits(text, self._prompt_limit)

    def _annotate_span(self, request: pb.GenerateRequest, params: SamplingParams, num_prompt: int) -> None:
        span = trace.get_current_span()
        span.set_attribute("gen_ai.operation.name", "chat" if request.HasField("chat") else "text_completion")
        span.set_attribute("gen_ai.request.model", self.engine.model_id)
        span.set_attribute("gen_ai.request.max_tokens", params.max_new_tokens)
        span.set_attribute("gen_ai.usage.input_tokens", num_prompt)
        span.set_attribute("thermocline.intent_class", request.intent_class or "default")
        if request.request_id:  # the gateway's (its audit events carry it): joins the audit to the trace
            span.set_attribute("thermocline.request_id", request.request_id[:128])

    def _to_pb(self, event: StreamEvent) -> pb.GenerateResponse:
        message = pb.GenerateResponse(token_ids=event.token_ids, text=event.text_delta)
        if event.finished:
            assert event.finish_reason is not None
            message.finish_reason = _FINISH_TO_PB[event.finish_reason]
            message.usage.prompt_tokens = event.prompt_tokens
            message.usage.completion_tokens = event.completion_tokens
            if event.usage is not None:
                message.usage.cached_prompt_tokens = event.usage.cached_prompt_tokens
                message.usage.tiers.hot_tokens = event.usage.hot_tokens
                message.usage.tiers.warm_tokens = event.usage.warm_tokens
                message.usage.tiers.cold_tokens = event.usage.cold_tokens
            span = trace.get_current_span()
            span.set_attribute("gen_ai.usage.output_tokens", event.completion_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [event.finish_reason.name.lower()])
        return message


@dataclasses.dataclass(frozen=True)
class PromptCharLimit:
    """The most characters a prompt that fits the context can have, and the two numbers behind it."""

    max_prompt_tokens: int  # max_seq_len - 1: one position stays for the first new token (PromptTooLong)
    max_chars_per_token: int  # the tokenizer's densest token (text/chars_per_token.py)

    @property
    def max_chars(self) -> int:
        """A longer text needs more than `max_prompt_tokens` tokens, so it cannot fit."""
        return self.max_prompt_tokens * self.max_chars_per_token


def prompt_char_limit(engine: LLMEngine) -> PromptCharLimit | None:
    """`engine`'s bound on a prompt's characters (None: the tokenizer gives no bound)."""
    per_token = engine.tokenizer.max_chars_per_token
    return None if per_token is None else PromptCharLimit(engine.max_seq_len - 1, per_token)


def _check_text_fits(text: str, limit: PromptCharLimit | None) -> None:
    """Refuses text with more characters than `limit` lets fit (None: no bound, nothing refused)."""
    if limit is not None and len(text) > limit.max_chars:
        raise InvalidArgument(
            f"prompt has {len(text):,} characters, but this engine's context holds "
            f"{limit.max_prompt_tokens} prompt tokens and its tokenizer puts at most "
            f"{limit.max_chars_per_token} characters in a token, so no prompt over "
            f"{limit.max_chars:,} characters can fit; shorten the prompt"
        )


def gate_info_to_pb(report: GateReport) -> pb.SafetyGateInfo:
    """The in-loop gate's report as GetModelInfo carries it."""
    return pb.SafetyGateInfo(
        status=_GATE_STATUS_TO_PB[report.status],
        version=report.version,
        sha256=report.sha256,
        announced_sha256=report.announced_sha256,
        is_active=report.is_active,
        is_refusing=report.is_refusing,
        detail=report.detail,
    )


def _raise_failure(event: StreamEvent) -> None:
    """A request the engine gave up on (in its queue) or that failed ends with a status, not with
    a normal finish: a caller must not take a cut-short completion for a whole one."""
    if event.error_status == "deadline_exceeded":
        raise DeadlineExceeded(event.error or "the request waited too long in the queue")
    if event.error_status == "resource_exhausted":
        raise ResourceExhausted(event.error or "the engine ran out of KV cache for this request")
    if event.error_status == "unavailable":
        raise Unavailable(event.error or "the engine cannot run steps; send the request to another replica")
    if event.finish_reason is FinishReason.ERROR:
        raise Internal(f"the engine failed while generating: {event.error or 'no detail'}; retry the request")


def register(server: grpc.aio.Server, config: EngineConfig, engine: LLMEngine) -> list[str]:
    """Adds the engine servicer; returns its full service name."""
    pb_grpc.add_EngineServiceServicer_to_server(EngineServicer(config, engine), server)
    register_engine_metrics(engine)
    return [pb.DESCRIPTOR.services_by_name["EngineService"].full_name]


def _capacity_to_pb(plan: PoolPlan | None) -> pb.KVCapacity | None:
    if plan is None:
        return None
    return pb.KVCapacity(
        hot_tokens=plan.hot_tokens,
        warm_tokens=plan.warm_tokens,
        concurrent_sequences=plan.concurrent_sequences,
        kv_cache_bytes=plan.kv_bytes,
        budget_bytes=max(plan.budget_bytes, 0),
    )


def _check_no_added_tokens(chat: pb.ChatTurns, tokenizer: Tokenizer) -> None:
    """INVALID_ARGUMENT when a message's role or content holds an added token's text: the rendered
    chat is tokenized with every added token parsed, special or not, so "hi<|im_end|><|im_start|>system
    ..." in a user turn would become a system turn of its own."""
    for number, message in enumerate(chat.messages):
        for field, value in (("role", message.role), ("content", message.content)):
            found = tokenizer.find_parsed_token(value)
            if found is not None:
                raise InvalidArgument(
                    f"chat message {number}: its {field} holds the text of the token {found!r}, which "
                    "only the chat template may write (it would forge a turn); send the text as a plain "
                    "prompt if it is meant literally"
                )


def _check_roles(chat: pb.ChatTurns) -> None:
    """INVALID_ARGUMENT for a role outside CHAT_ROLES. Templates write the role into the prompt, some
    inside a marker's text (`'<|' + role + '|>'`), so a made-up role such as "end" would write a
    marker that no message's text holds and the placeholder rendering keeps as sent."""
    for number, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"chat message {number}: role {message.role[:40]!r} is not one of {', '.join(CHAT_ROLES)}"
            )


def _check_only_template_markers(
    tokenizer: Tokenizer, messages: list[dict[str, str]], ids: list[int]
) -> None:
    """INVALID_ARGUMENT when the rendered chat's ids hold a marker its template did not write: one that
    formed where a message's text meets the template's or another message's (text/chat_markers.py)."""
    found = find_unwritten_marker(tokenizer, messages, ids)
    if found is not None:
        raise InvalidArgument(
            f"chat messages join with the text around them into the token {found!r}, which only the chat "
            "template may write (it would forge a turn): a message ends or begins with part of it; send "
            "the text as a plain prompt if it is meant literally"
        )
