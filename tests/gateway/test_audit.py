"""The audit log on real files: the chain verifies, and every kind of tampering is caught."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.errors import Unavailable
from services.gateway.audit import ADMIN, DECISIONS, STREAMS, AuditConfig, AuditEvent, AuditLog
from services.gateway.audit_chain import canonical_json, chain_hash, segment_paths
from services.gateway.audit_checkpoint import Signer, load_key
from services.gateway.audit_verify import verify_directory
from services.gateway.metrics import AUDIT_UNWRITABLE, AUDIT_WRITE_FAILURES
from tests.gateway.conftest import fill


def _event(n: int, action: str = "invoke") -> AuditEvent:
    return AuditEvent(
        actor_principal=f"user-{n}",
        tenant="acme",
        action=action,
        resource="model:stories260K",
        decision="allow" if n % 3 else "deny",
        reason="ok",
        request_id=f"req-{n}",
        trace_id="ab" * 16,
        prompt_sha256="00" * 32,
    )


def _write(directory: Path, num_events: int, rotate_bytes: int = 64 * 1024 * 1024) -> AuditLog:
    log = AuditLog(AuditConfig(directory=directory, rotate_bytes=rotate_bytes))

    async def write_all() -> None:
        # in batches of ten concurrent events: each batch is one group commit (one write, one fsync)
        for start in range(0, num_events, 10):
            await asyncio.gather(*(log.record(_event(n)) for n in range(start, min(num_events, start + 10))))

    asyncio.run(write_all())
    return log


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _problems(directory: Path) -> str:
    report = verify_directory(directory, STREAMS)
    return "; ".join(report.problems)


def test_events_carry_the_standard_fields_and_verify(tmp_path: Path) -> None:
    _write(tmp_path, 20).close()
    records = [json.loads(line) for line in _lines(segment_paths(tmp_path, DECISIONS)[0])]
    assert len(records) == 20
    assert sorted(r["request_id"] for r in records) == sorted(f"req-{n}" for n in range(20))
    first = records[0]
    assert re.fullmatch(r"[0-9a-f-]{36}", first["event_id"]) and first["event_id"][14] == "4"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["timestamp_utc"])
    for field in ("actor_principal", "tenant", "action", "resource", "decision", "trace_id", "prompt_sha256"):
        assert field in first
    assert _problems(tmp_path) == ""


def test_line_breaks_and_bidi_controls_a_caller_sent_stay_inside_their_event(tmp_path: Path) -> None:
    # A token's header is quoted in a refusal's reason; text readers split lines at NEL and at
    # U+2028/U+2029, and a right-to-left override reorders what a terminal shows.
    reason = 'malformed: x\u2028{"decision":"allow"}\u0085\u2029\u202e\u2066 é'
    log = AuditLog(AuditConfig(directory=tmp_path))
    asyncio.run(log.record(dataclasses.replace(_event(1), reason=reason)))
    log.close()
    (line,) = _lines(segment_paths(tmp_path, DECISIONS)[0])  # one event, one line, as text
    assert "é" in line  # other text stays as written
    assert not any(c in line for c in "\u0085\u2028\u2029\u202e\u2066")
    assert json.loads(line)["reason"] == reason
    assert _problems(tmp_path) == ""


@pytest.mark.parametrize("tamper", ["edit", "delete", "reorder", "truncate"])
def test_tampering_fails_verification(tmp_path: Path, tamper: str) -> None:
    _write(tmp_path, 10).close()
    path = segment_paths(tmp_path, DECISIONS)[0]
    lines = _lines(path)
    if tamper == "edit":
        lines[4] = lines[4].replace('"decision":"allow"', '"decision":"deny"')
        expected = "edited"
    elif tamper == "delete":
        del lines[4]
        expected = "deleted or reordered"
    elif tamper == "reorder":
        lines[3], lines[4] = lines[4], lines[3]
        expected = "deleted or reordered"
    else:
        del lines[-1]
        expected = "cut from the end"
    path.write_text("".join(lines))
    assert expected in _problems(tmp_path)


def test_the_cli_reports_tampering_with_its_exit_status(tmp_path: Path) -> None:
    _write(tmp_path, 5).close()
    # an empty state dir and no key setting: a local mesh's key (./var/keys after `make demo`) is not
    # this log's, and would make the untampered log fail to verify
    state = tmp_path / "state"
    cli = [sys.executable, "-m", "services.cli.main", "--state-dir", str(state)]
    command = [*cli, "audit", "verify", str(tmp_path)]
    clean_env = {k: v for k, v in os.environ.items() if k != "THERMOCLINE_GATEWAY_AUDIT_KEY_FILE"}
    ok = subprocess.run(command, capture_output=True, text=True, timeout=60, env=clean_env)
    assert ok.returncode == 0 and "decisions: 5 events" in ok.stdout, ok.stderr
    path = segment_paths(tmp_path, DECISIONS)[0]
    path.write_text(path.read_text().replace("user-2", "user-9"))
    bad = subprocess.run(command, capture_output=True, text=True, timeout=60, env=clean_env)
    assert bad.returncode == 1 and "edited" in bad.stderr


def test_the_chain_runs_across_rotated_segments(tmp_path: Path) -> None:
    _write(tmp_path, 200, rotate_bytes=4096).close()
    segments = segment_paths(tmp_path, DECISIONS)
    assert len(segments) >= 3
    assert _problems(tmp_path) == ""
    segments[1].unlink()  # a whole middle segment removed
    assert "deleted or reordered" in _problems(tmp_path)


def test_retention_prunes_old_segments_and_the_chain_still_verifies(tmp_path: Path) -> None:
    log = _write(tmp_path, 200, rotate_bytes=4096)
    segments = segment_paths(tmp_path, DECISIONS)
    old = time.time() - 91 * 86400
    for path in segments[:2]:
        os.utime(path, (old, old))
    pruned = log.prune()
    log.close()
    assert [e.details["segment"] for e in pruned] == [p.name for p in segments[:2]]
    assert segment_paths(tmp_path, DECISIONS) == segments[2:]
    assert [e.stream for e in pruned] == [ADMIN, ADMIN]  # pruning is an admin action: kept 365 days
    assert _problems(tmp_path) == ""
    # without the prune record, the cut start is caught
    for path in segment_paths(tmp_path, ADMIN):
        path.unlink()
    (tmp_path / f"{ADMIN}.head").unlink()
    problems = _problems(tmp_path)
    assert "the decisions chain starts from an unknown hash; events #1 to #" in problems
    assert "admin: the whole stream is gone" in problems


def test_admin_actions_go_to_the_long_retention_stream(tmp_path: Path) -> None:
    log = AuditLog(AuditConfig(directory=tmp_path))
    asyncio.run(log.record(_event(1, action="admin")))
    asyncio.run(log.record(_event(2)))
    log.close()
    admin = [json.loads(line)["action"] for line in _lines(segment_paths(tmp_path, ADMIN)[0])]
    assert admin == ["audit.start", "admin"]  # the log records its streams' tips when it opens
    assert len(_lines(segment_paths(tmp_path, DECISIONS)[0])) == 1
    assert AuditConfig(directory=tmp_path).retention_s(ADMIN) == 365 * 86400


def test_a_torn_last_line_is_dropped_on_restart_and_the_chain_continues(tmp_path: Path) -> None:
    _write(tmp_path, 5).close()
    path = segment_paths(tmp_path, DECISIONS)[0]
    with path.open("ab") as file:
        file.write(b'{"actor_principal":"half-writ')  # a crash mid-write: never acknowledged
    _write(tmp_path, 5).close()
    assert len(_lines(path)) == 10
    assert _problems(tmp_path) == ""


def test_a_record_stays_small_whatever_the_caller_sent(tmp_path: Path) -> None:
    log = AuditLog(AuditConfig(directory=tmp_path))
    huge = "m" * (4 * 1024 * 1024)
    event = AuditEvent(
        actor_principal=huge, tenant="acme", action="invoke", resource=f"model:{huge}", decision="deny",
        reason=f"model {huge!r} is not served here", details={"intent": huge, huge: 1},
    )  # fmt: skip
    asyncio.run(log.record(event))
    log.close()
    line = _lines(segment_paths(tmp_path, DECISIONS)[0])[0]
    assert len(line) < 8192 and "more characters cut" in line
    assert _problems(tmp_path) == ""


def test_a_full_disk_refuses_with_unavailable_raises_the_alert_and_loses_nothing_acknowledged(
    small_disk: Path,
) -> None:
    log = AuditLog(AuditConfig(directory=small_disk / "audit"))

    async def scenario() -> tuple[list[str], float, float]:
        acknowledged = []
        for n in range(5):
            await log.record(_event(n))
            acknowledged.append(f"req-{n}")
        filler = fill(small_disk)
        with pytest.raises(Unavailable, match="audit log cannot be written"):
            await asyncio.gather(*(log.record(_event(n)) for n in range(100, 110)))
        unwritable_when_full = AUDIT_UNWRITABLE.collect()[0].samples[0].value
        filler.unlink()  # space again: the next write succeeds and continues the chain on disk
        for n in range(5, 8):
            await log.record(_event(n))
            acknowledged.append(f"req-{n}")
        return acknowledged, unwritable_when_full, AUDIT_UNWRITABLE.collect()[0].samples[0].value

    failures_before = AUDIT_WRITE_FAILURES._value.get()
    acknowledged, unwritable_when_full, unwritable_after = asyncio.run(scenario())
    log.close()
    assert unwritable_when_full > 0 and unwritable_after == 0
    assert AUDIT_WRITE_FAILURES._value.get() > failures_before
    records = [json.loads(line) for line in _lines(segment_paths(small_disk / "audit", DECISIONS)[0])]
    assert [r["request_id"] for r in records] == acknowledged  # all of them, and no refused one
    assert _problems(small_disk / "audit") == ""


def test_a_removed_audit_directory_refuses_with_unavailable_and_the_break_is_reported(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "audit"
    log = AuditLog(AuditConfig(directory=directory))

    async def scenario() -> None:
        for n in range(3):
            await log.record(_event(n))
        shutil.rmtree(directory)  # the open segment now takes writes and fsyncs no one can read
        with pytest.raises(Unavailable, match="audit log cannot be written"):
            await log.record(_event(100))
        with pytest.raises(Unavailable):  # and stays refused while the directory is gone
            await log.record(_event(101))
        directory.mkdir()  # restored: the chain goes on in a new segment
        await log.record(_event(3))

    failures_before = AUDIT_WRITE_FAILURES._value.get()
    asyncio.run(scenario())
    log.close()
    assert AUDIT_WRITE_FAILURES._value.get() >= failures_before + 2
    records = [json.loads(line) for path in segment_paths(directory, DECISIONS) for line in _lines(path)]
    assert [r["request_id"] for r in records] == ["req-3"]  # no refused event was kept
    assert "req-100" not in str(records)
    assert (
        "decisions-00000001.jsonl:1: the decisions chain starts from an unknown hash; "
        "events #1 to #3 are missing before event #4"
    ) in _problems(directory)


def _signed_log(directory: Path, key_file: Path, num_events: int) -> None:
    """num_events in batches of ten, a signed checkpoint after every batch."""
    key_file.write_text("k" * 64)
    config = AuditConfig(directory=directory, key_file=key_file, checkpoint_interval_s=0)
    log = AuditLog(config)

    async def write_all() -> None:
        for start in range(0, num_events, 10):
            await asyncio.gather(*(log.record(_event(n)) for n in range(start, start + 10)))

    asyncio.run(write_all())
    log.close()


def _rewrite_from(path: Path, line_number: int) -> None:
    """What an attacker with write access but no key can do: edit one event, then recompute every
    later hash and the head file, so that the chain alone verifies."""
    records = [json.loads(line) for line in _lines(path)]
    records[line_number - 1]["decision"] = (
        "allow" if records[line_number - 1]["decision"] == "deny" else "deny"
    )
    prev = records[line_number - 1]["prev_hash"]
    for record in records[line_number - 1 :]:
        event = {k: v for k, v in record.items() if k not in ("prev_hash", "hash")}
        record["prev_hash"], record["hash"] = prev, chain_hash(event, prev)
        prev = record["hash"]
    path.write_bytes(b"".join(canonical_json(r) + b"\n" for r in records))
    head = path.parent / f"{DECISIONS}.head"
    head.write_text(json.dumps({**json.loads(head.read_text()), "count": len(records), "hash": prev}))


def test_a_rewritten_chain_is_caught_by_the_signed_checkpoints(tmp_path: Path) -> None:
    key_file = tmp_path / "keys" / "audit.key"
    key_file.parent.mkdir()
    _signed_log(tmp_path / "audit", key_file, 30)
    path = segment_paths(tmp_path / "audit", DECISIONS)[0]
    _rewrite_from(path, 15)
    assert verify_directory(tmp_path / "audit", STREAMS).is_ok  # the chain alone cannot tell
    report = verify_directory(tmp_path / "audit", STREAMS, Signer(load_key(key_file)))
    event_id = json.loads(_lines(path)[10])["event_id"]
    assert report.problems == [
        "decisions: the chain was rewritten: the signed checkpoint at event #20 does not match it; "
        f"the log can no longer be trusted from event #11 ({path.name}:11, event id {event_id}) on "
        "(signed checkpoints match up to #10)",
        "decisions.head: signature does not verify with this key (forged, edited, or another key)",
    ]


def test_verify_with_the_key_passes_an_untouched_log_and_refuses_forged_checkpoints(tmp_path: Path) -> None:
    key_file = tmp_path / "audit.key"
    _signed_log(tmp_path / "audit", key_file, 20)
    signer = Signer(load_key(key_file))
    assert verify_directory(tmp_path / "audit", STREAMS, signer).problems == []
    checkpoints = tmp_path / "audit" / f"{DECISIONS}.checkpoints"
    forged = {**json.loads(checkpoints.read_text().splitlines()[0]), "hash": "0" * 64}
    checkpoints.write_text(json.dumps(forged) + "\n")
    problems = verify_directory(tmp_path / "audit", STREAMS, signer).problems
    assert problems == [
        f"{checkpoints.name}:1: signature does not verify with this key (forged, edited, or another key)"
    ]
    command = [sys.executable, "-m", "services.cli.main", "audit", "verify", str(tmp_path / "audit")]
    done = subprocess.run([*command, "--key-file", str(key_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "signature does not verify" in done.stderr


def test_the_signing_key_may_not_live_in_the_audit_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="inside the audit directory"):
        AuditConfig(directory=tmp_path, key_file=tmp_path / "audit.key")


def test_an_event_submitted_first_is_on_disk_before_one_recorded_after_it(tmp_path: Path) -> None:
    # The gateway submits a call's allow event and answers beside its write; a safety block the
    # answer records next must come after it in the log.
    log = AuditLog(AuditConfig(directory=tmp_path))

    async def allow_then_block() -> None:
        allowed = log.submit(_event(1))
        await log.record(_event(2))
        assert allowed.done()
        await allowed

    asyncio.run(allow_then_block())
    log.close()
    records = [json.loads(line) for line in _lines(segment_paths(tmp_path, DECISIONS)[0])]
    assert [r["request_id"] for r in records] == ["req-1", "req-2"]
