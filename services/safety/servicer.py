"""The safety service's gRPC face: protobuf in, screen or gate, protobuf out."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from services.common.errors import DeadlineExceeded, InvalidArgument
from services.common.heap import trim_heap
from services.safety.cancellation import observing
from services.safety.classifier import TextKind, TextTooLong
from services.safety.config import SafetyConfig
from services.safety.embedder import CheckCancelled, CheckProgress
from services.safety.row_batcher import RowBatcher
from services.safety.screen import Screen, ScreenVerdict
from services.safety.tenant_policy import TenantPolicy
from thermocline.safety.v1 import safety_pb2 as pb
from thermocline.safety.v1 import safety_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHECKS = Counter(
    "thermocline_safety_checks_total", "Safety checks by layer and decision.", ["layer", "decision"]
)
TRIGGERS = Counter(
    "thermocline_safety_triggers_total",
    "Checks in which a category reached its threshold, by layer and category.",
    ["layer", "category"],
)
CHECK_SECONDS = Histogram(
    "thermocline_safety_check_duration_seconds",
    "Time to screen one text (all views and windows, classifier and deny patterns).",
    ["layer"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
WINDOWS_EMBEDDED = Counter(
    "thermocline_safety_windows_embedded_total",
    "Windows the checks embedded, by layer: a check whose call is done (cancelled, past its "
    "deadline) stops adding to it at its next batch.",
    ["layer"],
)
# Rows per round: rate(thermocline_safety_windows_embedded_total) over this one's _count rate.
ROUND_CHECKS = Histogram(
    "thermocline_safety_round_requests",
    "Checks whose rows one encoder round embedded together (row_batcher.py).",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
GATE_INFO = Gauge(
    "thermocline_safety_gate_info",
    "1 for the gate this service serves and screens with (sha256: its weights'; manifest_sha256: "
    "its manifest's, thresholds included).",
    ["version", "sha256", "manifest_sha256"],
)
# Texts longer than this are refused rather than screened slowly; the gateway never sends more.
MAX_TEXT_CHARS = 1_000_000
MAX_TURNS = 1024  # a chat's turns per CheckPrompt; the gateway allows fewer


class SafetyServicer(pb_grpc.SafetyServiceServicer):
    """Screens prompts and outputs, and serves the gate file."""

    def __init__(self, config: SafetyConfig, screen: Screen) -> None:
        self.config = config
        self.screen = screen
        # Up to `max_concurrent_checks` checks at once, each on a thread of a fixed pool, their
        # rows embedded together on the batcher's thread (`register`, row_batcher.py): one encoder
        # pass serves many stream screens, and a short check does not wait behind a long chat.
        # Every encoder pass runs on that one thread, so its large buffers come from one malloc
        # arena, and now and then the heap's free memory goes back to the OS
        # (services/common/heap.py): a process that ran its checks on the default executor's
        # rotating threads grew to about 1 GiB. With 1, one check at a time embeds its own rows.
        num_checks = config.max_concurrent_checks
        self._slots = asyncio.Semaphore(num_checks)
        self._checker = ThreadPoolExecutor(max_workers=num_checks, thread_name_prefix="safety-check")
        self._last_trim_s = -math.inf

    async def CheckPrompt(self, request: pb.CheckPromptRequest, context: Any) -> pb.CheckResponse:
        turns = tuple(request.turns)
        if len(turns) > MAX_TURNS:
            raise InvalidArgument(f"chat of {len(turns)} turns exceeds the {MAX_TURNS} limit")
        if (chars := sum(map(len, turns))) > MAX_TEXT_CHARS:
            raise InvalidArgument(f"chat turns of {chars} characters exceed the {MAX_TEXT_CHARS} limit")
        roles = tuple(request.roles)
        if roles and len(roles) != len(turns):
            raise InvalidArgument(
                f"chat has {len(roles)} roles for {len(turns)} turns; send one role per turn, in the "
                "order of turns, or none"
            )
        policy = tenant_policy_from_pb(request.policy)
        return await self._check(context, "prompt", request.text, policy, turns, roles)

    async def CheckOutput(self, request: pb.CheckOutputRequest, context: Any) -> pb.CheckResponse:
        return await self._check(context, "output", request.text, tenant_policy_from_pb(request.policy))

    async def GetGate(self, request: pb.GetGateRequest, context: Any) -> pb.GetGateResponse:
        gate = self.screen.gate
        return pb.GetGateResponse(
            version=gate.version,
            sha256=gate.sha256,
            weights=b"" if request.metadata_only else gate.weights_bytes,
            manifest_json=gate.manifest_json,
            categories=[
                pb.GateCategory(name=name, prompt_threshold=t.prompt, output_threshold=t.output or 0.0)
                for name, t in self.screen.categories.items()
            ],
        )

    async def _check(
        self,
        context: Any,
        layer: TextKind,
        text: str,
        policy: TenantPolicy,
        turns: tuple[str, ...] = (),
        roles: tuple[str, ...] = (),
    ) -> pb.CheckResponse:
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidArgument(f"text of {len(text)} characters exceeds the {MAX_TEXT_CHARS} limit")
        progress = CheckProgress(on_rows_embedded=WINDOWS_EMBEDDED.labels(layer).inc)
        # The check runs on a checker thread, where cancelling this task cannot reach it: the
        # flag stops it once its call is done, and a caller gone while it queued skips it whole.
        context.add_done_callback(lambda _: progress.is_cancelled.set())
        loop = asyncio.get_running_loop()
        async with self._slots:
            with CHECK_SECONDS.labels(layer).time():
                try:
                    check = functools.partial(self._screen, progress, layer, text, policy, turns, roles)
                    verdict = await loop.run_in_executor(self._checker, contextvars.copy_context().run, check)
                except TextTooLong as error:
                    raise InvalidArgument(str(error)) from None
                except asyncio.CancelledError:
                    progress.is_cancelled.set()
                    raise
                except CheckCancelled:
                    raise _call_done(context) from None
                finally:
                    self._trim_now_and_then()
        self._record(layer, verdict)
        return self._to_pb(verdict, policy)

    def _screen(
        self,
        progress: CheckProgress,
        layer: TextKind,
        text: str,
        policy: TenantPolicy,
        turns: tuple[str, ...],
        roles: tuple[str, ...] = (),
    ) -> ScreenVerdict:
        """Screen.check on a checker thread; a check whose call is done says in the log how far it got."""
        try:
            with observing(progress):  # the decoders and the language screen read it there
                return self.screen.check(text, layer, policy, turns, progress, roles)
        except CheckCancelled:
            num_rows = progress.num_rows_embedded
            log.info("%s check stopped after embedding %d windows: its call is done", layer, num_rows)
            raise

    def _trim_now_and_then(self) -> None:
        """Queues a heap trim behind this check, at most once every `heap_trim_interval_s`: the reply
        does not wait for it, and memory handed back is faulted in again by the next check (about
        2 ms on a short one), so trimming after every check would tax every check."""
        interval_s = self.config.heap_trim_interval_s
        now = time.monotonic()
        if interval_s >= 0 and now - self._last_trim_s >= interval_s:
            self._last_trim_s = now
            self._checker.submit(trim_heap)

    def _record(self, layer: str, verdict: ScreenVerdict) -> None:
        decision = "block" if verdict.is_blocked else "allow"
        CHECKS.labels(layer, decision).inc()
        span = trace.get_current_span()
        span.set_attribute("thermocline.safety.layer", layer)
        span.set_attribute("thermocline.safety.decision", decision)
        span.set_attribute("thermocline.safety.policy_version", self.screen.version)
        for category, score in verdict.scores.items():
            span.set_attribute(f"thermocline.safety.score.{category}", score)
            if score >= verdict.thresholds[category] and category not in verdict.categories_off:
                TRIGGERS.labels(layer, category).inc()

    def _safe_message(self, verdict: ScreenVerdict) -> str:
        if not verdict.is_blocked:
            return ""
        return self.config.language_message if verdict.is_language_only else self.config.safe_message

    def _to_pb(self, verdict: ScreenVerdict, policy: TenantPolicy) -> pb.CheckResponse:
        return pb.CheckResponse(
            decision=pb.DECISION_BLOCK if verdict.is_blocked else pb.DECISION_ALLOW,
            scores=[
                pb.CategoryScore(
                    category=name,
                    score=score,
                    threshold=verdict.thresholds[name],
                    is_off=name in verdict.categories_off,
                )
                for name, score in verdict.scores.items()
            ],
            reasons=list(verdict.reasons),
            policy_version=self.screen.version,
            safe_message=self._safe_message(verdict),
            tenant_policy=policy.describe(),
            waived=list(verdict.waived),
        )


def _call_done(context: Any) -> BaseException:
    """What a check stopped by its call's end raises: DEADLINE_EXCEEDED past the deadline, else
    the cancellation its caller asked for (nobody reads either)."""
    remaining_s = context.time_remaining()
    if remaining_s is not None and remaining_s <= 0:
        return DeadlineExceeded("the safety check passed its deadline; retry with a longer one")
    return asyncio.CancelledError()


def tenant_policy_from_pb(policy: pb.TenantPolicy) -> TenantPolicy:
    """The domain policy of a check request (an unset one leaves the gate as it is)."""
    return TenantPolicy(frozenset(policy.categories_off), dict(policy.thresholds))


def register(server: grpc.aio.Server, config: SafetyConfig) -> list[str]:
    """Loads and verifies the gate and the deny patterns, adds the servicer; returns its service name."""
    screen = Screen.load(config)
    if config.max_concurrent_checks > 1:  # the checks' rows, embedded together
        embedder = screen.classifier.embedder
        embedder.batcher = RowBatcher(embedder.embed_rows_now, on_round=ROUND_CHECKS.observe)
    GATE_INFO.labels(screen.gate.version, screen.gate.sha256, screen.gate.manifest_sha256).set(1)
    pb_grpc.add_SafetyServiceServicer_to_server(SafetyServicer(config, screen), server)
    return [pb.DESCRIPTOR.services_by_name["SafetyService"].full_name]
