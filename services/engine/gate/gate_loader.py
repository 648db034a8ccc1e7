"""Start-up of the in-loop gate: read the gate file (or fetch it from safety), check it, report it.

The safety service is the authority on which gate is current: its `GetGate` announces the
version and sha256. The engine compares that with the weights it holds. A mismatch is never
silent: the report says MISMATCH, and under the `refuse` policy every request is refused with
FAILED_PRECONDITION; under `warn` the engine logs it and serves with its own gate when that
file at least matches its own manifest. A gate whose engine head reads another model (other
name or hidden size) leaves the model ungated, reported as UNCOVERED. A gate that cannot be read
at all, or a safety service that must supply the gate and does not answer, stops the start-up.

While the engine serves, gate_watch.py asks safety again every `recheck_s` seconds and applies the
same rules to the gate the engine holds, so a gate swapped on either side shows (and a refusal
lifts) without a restart. A refusing engine's server health ("") stays SERVING: that check is the
pod's liveness probe (deploy/k8s), whose restarts would not mend a gate file that differs from
safety's, and would reload the model over and over. Readiness is another matter: a replica that
refuses every Generate should get no traffic, and `GateWatch.readiness_problem` says so: it is the
engine's readiness probe (services/common/server.py), which turns only the engine service's own
health name NOT_SERVING, the name deploy/k8s's readinessProbe checks.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc
import torch

from services.common.gate_file import (
    ENGINE_HEAD,
    GateFileError,
    GateManifest,
    HeadSpec,
    manifest_path_for,
    parse_gate,
    sha256_hex,
)
from services.common.service_auth import authenticated, token_from_env
from services.engine.gate.safety_gate import DEFAULT_SAFE_MESSAGE, GateReport, GateStatus, InLoopGate
from services.engine.model.registry import REGISTRY, SharedModel, model_dirs
from thermocline.safety.v1 import safety_pb2, safety_pb2_grpc

log = logging.getLogger(__name__)

# The gate the safety service ships with; the engine reads the same file by default.
DEFAULT_GATE_FILE = Path(__file__).resolve().parents[2] / "safety" / "gates" / "gate.safetensors"
FINAL_NORM_LAYER = "final_norm"  # the only layer the engine hands the gate (StepOutput.hidden_states)


class GateSource(enum.Enum):
    """Where the engine gets the gate's bytes."""

    FILE = "file"  # the local file; safety, when configured, only announces the hash
    SAFETY = "safety"  # the bytes of safety's GetGate
    OFF = "off"  # no gate: serve ungated


class MismatchPolicy(enum.Enum):
    """What the engine does when its gate's hash is not the announced one."""

    REFUSE = "refuse"  # every Generate gets FAILED_PRECONDITION
    WARN = "warn"  # log it and serve


@dataclass(frozen=True)
class GateConfig:
    """The engine's gate settings (read from `THERMOCLINE_ENGINE_GATE_*` in EngineConfig)."""

    source: GateSource = GateSource.FILE
    file: Path = DEFAULT_GATE_FILE
    safety_target: str | None = None  # host:port of the safety service; None: no announcement to check
    mismatch: MismatchPolicy = MismatchPolicy.REFUSE
    safe_message: str = DEFAULT_SAFE_MESSAGE
    safety_timeout_s: float = 30.0  # how long start-up (and each re-check) waits for safety's GetGate
    recheck_s: float = 30.0  # seconds between re-checks of safety's announcement while serving; 0: never

    def __post_init__(self) -> None:
        if not self.safe_message:
            raise ValueError("THERMOCLINE_ENGINE_SAFE_MESSAGE must not be empty")
        if self.safety_timeout_s <= 0:
            raise ValueError(f"THERMOCLINE_ENGINE_SAFETY_TIMEOUT_S must be > 0, got {self.safety_timeout_s}")
        if not self.recheck_s >= 0:  # NaN fails this too
            raise ValueError(f"THERMOCLINE_ENGINE_GATE_RECHECK_S must be >= 0 (0: off), got {self.recheck_s}")
        if self.source is GateSource.SAFETY and not self.safety_target:
            raise ValueError(
                "THERMOCLINE_ENGINE_GATE_SOURCE=safety needs THERMOCLINE_ENGINE_SAFETY_TARGET (host:port)"
            )


class ServedModel(NamedTuple):
    """What the gate's feature spec is matched against."""

    names: tuple[str, ...]  # the configured name and the checkpoint's id, e.g. smollm2-135m-instruct
    hidden_size: int


class LoadedGate(NamedTuple):
    """The head to run (None: ungated) and the report to show."""

    head: InLoopGate | None
    report: GateReport


class GateUnavailable(RuntimeError):
    """The gate cannot be obtained at all; the message says what to fix."""


class Announcement(NamedTuple):
    """Safety's GetGate reply."""

    version: str
    sha256: str
    manifest_json: str
    weights: bytes


class HeldGate(NamedTuple):
    """The gate the engine obtained at start-up: its manifest (None: no gate) and what it made of it."""

    manifest: GateManifest | None
    loaded: LoadedGate


def open_gate(config: GateConfig, model: ServedModel, device: torch.device) -> LoadedGate:
    """Obtains, checks and places the gate on `device`; see the module docstring for the rules."""
    return hold_gate(config, model, device).loaded


def hold_gate(config: GateConfig, model: ServedModel, device: torch.device) -> HeldGate:
    """`open_gate`, keeping the manifest that later re-checks compare with safety's announcement."""
    if config.source is GateSource.OFF:
        report = GateReport(GateStatus.ABSENT, detail="THERMOCLINE_ENGINE_GATE_SOURCE=off")
        return HeldGate(None, LoadedGate(None, report))
    announced = ask_safety(config)
    manifest_json, weights = _gate_bytes(config, announced)
    loaded = check_gate(config, manifest_json, weights, announced, model, device)
    return HeldGate(GateManifest.parse(manifest_json), loaded)


def check_gate(
    config: GateConfig,
    manifest_json: str,
    weights: bytes,
    announced: Announcement | None,
    model: ServedModel,
    device: torch.device,
) -> LoadedGate:
    """Checks gate bytes against their manifest, safety's announcement and the model; places the head."""
    manifest = GateManifest.parse(manifest_json)
    report = gate_report(config, manifest, sha256_hex(weights), announced, model)
    log_report(report)
    if not report.is_active:
        return LoadedGate(None, report)
    gate = parse_gate(manifest_json, weights)  # checks the tensors' shapes
    head = gate.head_weights(ENGINE_HEAD)
    return LoadedGate(InLoopGate(head, gate.manifest.categories, config.safe_message, device), report)


def ask_safety(config: GateConfig) -> Announcement | None:
    """Safety's announced gate (with its bytes when they are the source), or None when not asked.

    Under `source=file` a safety that does not answer leaves the gate unverified; under
    `source=safety` the engine cannot start without it.
    """
    if config.safety_target is None:
        return None
    request = safety_pb2.GetGateRequest(metadata_only=config.source is GateSource.FILE)
    try:
        with authenticated(grpc.insecure_channel(config.safety_target), token_from_env()) as channel:
            stub = safety_pb2_grpc.SafetyServiceStub(channel)
            reply = stub.GetGate(request, timeout=config.safety_timeout_s, wait_for_ready=True)
    except grpc.RpcError as error:
        message = (
            f"the safety service at {config.safety_target} did not answer GetGate within "
            f"{config.safety_timeout_s:.0f} s ({error.code().name}: {error.details()})"
        )
        if config.source is GateSource.SAFETY:
            hint = "; start it first or set THERMOCLINE_ENGINE_GATE_SOURCE=file"
            raise GateUnavailable(message + hint) from None
        log.warning("%s; the gate stays unverified", message)
        return None
    return announcement_from_pb(reply)


def announcement_from_pb(reply: safety_pb2.GetGateResponse) -> Announcement:
    """Safety's GetGate reply as the checks read it."""
    return Announcement(reply.version, reply.sha256.lower(), reply.manifest_json, reply.weights)


def _gate_bytes(config: GateConfig, announced: Announcement | None) -> tuple[str, bytes]:
    if config.source is GateSource.SAFETY:
        assert announced is not None  # ask_safety raised otherwise
        return announced.manifest_json, announced.weights
    try:
        return manifest_path_for(config.file).read_text(), config.file.read_bytes()
    except OSError as error:
        raise GateFileError(
            f"cannot read the engine's gate file {error.filename}: {error.strerror}; set "
            "THERMOCLINE_ENGINE_GATE_FILE to a gate .safetensors with its .json manifest beside it, "
            "or THERMOCLINE_ENGINE_GATE_SOURCE=off to serve ungated"
        ) from None


def gate_report(
    config: GateConfig,
    manifest: GateManifest,
    actual_sha256: str,
    announced: Announcement | None,
    model: ServedModel,
) -> GateReport:
    """The rules of the module docstring: how gate bytes stand against their manifest, safety's
    announcement (None: not asked, or no answer) and the model.

    Whether the head runs depends on the bytes alone (they cover the model and match their own
    manifest), never on the announcement: under a refusal it keeps gating the streams admitted
    before, and a re-check that changes the announcement never has to place or drop a head.
    """
    problems = _hash_problems(manifest, actual_sha256, announced, config)
    uncovered = _coverage_problem(manifest, model)
    is_covered = uncovered is None
    base = GateReport(
        GateStatus.OK,
        manifest.version,
        actual_sha256,
        announced.sha256 if announced else "",
    )
    if problems:
        is_self_consistent = manifest.sha256 == actual_sha256
        is_warned = config.mismatch is MismatchPolicy.WARN
        return _replace(
            base,
            GateStatus.MISMATCH,
            "; ".join([*problems, *([uncovered] if uncovered else [])]),
            is_active=is_covered and is_self_consistent,
            is_refusing=is_covered and not is_warned,
        )
    if uncovered is not None:
        return _replace(base, GateStatus.UNCOVERED, uncovered + "; this model is served ungated")
    if announced is None:
        detail = (
            "no THERMOCLINE_ENGINE_SAFETY_TARGET to check against"
            if not config.safety_target
            else (f"the safety service at {config.safety_target} did not answer")
        )
        return _replace(base, GateStatus.UNVERIFIED, detail, is_active=True)
    return _replace(
        base, GateStatus.OK, f"sha256 equals what {config.safety_target} announces", is_active=True
    )


def _replace(base: GateReport, status: GateStatus, detail: str, **flags: bool) -> GateReport:
    return GateReport(status, base.version, base.sha256, base.announced_sha256, detail, **flags)


def _hash_problems(
    manifest: GateManifest, actual_sha256: str, announced: Announcement | None, config: GateConfig
) -> list[str]:
    problems = []
    if manifest.sha256 != actual_sha256:
        problems.append(
            f"gate {manifest.version}'s weights hash to {actual_sha256} "
            f"but its manifest says {manifest.sha256}"
        )
    if announced is not None and announced.sha256 != actual_sha256:
        problems.append(
            f"the safety service at {config.safety_target} announces gate {announced.version} with "
            f"sha256 {announced.sha256}, the engine holds {manifest.version} with {actual_sha256}"
            + _remedy(config, announced)
        )
    elif announced is not None and announced.version != manifest.version:
        # the hash covers the weights only; thresholds live in the manifest, whose version says which
        problems.append(
            f"the safety service at {config.safety_target} announces gate {announced.version}, the engine "
            f"holds {manifest.version}: the weights are the same, the manifests (thresholds) may not be"
            + _remedy(config, announced)
        )
    return problems


def _remedy(config: GateConfig, announced: Announcement) -> str:
    """What ends a difference with safety's gate, as this engine is configured."""
    if config.source is GateSource.SAFETY:
        # Its bytes came from safety at start-up. A new gate is not swapped in under running streams
        # (their earlier tokens were gated by the old one): a restart fetches it.
        return f"; the engine fetches safety's gate at start-up only: restart it to load {announced.version}"
    if config.recheck_s > 0:
        return f"; re-checked every {config.recheck_s:g} s, this clears once both hold the same gate"
    return "; the engine checks only at start-up (THERMOCLINE_ENGINE_GATE_RECHECK_S=0): restart it then"


def _coverage_problem(manifest: GateManifest, model: ServedModel) -> str | None:
    """None when the gate's engine head reads this model's final normed hidden state."""
    spec: HeadSpec | None = manifest.heads.get(ENGINE_HEAD)
    if spec is None:
        return f"gate {manifest.version} has no {ENGINE_HEAD!r} head"
    features = spec.features
    names = {n.lower() for n in model.names}
    if str(features.get("model", "")).lower() not in names:
        return (
            f"gate {manifest.version}'s engine head reads {features.get('model')!r}, not {model.names[0]!r}"
        )
    if features.get("hidden_size") != model.hidden_size:
        return (
            f"gate {manifest.version}'s engine head reads hidden size {features.get('hidden_size')}, "
            f"the model has {model.hidden_size}"
        )
    if features.get("layer", FINAL_NORM_LAYER) != FINAL_NORM_LAYER:
        layer = features.get("layer")
        return f"gate {manifest.version}'s engine head reads layer {layer!r}, not {FINAL_NORM_LAYER!r}"
    return None


def log_report(report: GateReport) -> None:
    """One log line for a report: a warning when the gate is in doubt."""
    level = logging.WARNING if report.status in (GateStatus.MISMATCH, GateStatus.UNVERIFIED) else logging.INFO
    log.log(
        level,
        "safety gate %s: %s (%s)%s",
        report.version,
        report.status.value,
        report.detail,
        "; refusing every request" if report.is_refusing else "",
    )


def served_model(configured: str, path: Path, model_id: str, hidden_size: int) -> ServedModel:
    """The names the gate's `model` may use: as configured, the checkpoint's id, the registry's name."""
    shared_dir = model_dirs().shared_dir
    registered = [
        name
        for name, entry in REGISTRY.items()
        if (isinstance(entry, SharedModel) and _same_path(shared_dir / entry.relative_path, path))
        or (not isinstance(entry, SharedModel) and entry.file_name == path.name)
    ]
    return ServedModel((configured, model_id, *registered), hidden_size)


def _same_path(a: Path, b: Path) -> bool:
    return a.expanduser().resolve() == b.expanduser().resolve()
