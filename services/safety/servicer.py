"""The safety service's gRPC face: protobuf in, policy call, protobuf out."""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import Counter, Histogram

from services.common.errors import InvalidArgument, Unimplemented
from services.safety.config import SafetyConfig
from services.safety.policy import DenyPatternPolicy, Verdict
from thermocline.safety.v1 import safety_pb2 as pb
from thermocline.safety.v1 import safety_pb2_grpc as pb_grpc

CHECKS = Counter(
    "thermocline_safety_checks_total", "Safety checks by layer and decision.", ["layer", "decision"]
)
TRIGGERS = Counter(
    "thermocline_safety_triggers_total", "Blocked checks by layer and category.", ["layer", "category"]
)
CHECK_SECONDS = Histogram(
    "thermocline_safety_check_duration_seconds",
    "Time to screen one text.",
    ["layer"],
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5),
)
# Texts longer than this are refused rather than screened slowly; the gateway never sends more.
MAX_TEXT_CHARS = 1_000_000


class SafetyServicer(pb_grpc.SafetyServiceServicer):
    """Screens prompts and outputs with the configured policy."""

    def __init__(self, config: SafetyConfig, policy: DenyPatternPolicy) -> None:
        self.config = config
        self.policy = policy

    async def CheckPrompt(self, request: pb.CheckPromptRequest, context: Any) -> pb.CheckResponse:
        return self._check("prompt", request.text)

    async def CheckOutput(self, request: pb.CheckOutputRequest, context: Any) -> pb.CheckResponse:
        return self._check("output", request.text)

    async def GetGate(self, request: pb.GetGateRequest, context: Any) -> pb.GetGateResponse:
        raise Unimplemented("GetGate: this safety version screens with deny patterns and serves no gate file")

    def _check(self, layer: str, text: str) -> pb.CheckResponse:
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidArgument(f"text of {len(text)} characters exceeds the {MAX_TEXT_CHARS} limit")
        with CHECK_SECONDS.labels(layer).time():
            verdict = self.policy.check(text)
        self._record(layer, verdict)
        return self._to_pb(verdict)

    def _record(self, layer: str, verdict: Verdict) -> None:
        decision = "block" if verdict.is_blocked else "allow"
        CHECKS.labels(layer, decision).inc()
        span = trace.get_current_span()
        span.set_attribute("thermocline.safety.layer", layer)
        span.set_attribute("thermocline.safety.decision", decision)
        for category, score in verdict.scores.items():
            if score > 0:
                TRIGGERS.labels(layer, category).inc()

    def _to_pb(self, verdict: Verdict) -> pb.CheckResponse:
        return pb.CheckResponse(
            decision=pb.DECISION_BLOCK if verdict.is_blocked else pb.DECISION_ALLOW,
            scores=[
                pb.CategoryScore(category=name, score=score, threshold=1.0)
                for name, score in verdict.scores.items()
            ],
            reasons=list(verdict.reasons),
            policy_version=self.policy.version,
            safe_message=self.config.safe_message if verdict.is_blocked else "",
        )


def register(server: grpc.aio.Server, config: SafetyConfig) -> list[str]:
    """Loads the policy and adds the safety servicer; returns its full service name."""
    policy = DenyPatternPolicy.load(config.deny_patterns_path)
    pb_grpc.add_SafetyServiceServicer_to_server(SafetyServicer(config, policy), server)
    return [pb.DESCRIPTOR.services_by_name["SafetyService"].full_name]
