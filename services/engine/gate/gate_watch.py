"""The re-check of safety's announced gate while the engine serves.

Start-up checks the gate once (gate_loader.py). Safety can be redeployed with another gate while
the engine runs, and an operator mends a refusal by deploying the matching gate to safety; both
must show without an engine restart. So every `recheck_s` seconds the watch asks safety's GetGate
(metadata only) and judges the gate the engine holds by gate_loader's rules. A changed report goes
to the engine's `set_safety_gate`, which GetModelInfo, /metrics and every Generate read.

What a re-check never does:
- swap the gate's bytes. Under `source=file` the engine holds what it read at start-up; under
  `source=safety` what safety sent then. A changed announcement is a MISMATCH under the mismatch
  policy (refuse or warn), and a restart loads the new gate: swapping heads under running streams
  would gate one stream's tokens by two gates.
- lift a MISMATCH without an answer. When safety does not answer, OK turns UNVERIFIED (as at
  start-up under `source=file`: the gate keeps running), but a MISMATCH, and its refusal, stays
  until safety announces the gate the engine holds.

The call is grpc.aio on the serving loop and the install runs in a worker thread (it waits for
the step in progress), so neither the loop nor the step thread waits on safety.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

import grpc

from services.common.channels import open_channel
from services.engine.gate.gate_loader import (
    Announcement,
    GateConfig,
    HeldGate,
    LoadedGate,
    ServedModel,
    announcement_from_pb,
    gate_report,
    log_report,
)
from services.engine.gate.safety_gate import GateReport, GateStatus, InLoopGate
from thermocline.safety.v1 import safety_pb2, safety_pb2_grpc

log = logging.getLogger(__name__)

Install = Callable[[InLoopGate | None, GateReport], None]  # LLMEngine.set_safety_gate


class GateWatch:
    """The gate the engine holds, judged against safety's latest announcement.

    `loaded` is the gate and report the engine last accepted; only `update` changes it, once the
    install returns, so an install that raises leaves a difference the next re-check installs again.
    """

    def __init__(self, config: GateConfig, model: ServedModel, held: HeldGate) -> None:
        self.config = config
        self.model = model
        self.held = held
        self.loaded = held.loaded
        self._task: asyncio.Task[None] | None = None

    @property
    def is_enabled(self) -> bool:
        """Whether there is anything to re-check: a gate, a safety service and a period."""
        return (
            self.held.manifest is not None
            and self.config.safety_target is not None
            and self.config.recheck_s > 0
        )

    def readiness_problem(self) -> str | None:
        """Why this engine should get no new traffic (its gate refuses every Generate), or None.

        For a readiness check, never a liveness one: a restart reloads the model and the same gate,
        so it mends nothing. It follows `loaded`, so the re-check that lifts the refusal clears it."""
        report = self.loaded.report
        if not report.is_refusing:
            return None
        return f"its safety gate {report.version} refuses every Generate ({report.detail})"

    def recheck(self, announced: Announcement | None) -> LoadedGate | None:
        """The gate to install after safety's answer (None: no answer), or None when nothing changed.

        Changes nothing: `update` installs what this returns."""
        report = self._judge(announced)
        if report == self.loaded.report:
            return None
        # the head depends on the held bytes only (gate_report), so a re-check keeps it
        assert report.is_active == (self.loaded.head is not None), "a re-check cannot place or drop a head"
        return LoadedGate(self.loaded.head, report)

    async def update(self, announced: Announcement | None, install: Install) -> None:
        """Re-checks against `announced` and installs a changed gate, in a worker thread; `loaded`
        follows only once `install` returns (an install that raises is tried again next time)."""
        changed = self.recheck(announced)
        if changed is None:
            return
        await asyncio.to_thread(install, *changed)
        self.loaded = changed
        log_report(changed.report)

    def _judge(self, announced: Announcement | None) -> GateReport:
        assert self.held.manifest is not None
        current = self.loaded.report
        if announced is None and current.status is GateStatus.MISMATCH:
            return current  # no answer lifts a mismatch
        report = gate_report(self.config, self.held.manifest, current.sha256, announced, self.model)
        if announced is None:  # keep what safety announced last
            return dataclasses.replace(report, announced_sha256=current.announced_sha256)
        return report

    def start(self, install: Install) -> None:
        """Re-checks every `recheck_s` seconds on the running loop, until `stop` (nothing when disabled)."""
        if self.is_enabled:
            self._task = asyncio.create_task(self._run(install))

    async def stop(self) -> None:
        """Ends the re-checks; a call to safety in flight is cancelled."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _run(self, install: Install) -> None:
        assert self.config.safety_target is not None
        async with open_channel(self.config.safety_target, trace_calls=False) as channel:
            stub = safety_pb2_grpc.SafetyServiceStub(channel)
            while True:
                await asyncio.sleep(self.config.recheck_s)
                try:
                    await self.update(await self._ask(stub), install)
                except Exception:  # a failed re-check must not end the watch; the next one retries
                    log.exception("the safety gate re-check failed; the gate's report stays as it was")

    async def _ask(self, stub: safety_pb2_grpc.SafetyServiceStub) -> Announcement | None:
        """Safety's announcement, or None when it does not answer within `safety_timeout_s`."""
        request = safety_pb2.GetGateRequest(metadata_only=True)
        try:
            reply = await stub.GetGate(request, timeout=self.config.safety_timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as error:
            log.warning(
                "the safety service at %s did not answer the gate re-check within %.0f s (%s: %s)",
                self.config.safety_target,
                self.config.safety_timeout_s,
                error.code().name,
                error.details(),
            )
            return None
        return announcement_from_pb(reply)
