"""The gateway's audit log: every allow or deny decision, durable before the caller hears of it.

Events go to one of two hash-chained streams (see audit_chain.py): `decisions` (kept
`retention_days`, 90 by default) and `admin` (admin, audit and policy actions, kept
`admin_retention_days`, 365 by default). Writes are group-committed: concurrent calls share one
write and one fsync, and `record` returns only after the fsync. Neither the raw prompt nor the
token is ever logged; the prompt appears as its sha256.

When a write fails (a full disk, an I/O error), `record` raises UNAVAILABLE, so the call it
audits is refused rather than served unaudited; the failed batch is cut from the segment, the
`thermocline_gateway_audit_unwritable_seconds` gauge counts up from 0, and the next write tries
again. An event is acknowledged only after its fsync, so a failure loses nothing acknowledged.

The admin chain records the log itself (audit_streams.py): the first write after opening the log
is preceded by an `audit.start` event naming every stream's tip, and retention records each
segment it deletes in an `audit.prune` event, on disk before the segment is gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import stat
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import takewhile
from pathlib import Path
from typing import Any

from services.common.errors import Unavailable
from services.gateway.audit_chain import GENESIS_HASH, ChainWriter, last_record, segment_paths
from services.gateway.audit_checkpoint import Signer, check_key_outside, load_key
from services.gateway.audit_streams import (
    ADMIN,
    DECISIONS,
    PRUNE_ACTION,
    START_ACTION,
    STREAMS,
    AdminNote,
    PruneNote,
    prune_details,
    start_details,
    stream_of_segment,
)
from services.gateway.metrics import AuditHealth

log = logging.getLogger(__name__)

ADMIN_ACTIONS = frozenset({"admin", "read_audit", "policy.load", PRUNE_ACTION, START_ACTION})
# Admin first: when the other write of a batch then fails, its callers are refused and none of
# their events is on disk (an `audit.start` or prune record written alone is harmless).
_WRITE_ORDER = (ADMIN, *(s for s in STREAMS if s != ADMIN))
ALLOW, DENY = "allow", "deny"
UNAUTHENTICATED = "unauthenticated"  # the actor of a call whose token has not verified (yet)
# Every string in a record is cut to this many characters, so no caller can make a record large:
# a record stays under about 8 KiB whatever the request held.
MAX_FIELD_CHARS = 512
_MAX_DETAILS = 16


def prompt_sha256(text: str) -> str:
    """The digest that stands in for a prompt in the log."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def utc_timestamp(now_s: float | None = None) -> str:
    """ISO 8601 UTC with milliseconds and a Z, e.g. 2026-11-30T12:00:00.123Z."""
    moment = datetime.fromtimestamp(time.time() if now_s is None else now_s, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


@dataclass(frozen=True)
class AuditEvent:
    """One decision, in the standard audit fields."""

    actor_principal: str
    tenant: str
    action: str
    resource: str
    decision: str
    reason: str = ""
    request_id: str = ""
    trace_id: str = ""
    prompt_sha256: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)
    event_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    timestamp_utc: str = field(default_factory=utc_timestamp)

    @property
    def stream(self) -> str:
        """The stream, and so the retention, this event belongs to."""
        return ADMIN if self.action in ADMIN_ACTIONS else DECISIONS

    def to_record(self) -> dict[str, Any]:
        """The event as the JSON object that is chained, every string bounded."""
        record: dict[str, Any] = {k: bounded(v) for k, v in asdict(self).items() if k != "details"}
        details = list(self.details.items())[:_MAX_DETAILS]
        record["details"] = {bounded(str(name)): _bounded_value(value) for name, value in details}
        return record


def bounded(text: str) -> str:
    """`text` cut to MAX_FIELD_CHARS, saying how much was cut."""
    if len(text) <= MAX_FIELD_CHARS:
        return text
    return f"{text[:MAX_FIELD_CHARS]}...[{len(text) - MAX_FIELD_CHARS} more characters cut]"


def _bounded_value(value: Any) -> Any:
    """A details value with its strings bounded (details are one level of scalars or flat dicts)."""
    if isinstance(value, str):
        return bounded(value)
    if isinstance(value, Mapping):
        return {
            bounded(str(k)): bounded(v) if isinstance(v, str) else v
            for k, v in list(value.items())[:_MAX_DETAILS]
        }
    return value


@dataclass(frozen=True)
class AuditConfig:
    """Where the log lives, how long segments are kept, when a segment is rotated, and how it is signed.

    `key_file` holds the checkpoint signing key (see audit_checkpoint.py); it must lie outside
    `directory`. Without it the chain still shows careless edits, but not a rewritten chain.
    `unauthenticated_per_s`: refusals of callers with no verified identity written one by one per
    second, the rest counted in summaries (audit_sampling.py); `free_refusals_per_s`: the same,
    per tenant, for a verified caller's refusals that take nothing from its bucket; 0 writes every one.
    """

    directory: Path
    retention_days: float = 90.0
    admin_retention_days: float = 365.0
    rotate_bytes: int = 64 * 1024 * 1024
    key_file: Path | None = None
    checkpoint_interval_s: float = 60.0
    unauthenticated_per_s: float = 10.0
    free_refusals_per_s: float = 10.0

    def __post_init__(self) -> None:
        if self.unauthenticated_per_s < 0:
            raise ValueError(
                "THERMOCLINE_GATEWAY_AUDIT_UNAUTHENTICATED_PER_S must be >= 0 (0: every refusal), "
                f"got {self.unauthenticated_per_s}"
            )
        if self.free_refusals_per_s < 0:
            raise ValueError(
                "THERMOCLINE_GATEWAY_AUDIT_FREE_REFUSALS_PER_S must be >= 0 (0: every refusal), "
                f"got {self.free_refusals_per_s}"
            )
        if self.key_file is not None:
            check_key_outside(self.key_file, self.directory)
        if self.checkpoint_interval_s < 0:
            raise ValueError(f"audit checkpoint interval must be >= 0 s, got {self.checkpoint_interval_s}")
        if self.retention_days <= 0 or self.admin_retention_days <= 0:
            raise ValueError("audit retention must be > 0 days")
        if self.rotate_bytes < 4096:
            raise ValueError(f"audit rotation size {self.rotate_bytes} B is below 4 KiB")

    def retention_s(self, stream: str) -> float:
        """How long a closed segment of `stream` is kept."""
        return (self.admin_retention_days if stream == ADMIN else self.retention_days) * 86400.0


class AuditLog:
    """Appends events durably, in order, with one fsync per batch of concurrent events.

    Writes come from the flusher's thread and from retention's (`prune`, which the gateway runs
    in a thread of its own); one lock keeps them to one at a time, as ChainWriter needs."""

    def __init__(self, config: AuditConfig) -> None:
        self.config = config
        signer = None
        if config.key_file is None:
            log.warning("no audit signing key configured: a rewritten audit chain would go unnoticed")
        else:
            signer = Signer(load_key(config.key_file))
        _make_private(config.directory)
        self._writers = {
            s: ChainWriter(config.directory, s, config.rotate_bytes, signer, config.checkpoint_interval_s)
            for s in STREAMS
        }
        self.health = AuditHealth()
        self._pending: list[tuple[AuditEvent, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._write_lock = threading.Lock()
        self._is_start_recorded = False

    async def record(self, event: AuditEvent) -> None:
        """Appends `event`; returns once it is on disk (fsynced)."""
        await asyncio.shield(self.submit(event))

    def submit(self, event: AuditEvent) -> asyncio.Future[None]:
        """Queues `event` now, after every event submitted before it; the future is done once it
        is on disk, or fails (UNAVAILABLE) when its batch could not be written."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((event, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self._write, [event for event, _ in batch])
            except OSError as error:  # the callers learn of it; nothing in the batch is acknowledged
                self.health.record_failure()
                _fail(batch, error)
                continue
            except Exception as error:
                log.exception("audit write failed")
                for _, future in batch:
                    future.set_exception(error)
                continue
            self.health.record_success()
            for _, future in batch:
                future.set_result(None)

    def _write(self, events: list[AuditEvent]) -> None:
        with self._write_lock:
            self._append(events)

    def _append(self, events: list[AuditEvent]) -> None:
        """Writes `events` to their streams, after this log's `audit.start` if not yet written."""
        if not self._is_start_recorded:
            tips = {s: (writer.count, writer.last_hash) for s, writer in self._writers.items()}
            events = [_start_event(tips), *events]
        for stream in _WRITE_ORDER:
            records = [e.to_record() for e in events if e.stream == stream]
            if records:
                self._writers[stream].append(records)
        self._is_start_recorded = True

    def prune(self, now_s: float | None = None) -> list[AuditEvent]:
        """Deletes closed segments past their retention, each after its `audit.prune` event is on disk."""
        now_s = time.time() if now_s is None else now_s
        with self._write_lock:
            expired = self._expired_segments(now_s)
            events = [_prune_event(path) for path in expired]
            if events:
                self._append(events)  # a crash before the deletions leaves segments, never a gap
            for path in expired:
                path.unlink()
        return events

    def _expired_segments(self, now_s: float) -> list[Path]:
        """Every stream's oldest closed segments past retention, up to the admin segment that holds
        the prune record another stream's chain will start from: without it that start is
        unverifiable, so it and the segments after it wait for that stream's next prune."""
        expired = {stream: self._past_retention(stream, now_s) for stream in STREAMS}
        starts = {_start_hash(self._kept(s, expired[s])) for s in STREAMS if s != ADMIN} - {"", GENESIS_HASH}
        expired[ADMIN] = list(takewhile(lambda path: not _holds_prune_of(path, starts), expired[ADMIN]))
        return [path for stream in STREAMS for path in expired[stream]]

    def _past_retention(self, stream: str, now_s: float) -> list[Path]:
        """The stream's oldest closed segments past retention: only ever a prefix, as a chain that
        lost a segment from its middle would not verify."""
        current, retention_s = self._writers[stream].current_segment(), self.config.retention_s(stream)
        closed = segment_paths(self.config.directory, stream)[:-1]
        return list(takewhile(lambda p: p != current and now_s - p.stat().st_mtime >= retention_s, closed))

    def _kept(self, stream: str, expired: list[Path]) -> list[Path]:
        return [path for path in segment_paths(self.config.directory, stream) if path not in expired]

    def close(self) -> None:
        """Closes the segment files."""
        for writer in self._writers.values():
            writer.close()


def _fail(batch: list[tuple[AuditEvent, asyncio.Future[None]]], error: OSError) -> None:
    """Refuses every call of a batch that could not be written, and raises the alert metric."""
    log.error("audit write failed (%s); refusing the %d call(s) it would have recorded", error, len(batch))
    message = (
        f"the audit log cannot be written ({error.strerror or error}); no call is served unaudited, "
        "retry later or on another gateway"
    )
    for _, future in batch:
        future.set_exception(Unavailable(message))


def _make_private(directory: Path) -> None:
    """Sets an existing audit directory that others may read to 0700 (one made by an older gateway,
    or a volume's mount point); files older than the 0600 mode are then out of their reach too."""
    try:
        mode = stat.S_IMODE(directory.stat().st_mode)
    except FileNotFoundError:
        return  # ChainWriter creates it 0700
    if not mode & 0o077:
        return
    try:
        directory.chmod(0o700)
    except PermissionError:
        log.warning(
            "audit directory %s has mode %o and is not the gateway's to change: other local users can "
            "read who called, as which tenant, and prompt hashes; `chmod 700` it",
            directory,
            mode,
        )
        return
    log.warning("audit directory %s had mode %o; now 700: only the gateway reads its log", directory, mode)


def _start_event(tips: Mapping[str, tuple[int, str]]) -> AuditEvent:
    return AuditEvent(
        actor_principal="thermocline-gateway",
        tenant="",
        action=START_ACTION,
        resource="audit:streams",
        decision=ALLOW,
        reason="audit log opened",
        details=start_details(tips),
    )


def _prune_event(path: Path) -> AuditEvent:
    record = last_record(path) or {}
    return AuditEvent(
        actor_principal="thermocline-gateway",
        tenant="",
        action=PRUNE_ACTION,
        resource=f"audit:{stream_of_segment(path.name)}/{path.name}",
        decision=ALLOW,
        reason="retention period over",
        details=prune_details(path.name, str(record.get("hash", "")), int(record.get("seq", 0))),
    )


def _start_hash(segments: list[Path]) -> str:
    """The hash the oldest of these segments chains from ("" when there is none to read)."""
    if not segments:
        return ""
    with segments[0].open("rb") as file:
        first = file.readline()
    try:
        return str(json.loads(first)["prev_hash"])
    except (ValueError, KeyError, TypeError):
        return ""


def _holds_prune_of(path: Path, last_hashes: set[str]) -> bool:
    """Whether the admin segment holds an `audit.prune` event of a segment with one of these last hashes."""
    if not last_hashes:
        return False
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            note = PruneNote.from_record(json.loads(line), AdminNote(0, f"{path.name}:{number}", ""))
        except (ValueError, AttributeError):
            continue
        if note is not None and note.last_hash in last_hashes:
            return True
    return False
