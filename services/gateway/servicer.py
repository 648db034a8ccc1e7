"""The gateway's gRPC face: authenticate, screen the prompt, relay the engine's stream."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.errors import InvalidArgument, NotFound
from services.gateway.auth import JwtVerifier, Principal
from services.gateway.config import GatewayConfig
from services.gateway.relay import RelaySettings, blocked_messages, relay
from services.gateway.upstream import Upstreams
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc
from thermocline.safety.v1 import safety_pb2

DEFAULT_INTENT = "default"


def _metadata(context: Any) -> dict[str, str]:
    return {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}


def prompt_text(request: pb.GenerateRequest) -> str:
    """The text the safety service screens: the prompt, or every turn of the chat."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return request.prompt
    if kind == "chat":
        return "\n".join(f"{m.role}: {m.content}" for m in request.chat.messages)
    raise InvalidArgument("request has no input: set either prompt or chat")


def engine_request(
    request: pb.GenerateRequest, principal: Principal, intent: str
) -> engine_pb2.GenerateRequest:
    """The engine's view of a client request."""
    sampling = request.sampling
    converted = engine_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        sampling=engine_pb2.SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop=list(sampling.stop),
        ),
        intent_class=intent,
        cache_salt=principal.tenant,
    )
    if sampling.HasField("seed"):
        converted.sampling.seed = sampling.seed
    if request.WhichOneof("input") == "prompt":
        converted.prompt = request.prompt
    else:
        converted.chat.messages.extend(
            engine_pb2.ChatMessage(role=m.role, content=m.content) for m in request.chat.messages
        )
    return converted


class GatewayServicer(pb_grpc.GatewayServiceServicer):
    """The public API."""

    def __init__(self, config: GatewayConfig, verifier: JwtVerifier, upstreams: Upstreams) -> None:
        self.config = config
        self.verifier = verifier
        self.upstreams = upstreams

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        metadata = _metadata(context)
        principal = self.verifier.verify(metadata.get("authorization"))
        text = prompt_text(request)
        model = await self._resolve_model(request.model, context.time_remaining())
        settings = self._settings(text, principal, model, context.time_remaining())
        self._annotate_span(request, principal, model)
        verdict = await self.upstreams.check_prompt(text, principal.tenant, settings.safety_timeout_s)
        if verdict.decision == safety_pb2.DECISION_BLOCK:
            trace.get_current_span().add_event("safety.block", {"thermocline.safety.layer": "prompt"})
            for message in blocked_messages(verdict.safe_message, settings, None):
                yield message
            return
        intent = metadata.get("x-intent") or DEFAULT_INTENT
        async for message in relay(self.upstreams, engine_request(request, principal, intent), settings):
            yield message

    async def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        self.verifier.verify(_metadata(context).get("authorization"))
        info = await self.upstreams.model_info(context.time_remaining())
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(
                    name=info.model,
                    max_context_tokens=info.max_context_tokens,
                    has_chat_template=info.has_chat_template,
                )
            ]
        )

    async def _resolve_model(self, requested: str, timeout_s: float | None) -> str:
        info = await self.upstreams.model_info(timeout_s)
        if requested and requested != info.model:
            raise NotFound(f"model {requested!r} is not served here; available: {info.model}")
        return info.model

    def _settings(
        self, text: str, principal: Principal, model: str, deadline_s: float | None
    ) -> RelaySettings:
        safety_timeout_s = self.config.safety_timeout_s
        if deadline_s is not None:
            safety_timeout_s = min(safety_timeout_s, deadline_s)
        return RelaySettings(
            prompt_text=text,
            tenant=principal.tenant,
            model=model,
            trace_id=telemetry.current_trace_id(),
            check_tokens=self.config.output_check_tokens,
            safety_timeout_s=safety_timeout_s,
            deadline_s=deadline_s,
        )

    def _annotate_span(self, request: pb.GenerateRequest, principal: Principal, model: str) -> None:
        span = trace.get_current_span()
        span.set_attribute("gen_ai.operation.name", "chat" if request.HasField("chat") else "text_completion")
        span.set_attribute("gen_ai.request.model", model)
        if request.sampling.max_tokens:
            span.set_attribute("gen_ai.request.max_tokens", request.sampling.max_tokens)
        span.set_attribute("enduser.id", principal.subject)


def register(server: grpc.aio.Server, config: GatewayConfig) -> tuple[list[str], Upstreams]:
    """Adds the gateway servicer; returns its full service name and the upstream channels."""
    upstreams = Upstreams(config.engine_target, config.safety_target)
    servicer = GatewayServicer(config, JwtVerifier(config.jwt), upstreams)
    pb_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    return [pb.DESCRIPTOR.services_by_name["GatewayService"].full_name], upstreams
