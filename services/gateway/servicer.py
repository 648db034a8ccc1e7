"""The gateway's gRPC face: shed load, run the gatekeeper, screen the prompt, relay the stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace

from services.common import telemetry
from services.common.errors import DeadlineExceeded, NotFound, ThermoclineError, Unavailable
from services.gateway.admission import StreamSlots
from services.gateway.audit import ALLOW, DENY, AuditEvent, prompt_sha256
from services.gateway.auth import Principal
from services.gateway.call_metadata import CallMetadata
from services.gateway.completion_charge import CompletionCharge
from services.gateway.config import GatewayConfig, ReleasePolicy
from services.gateway.gatekeeper import (
    Admission,
    Admitted,
    Gatekeeper,
    ServedModel,
    prompt_roles,
    prompt_turns,
)
from services.gateway.in_flight import InFlightStream, InFlightStreams
from services.gateway.loop import discard, let_calls_go_out
from services.gateway.output_screen import (
    RelaySettings,
    VerdictAudit,
    blocked_messages,
    needs_audit,
    record_verdict,
)
from services.gateway.relay import relay
from services.gateway.request_bounds import RETRIEVAL_MODE_HEADER, EngineLimits
from services.gateway.router import affinity_key
from services.gateway.tenants import TenantLimits
from services.gateway.upstream import Upstreams, tenant_policy_pb
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc
from thermocline.safety.v1 import safety_pb2

log = logging.getLogger(__name__)

# The event on the gateway's Generate span as the relayed stream's first text goes to the client
# (the answer's; under trailing, the safe message that replaces a blocked prompt: under strict that
# message goes out before the relay and has no event); the time to first token ends there.
FIRST_TEXT_EVENT = "gateway.first_text"


def engine_request(
    request: pb.GenerateRequest, admission: Admission, retrieval_mode: str = ""
) -> engine_pb2.GenerateRequest:
    """The engine's view of a client request: the tenant salts the prefix cache, the class schedules
    it, and its safety policy reaches the in-loop gate."""
    sampling = request.sampling
    converted = engine_pb2.GenerateRequest(
        request_id=admission.request_id,
        sampling=engine_pb2.SamplingParams(
            max_tokens=admission.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop=list(sampling.stop),
        ),
        intent_class=admission.priority_class,
        cache_salt=admission.principal.tenant,
        retrieval_mode=retrieval_mode[:64],
    )
    if sampling.HasField("seed"):
        converted.sampling.seed = sampling.seed
    safety = admission.limits.safety
    if safety.categories_off or safety.thresholds:  # the engine's in-loop gate applies it too
        converted.gate_policy.categories_off.extend(sorted(safety.categories_off))
        converted.gate_policy.thresholds.update(safety.thresholds)
    if request.WhichOneof("input") == "prompt":
        converted.prompt = request.prompt
    else:
        converted.chat.messages.extend(
            engine_pb2.ChatMessage(role=m.role, content=m.content) for m in request.chat.messages
        )
    return converted


@contextmanager
def _traced_late(verdict: safety_pb2.CheckResponse | None) -> Iterator[None]:
    """Puts a prompt's passing verdict on the span once the calls that the body starts in its first
    loop turn have gone out, or as the body ends if that comes first. Under strict the engine call
    waits for the verdict, and its attributes (one per gate category) need not go first."""
    if verdict is None:
        yield
        return
    late = asyncio.ensure_future(_trace_after_calls(verdict))
    try:
        yield
    finally:
        if not late.done():
            late.cancel()
            record_verdict("prompt", verdict)


async def _trace_after_calls(verdict: safety_pb2.CheckResponse) -> None:
    await let_calls_go_out()
    record_verdict("prompt", verdict)


async def _released_after(
    recorded: asyncio.Future[None], messages: AsyncIterator[pb.GenerateResponse]
) -> AsyncIterator[pb.GenerateResponse]:
    """`messages`, none of which, nor their error, goes out before the call's allow event is on
    disk. The engine and the screens start beside that write (an fsync, about 0.5-3 ms) instead of
    after it. When the write failed, its UNAVAILABLE replaces the stream, which is closed: the
    engine call is cancelled and nothing of it is sent."""
    is_on_disk = False
    try:
        async for message in messages:
            if not is_on_disk:  # once, before the first message
                await _on_disk(recorded)
                is_on_disk = True
            yield message
    except Exception:
        await asyncio.shield(recorded)  # an error is heard after the event too; a failed write's wins
        raise
    finally:
        await messages.aclose()  # type: ignore[attr-defined]


async def _on_disk(recorded: asyncio.Future[None]) -> None:
    """Returns once the allow event is on disk; raises its write's failure."""
    if not recorded.done():
        await asyncio.shield(recorded)  # the audit log's flusher writes it even if this call goes
    recorded.result()


@contextmanager
def _traced_after(verdict: safety_pb2.CheckResponse) -> Iterator[None]:
    """Puts a prompt's passing verdict on the span after the body: under trailing, once the first
    text has gone to the client (its attributes, one per gate category, would otherwise come
    between the first token's arrival and its release), or as the stream is closed there."""
    try:
        yield
    finally:
        record_verdict("prompt", verdict)


def _stream_event(admission: Admission, action: str, reason: str, num_sent: int) -> AuditEvent:
    """The audit event of an admitted stream that ended early (`stream.cut`, `stream.failed`)."""
    return AuditEvent(
        actor_principal=admission.principal.subject,
        tenant=admission.principal.tenant,
        action=action,
        resource=f"model:{admission.model}",
        decision=DENY,
        reason=reason,
        request_id=admission.request_id,
        trace_id=telemetry.current_trace_id(),
        details=admission.event_details({"tokens_sent": num_sent}),
    )


class _StreamCut(Unavailable):
    """A stream cut when the gateway's grace period ran out (audited by `_end_cut`)."""


class GatewayServicer(pb_grpc.GatewayServiceServicer):
    """The public API; the checks live in the gatekeeper, the streaming in the relay."""

    def __init__(
        self, config: GatewayConfig, gatekeeper: Gatekeeper, upstreams: Upstreams, slots: StreamSlots
    ) -> None:
        self.config = config
        self.gatekeeper = gatekeeper
        self.upstreams = upstreams
        self.slots = slots
        self.in_flight = InFlightStreams()

    async def Generate(
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        limits = self.config.limits
        remaining = context.time_remaining()
        lifetime_s = limits.max_stream_s if remaining is None or remaining > limits.max_stream_s else None
        # A caller that stops reading leaves this generator waiting at its `yield` while the call's
        # task waits to send: cancelling that task ends the call and frees its slot.
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None
        # The drain's cut cancels the task too, wherever it waits; a cancel that lands in a write
        # is thrown in at the `yield` below, so either way it is ended here.
        stream = InFlightStream(task)
        try:
            async with asyncio.timeout(lifetime_s) as lifetime:
                with self.slots.hold():
                    async with contextlib.aclosing(self._generate(request, context, stream)) as messages:
                        async for message in messages:
                            stall = loop.call_later(limits.write_stall_s, task.cancel)
                            try:
                                yield message
                            finally:
                                stall.cancel()
        except TimeoutError:
            if not lifetime.expired():
                raise
            raise DeadlineExceeded(
                f"the stream ran for {limits.max_stream_s:g} s, the gateway's limit for a call without "
                "a shorter deadline (THERMOCLINE_GATEWAY_MAX_STREAM_S); set a deadline, or ask for "
                "fewer tokens"
            ) from None
        except asyncio.CancelledError:
            if not stream.is_cut:
                raise  # the caller went away, or stopped reading for longer than the write stall
            raise await self._end_cut(stream) from None

    async def _generate(
        self, request: pb.GenerateRequest, context: Any, stream: InFlightStream
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        resolve = lambda name: self._resolve_model(name, context.time_remaining())  # noqa: E731
        metadata = CallMetadata.of(context)
        screens: list[asyncio.Future[safety_pb2.CheckResponse]] = []

        async def screen_prompt(text: str, principal: Principal, limits: TenantLimits) -> None:
            # The prompt's screen starts as soon as the call is authorized and valid, and runs
            # beside the rest of admission (token count, budget and bucket, audit write).
            timeout_s = self._safety_timeout_s(context.time_remaining())
            policy = tenant_policy_pb(limits.safety)
            turns, roles = prompt_turns(request), prompt_roles(request)
            screens.append(
                asyncio.ensure_future(
                    self.upstreams.check_prompt(text, principal.tenant, policy, timeout_s, turns, roles)
                )
            )
            await let_calls_go_out()

        try:
            # the HTTP front's context carries the request it took for the call and the call's id
            # (which its answer names); a gRPC one neither
            taken, request_id = getattr(context, "request_taken", None), getattr(context, "request_id", None)
            admitted = await self.gatekeeper.admit_generate(
                request, metadata, resolve, screen_prompt, taken, context.time_remaining, request_id
            )
        except BaseException:
            for screen in screens:
                discard(screen)  # admission refused the call
            raise
        (check,) = screens
        answer = self._answer(request, context, metadata, admitted, check, stream)
        num_sent = 0
        try:
            # From its admission on, the drain cuts the stream (under strict, the prompt's screen too).
            with self.in_flight.track(stream, admitted.admission):
                async for message in answer:
                    num_sent += len(message.delta.token_ids)
                    yield message
        except ThermoclineError as error:
            # An error before the stream's own (the prompt's screen, routing) waits for the allow
            # event too; a failed write's UNAVAILABLE wins.
            await asyncio.shield(admitted.recorded)
            await self._record_failure(admitted.admission, error, num_sent)
            if not num_sent:
                raise
            raise type(error)(
                f"{error.message}; {num_sent} tokens of the answer had been sent: a retry starts it again",
                trailing_metadata=error.trailing_metadata,
            ) from None
        except Exception:
            await asyncio.shield(admitted.recorded)
            raise
        finally:
            self.gatekeeper.tenant_streams.release(admitted.admission.principal.tenant)
            # Every end settles the call's reservation, its answer started or not (a blocked prompt).
            admitted.admission.charge.stream_ended(num_sent)
            await answer.aclose()  # type: ignore[attr-defined]

    async def _answer(
        self,
        request: pb.GenerateRequest,
        context: Any,
        metadata: CallMetadata,
        admitted: Admitted,
        check: asyncio.Future[safety_pb2.CheckResponse],
        stream: InFlightStream,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """An admitted call's answer: the prompt's verdict, the engine's stream and its screens.
        Nothing of it goes out before the allow event is on disk; `stream` counts the tokens sent."""
        admission, recorded = admitted
        text = admission.prompt_text
        settings = self._settings(text, admission, context.time_remaining())
        self._annotate_span(request, admission)
        audit = lambda layer, verdict: self._record_verdict(admission, layer, verdict)  # noqa: E731
        charge = admission.charge  # settles the tokens the gatekeeper reserved
        # Built while the prompt's screen is in flight, not after its verdict; the replica is still
        # chosen after it, on the queue depths of that moment.
        converted = engine_request(request, admission, metadata.get(RETRIEVAL_MODE_HEADER, ""))
        key = affinity_key(admission.principal.tenant, text, self.config.routing.prefix_chars)
        # trailing: the engine starts on the prompt while safety screens it (see _behind_prompt_check)
        is_overlapped = settings.screening.release is ReleasePolicy.TRAILING
        prompt_verdict: safety_pb2.CheckResponse | None = None  # strict: a pass is traced late
        if not is_overlapped:
            prompt_verdict = await check
            await _on_disk(recorded)  # before a blocked prompt's messages, or the engine's
            if blocked := await self._screen_prompt(
                prompt_verdict, admission, settings, audit, is_pass_traced=False
            ):
                await charge.settle(0)  # the reservation is back before the caller hears of the block
                for message in blocked:
                    yield message
                return
            charge.prompt_passed()
        replicas = self.upstreams.router.candidates(key, admission.priority_class)
        relayed = relay(self.upstreams, converted, settings, replicas, audit, charge.engine_counted)
        if is_overlapped:
            relayed = self._behind_prompt_check(check, relayed, admission, settings, audit, charge)
        # The first text's event and the charge come only once the call is on record.
        relayed = _released_after(recorded, relayed)
        has_sent_text = False
        with _traced_late(prompt_verdict):
            try:
                async for message in relayed:
                    if message.HasField("done"):
                        await charge.settle(message.done.usage.completion_tokens)
                    elif not has_sent_text:
                        has_sent_text = True
                        trace.get_current_span().add_event(FIRST_TEXT_EVENT)
                    stream.num_tokens += len(message.delta.token_ids)
                    yield message
            finally:
                charge.stream_ended(stream.num_tokens)  # a stream that ends early pays what it got

    async def _screen_prompt(
        self,
        verdict: safety_pb2.CheckResponse,
        admission: Admission,
        settings: RelaySettings,
        audit: VerdictAudit,
        is_pass_traced: bool = True,
    ) -> list[pb.GenerateResponse]:
        """The prompt's verdict, traced (a pass only when `is_pass_traced`) and audited: the messages
        that replace the answer when it blocked, else none."""
        is_blocked = verdict.decision == safety_pb2.DECISION_BLOCK
        if is_blocked or is_pass_traced:
            record_verdict("prompt", verdict)
        if needs_audit(verdict):
            await audit("prompt", verdict)
        if not is_blocked:
            return []
        usage = engine_pb2.Usage(prompt_tokens=admission.prompt_tokens)  # no completion is charged
        return blocked_messages(verdict.safe_message, settings, usage)

    async def _behind_prompt_check(
        self,
        check: asyncio.Future[safety_pb2.CheckResponse],
        relayed: AsyncIterator[pb.GenerateResponse],
        admission: Admission,
        settings: RelaySettings,
        audit: VerdictAudit,
        charge: CompletionCharge,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """trailing: the engine prefills while safety screens the prompt, so the prompt check is
        not added to the first token's time; nothing is sent before the prompt passed, and a
        blocked prompt cancels the engine request and is charged no completion. The engine does
        see a prompt that is blocked, and when it finishes before the prompt's verdict, the output
        screen may check its answer; that verdict is acted on, and audited, only once the prompt
        passed."""
        passed: safety_pb2.CheckResponse | None = None  # traced once the first text is out
        try:
            async for message in relayed:
                if passed is None:
                    verdict = await check
                    blocked = await self._screen_prompt(
                        verdict, admission, settings, audit, is_pass_traced=False
                    )
                    if blocked:
                        for replacement in blocked:
                            yield replacement
                        return
                    passed = verdict
                    charge.prompt_passed()
                    with _traced_after(passed):
                        yield message
                    continue
                yield message
        finally:
            discard(check)
            await relayed.aclose()  # type: ignore[attr-defined]

    async def _record_verdict(
        self, admission: Admission, layer: str, verdict: safety_pb2.CheckResponse
    ) -> None:
        """The audit event of a safety block, or of a pass that only the tenant's policy allowed;
        either names the gate and the tenant policy the safety service applied."""
        if verdict.decision == safety_pb2.DECISION_BLOCK:
            decision, reason = DENY, f"safety: {layer} blocked (" + ", ".join(verdict.reasons) + ")"
        else:
            decision, reason = ALLOW, f"safety: {layer} passed under the tenant's policy only"
        details = {"policy_version": verdict.policy_version, "layer": layer}
        if verdict.tenant_policy:
            details |= {"tenant_policy": verdict.tenant_policy, "waived": "; ".join(verdict.waived)}
        await self.gatekeeper.record(
            AuditEvent(
                actor_principal=admission.principal.subject,
                tenant=admission.principal.tenant,
                action="invoke",
                resource=f"model:{admission.model}",
                decision=decision,
                reason=reason,
                request_id=admission.request_id,
                trace_id=telemetry.current_trace_id(),
                prompt_sha256=prompt_sha256(admission.prompt_text),
                details=admission.event_details(details),
            )
        )

    async def _record_failure(self, admission: Admission, error: ThermoclineError, num_sent: int) -> None:
        """The audit event of an admitted call whose safety check or engine failed after its allow
        event. Written when it can be: a failed audit write is what some of these failures are,
        so a second failure here is logged, not raised."""
        reason = f"{type(error).__name__} after {num_sent} tokens sent: {error.message}"
        try:
            await self.gatekeeper.record(_stream_event(admission, "stream.failed", reason, num_sent))
        except ThermoclineError:
            log.warning("could not audit the failure of request %s", admission.request_id)

    async def _end_cut(self, stream: InFlightStream) -> _StreamCut:
        """Audits a stream the drain cut; returns the error that ends its call. The count is of the
        tokens yielded, the message whose write the cut interrupted included: it reaches a client
        that reads on, ahead of the status."""
        stream.task.uncancel()  # the cut is handled: the call goes on to send its status
        admission = stream.admission
        assert admission is not None  # only admitted streams are cut
        reason = f"gateway shut down; grace period over after {stream.num_tokens} tokens sent"
        await self.gatekeeper.record(_stream_event(admission, "stream.cut", reason, stream.num_tokens))
        return _StreamCut(
            f"the gateway shut down and its {self.config.server.grace_s:g} s grace period ran out; "
            f"this stream was cut after {stream.num_tokens} tokens: retry on another replica"
        )

    async def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        timeout_s = context.time_remaining()

        async def served() -> list[str]:
            return [(await self.upstreams.model_info(timeout_s)).model]

        request_id = getattr(context, "request_id", None)  # the HTTP front's id of the call
        allowed = await self.gatekeeper.admit_list_models(CallMetadata.of(context), served, request_id)
        info = await self.upstreams.model_info(timeout_s)
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(
                    name=info.model,
                    max_context_tokens=info.max_context_tokens,
                    has_chat_template=info.has_chat_template,
                )
                for _ in allowed
            ]
        )

    async def _resolve_model(self, requested: str, timeout_s: float | None) -> ServedModel:
        info = await self.upstreams.model_info(timeout_s)
        if requested and requested != info.model:  # `requested` is bounded (request_bounds.py)
            raise NotFound(f"model {requested!r} is not served here; available: {info.model}")
        return ServedModel(info.model, EngineLimits.of(info))

    def _safety_timeout_s(self, deadline_s: float | None) -> float:
        """The safety service's timeout for a call with `deadline_s` left."""
        if deadline_s is None:
            return self.config.safety_timeout_s
        return min(self.config.safety_timeout_s, deadline_s)

    def _settings(self, text: str, admission: Admission, deadline_s: float | None) -> RelaySettings:
        safety_timeout_s = self._safety_timeout_s(deadline_s)
        return RelaySettings(
            prompt_text=text,
            tenant=admission.principal.tenant,
            model=admission.model,
            trace_id=telemetry.current_trace_id(),
            screening=self.config.output,
            safety_timeout_s=safety_timeout_s,
            deadline_s=deadline_s,
            prompt_tokens=admission.prompt_tokens,
            safety_policy=tenant_policy_pb(admission.limits.safety),
        )

    def _annotate_span(self, request: pb.GenerateRequest, admission: Admission) -> None:
        span = trace.get_current_span()
        span.set_attribute("gen_ai.operation.name", "chat" if request.HasField("chat") else "text_completion")
        span.set_attribute("gen_ai.request.model", admission.model)
        span.set_attribute("gen_ai.request.max_tokens", admission.max_tokens)
        span.set_attribute("enduser.id", admission.principal.subject)
        span.set_attribute("thermocline.tenant", admission.principal.tenant)
        span.set_attribute("thermocline.intent", admission.intent)
        span.set_attribute("thermocline.priority_class", admission.priority_class)
        span.set_attribute("thermocline.request_id", admission.request_id)  # its audit events' id
        if admission.client_request_id:  # the caller's own, in its audit events' details
            span.set_attribute("thermocline.client_request_id", admission.client_request_id)
