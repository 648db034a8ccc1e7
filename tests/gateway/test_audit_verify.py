"""`thermocline audit verify` against the attacks a hash chain alone lets through, on real files.

Each attack test does what someone with write access to the audit directory (but not the signing
key) can do, and checks that the real CLI fails and names the stream, the event or segment, and
what is missing. The retention tests check the other side: real pruning still verifies.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from services.gateway.audit import ADMIN, DECISIONS, STREAMS, AuditConfig, AuditEvent, AuditLog
from services.gateway.audit_chain import canonical_json, chain_hash, segment_paths
from services.gateway.audit_checkpoint import Signer, load_key, trust_problems
from services.gateway.audit_verify import verify_directory, walk_stream

KEY = "k" * 64


def _event(n: int, action: str = "invoke") -> AuditEvent:
    return AuditEvent(
        actor_principal=f"user-{n}",
        tenant="acme",
        action=action,
        resource="model:stories260K",
        decision="allow",
        request_id=f"req-{n}",
    )


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys" / "audit.key"
    path.parent.mkdir(exist_ok=True)
    path.write_text(KEY)
    return path


def _open(directory: Path, key_file: Path | None, rotate_bytes: int = 64 * 1024 * 1024) -> AuditLog:
    return AuditLog(
        AuditConfig(
            directory=directory, key_file=key_file, checkpoint_interval_s=0, rotate_bytes=rotate_bytes
        )
    )


def _run(log: AuditLog, first: int, num_events: int, action: str = "invoke") -> None:
    """num_events in batches of ten (a signed checkpoint after each), as a gateway records them."""

    async def write_all() -> None:
        for start in range(first, first + num_events, 10):
            batch = range(start, min(first + num_events, start + 10))
            await asyncio.gather(*(log.record(_event(n, action)) for n in batch))

    asyncio.run(write_all())


def _gateway_run(directory: Path, key_file: Path | None, first: int, num_events: int, **kwargs: int) -> None:
    """One gateway process: starts, records its policies and num_events decisions, stops."""
    log = _open(directory, key_file, **kwargs)
    _run(log, first, 1, action="policy.load")
    _run(log, first, num_events)
    log.close()


def _verify(directory: Path, key_file: Path | None) -> subprocess.CompletedProcess[str]:
    """The real CLI, with no key setting or local mesh key of the environment's."""
    command = [sys.executable, "-m", "services.cli.main", "--state-dir", str(directory.parent / "no-state")]
    command += ["audit", "verify", str(directory)]
    if key_file is not None:
        command += ["--key-file", str(key_file)]
    env = {k: v for k, v in os.environ.items() if k != "THERMOCLINE_GATEWAY_AUDIT_KEY_FILE"}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# Finding: the oldest events deleted, and a prune record planted to explain the gap.


def test_deleting_the_oldest_events_behind_a_planted_prune_record_fails_with_the_key(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _gateway_run(directory, key_file, 0, 40)
    segment = segment_paths(directory, DECISIONS)[0]
    lines = segment.read_text().splitlines(keepends=True)
    first_kept = json.loads(lines[15])
    segment.write_text("".join(lines[15:]))  # events #1 to #15 gone, from inside a live segment
    planted = {"action": "audit.prune", "details": {"last_hash": json.loads(lines[14])["hash"]}}
    (directory / "zz-notes.jsonl").write_text(json.dumps(planted) + "\n")  # unchained, unsigned
    done = _verify(directory, key_file)
    assert done.returncode == 1, done.stdout
    assert (
        f"TAMPERED: {segment.name}:1: the decisions chain starts from an unknown hash; events #1 to #15 "
        f"are missing before event #16 (event id {first_kept['event_id']})"
    ) in done.stderr


def test_a_prune_record_appended_to_the_admin_chain_without_the_key_does_not_count(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _gateway_run(directory, key_file, 0, 40)
    segment = segment_paths(directory, DECISIONS)[0]
    lines = segment.read_text().splitlines(keepends=True)
    segment.write_text("".join(lines[15:]))
    # chained properly onto the admin stream, head rewritten: only the key's signatures can tell
    admin = segment_paths(directory, ADMIN)[0]
    tip = _records(admin)[-1]
    details = {"segment": "decisions-00000000.jsonl", "last_hash": json.loads(lines[14])["hash"]}
    note = {"action": "audit.prune", "seq": tip["seq"] + 1, "details": details}
    line = {**note, "prev_hash": tip["hash"], "hash": chain_hash(note, str(tip["hash"]))}
    with admin.open("ab") as file:
        file.write(canonical_json(line) + b"\n")
    (directory / "admin.head").write_text(json.dumps({"count": note["seq"], "hash": line["hash"]}))
    done = _verify(directory, key_file)
    assert done.returncode == 1
    assert f"TAMPERED: {segment.name}:1: the decisions chain starts from an unknown hash" in done.stderr
    assert "admin.head: signature does not verify" in done.stderr


# Finding: a whole stream deleted.


def test_deleting_a_whole_stream_fails_with_and_without_the_key(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _gateway_run(directory, key_file, 0, 20)
    _gateway_run(directory, key_file, 20, 20)  # a restart: the admin chain records the stream's 20 events
    for path in directory.glob("decisions*"):  # segments, head and checkpoints
        path.unlink()
    for key in (key_file, None):
        done = _verify(directory, key)
        assert done.returncode == 1, done.stdout
        gone = "decisions: the whole stream is gone (no decisions-*.jsonl segment, no decisions.head)"
        assert f"TAMPERED: {gone}" in done.stderr
        assert "records it with 20 events" in done.stderr


def test_deleting_the_admin_stream_fails(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _gateway_run(directory, key_file, 0, 20)
    for path in directory.glob("admin*"):
        path.unlink()
    done = _verify(directory, key_file)
    assert done.returncode == 1
    assert "TAMPERED: admin: the whole stream is gone (no admin-*.jsonl segment, no admin.head)" in (
        done.stderr
    )


# Finding: who may read the log.


def test_the_audit_directory_and_its_files_are_the_gateways_alone(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "state" / "audit", _key_file(tmp_path)
    old_umask = os.umask(0o022)
    try:
        _gateway_run(directory, key_file, 0, 10)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    assert stat.S_IMODE(directory.parent.stat().st_mode) == 0o755  # only the audit directory itself


# Retention: real pruning of whole closed segments still verifies.


def _age(paths: list[Path], days: float) -> None:
    old = time.time() - days * 86400
    for path in paths:
        os.utime(path, (old, old))


def test_retention_across_gateway_restarts_verifies_with_the_key(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _gateway_run(directory, key_file, 0, 100, rotate_bytes=4096)
    _gateway_run(directory, key_file, 100, 100, rotate_bytes=4096)
    segments = segment_paths(directory, DECISIONS)
    num_pruned = sum(len(path.read_text().splitlines()) for path in segments[:3])
    _age(segments[:3], 91)
    log = _open(directory, key_file, rotate_bytes=4096)  # a third start prunes, then records
    pruned = log.prune()
    _run(log, 200, 30)
    log.close()
    assert [e.details["segment"] for e in pruned] == [p.name for p in segments[:3]]
    assert segment_paths(directory, DECISIONS)[: len(segments) - 3] == segments[3:]
    _gateway_run(directory, key_file, 230, 10, rotate_bytes=4096)  # and a fourth start after it
    done = _verify(directory, key_file)
    assert done.returncode == 0, done.stderr
    assert f"decisions: {240 - num_pruned} events" in done.stdout  # the pruned ones are gone


def test_pruned_admin_segments_verify_with_the_key(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    log = _open(directory, key_file, rotate_bytes=4096)
    _run(log, 0, 60, action="admin")
    _run(log, 60, 20)
    log.close()
    admin_segments = segment_paths(directory, ADMIN)
    assert len(admin_segments) >= 3
    _age(admin_segments[:2], 366)
    log = _open(directory, key_file, rotate_bytes=4096)
    assert len(log.prune()) == 2
    log.close()
    assert segment_paths(directory, ADMIN)[: len(admin_segments) - 2] == admin_segments[2:]
    done = _verify(directory, key_file)
    assert done.returncode == 0, done.stderr


def test_a_log_written_before_streams_were_recorded_still_verifies(tmp_path: Path) -> None:
    """A log as gateways wrote it before `audit.start` records: both streams, no start records."""
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _old_gateway_log(directory, Signer(load_key(key_file)), {ADMIN: 1, DECISIONS: 12})
    done = _verify(directory, key_file)
    assert done.returncode == 0, done.stderr
    assert "decisions: 12 events, admin: 1 events" in done.stdout


def _old_gateway_log(directory: Path, signer: Signer, num_events: dict[str, int]) -> None:
    """Segments, head and checkpoints as an older gateway left them: no stream without events."""
    directory.mkdir(parents=True)
    for stream, count in num_events.items():
        prev, lines = "0" * 64, []
        for seq in range(1, count + 1):
            event = {**_event(seq).to_record(), "seq": seq}
            digest = chain_hash(event, prev)
            lines.append(canonical_json({**event, "prev_hash": prev, "hash": digest}) + b"\n")
            prev = digest
        (directory / f"{stream}-00000001.jsonl").write_bytes(b"".join(lines))
        head = signer.sign({"count": count, "hash": prev})
        (directory / f"{stream}.head").write_text(json.dumps(head))
        (directory / f"{stream}.checkpoints").write_bytes(canonical_json(head) + b"\n")


def test_an_old_log_without_a_stream_fails_saying_it_predates_the_check(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _old_gateway_log(directory, Signer(load_key(key_file)), {ADMIN: 1})  # a gateway that decided nothing
    done = _verify(directory, key_file)
    assert done.returncode == 1
    assert "TAMPERED: decisions: the whole stream is gone" in done.stderr
    assert "no audit.start event" in done.stderr


def test_an_empty_directory_does_not_verify(tmp_path: Path) -> None:
    (tmp_path / "audit").mkdir()
    done = _verify(tmp_path / "audit", None)
    assert done.returncode == 1
    assert "no audit stream" in done.stderr


def test_the_chain_alone_catches_a_deleted_start_without_the_key(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    _gateway_run(directory, None, 0, 30)
    segment = segment_paths(directory, DECISIONS)[0]
    segment.write_text("".join(segment.read_text().splitlines(keepends=True)[5:]))
    report = verify_directory(directory, STREAMS)
    assert any("events #1 to #5 are missing" in problem for problem in report.problems), report.problems


def test_an_old_log_continued_by_a_new_gateway_is_then_guarded(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _old_gateway_log(directory, Signer(load_key(key_file)), {ADMIN: 1, DECISIONS: 12})
    _gateway_run(directory, key_file, 12, 10)  # the upgrade's first start records both streams
    assert _verify(directory, key_file).returncode == 0
    for path in directory.glob("decisions*"):
        path.unlink()
    done = _verify(directory, key_file)
    assert (
        done.returncode == 1 and "records it with 12 events; every decisions event was deleted" in done.stderr
    )


def test_a_stream_cut_back_below_a_recorded_start_fails_without_the_key(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    _gateway_run(directory, None, 0, 30)
    _gateway_run(directory, None, 30, 10)  # its audit.start records decisions at event #30
    segment = segment_paths(directory, DECISIONS)[0]
    records = _records(segment)[:20]  # the tail cut, and a head written to match
    segment.write_bytes(b"".join(canonical_json(r) + b"\n" for r in records))
    (directory / "decisions.head").write_text(json.dumps({"count": 20, "hash": records[-1]["hash"]}))
    report = verify_directory(directory, STREAMS)
    assert len(report.problems) == 1
    assert (
        "records the chain at event #30 when a gateway started, but the chain on disk ends at event #20"
        in (report.problems[0])
    )


def test_retention_keeps_the_admin_segment_a_quiet_streams_start_depends_on(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    log = _open(directory, key_file, rotate_bytes=4096)
    _run(log, 0, 100)
    decisions = segment_paths(directory, DECISIONS)
    _age(decisions[:2], 91)
    assert len(log.prune()) == 2  # their prune records go to the first admin segment
    _run(log, 100, 60, action="admin")  # then the admin stream rotates on; decisions stays quiet
    log.close()
    admin = segment_paths(directory, ADMIN)
    assert len(admin) >= 3
    _age(admin[:-1], 366)
    log = _open(directory, key_file, rotate_bytes=4096)
    assert log.prune() == []  # the first one holds the record decisions-00000003 chains from
    log.close()
    assert segment_paths(directory, ADMIN)[: len(admin)] == admin
    done = _verify(directory, key_file)
    assert done.returncode == 0, done.stderr


def test_retention_prunes_only_the_oldest_segments(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    log = _open(directory, None, rotate_bytes=4096)
    _run(log, 0, 100)
    segments = segment_paths(directory, DECISIONS)
    _age([segments[0], segments[2]], 91)  # the second is younger: the third must wait for it
    assert [e.details["segment"] for e in log.prune()] == [segments[0].name]
    log.close()
    assert verify_directory(directory, STREAMS).problems == []


def test_a_prune_recorded_but_not_yet_done_verifies(tmp_path: Path) -> None:
    """A crash between the prune record's fsync and the deletion: the segment is still there."""
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    log = _open(directory, key_file, rotate_bytes=4096)
    _run(log, 0, 100)
    segments = segment_paths(directory, DECISIONS)
    _age(segments[:1], 91)
    kept = segments[0].read_bytes()
    log.prune()
    segments[0].write_bytes(kept)
    os.chmod(segments[0], 0o600)
    _age(segments[:1], 91)
    assert _verify(directory, key_file).returncode == 0
    assert len(log.prune()) == 1  # the next round deletes it again, and records it again
    log.close()
    done = _verify(directory, key_file)
    assert done.returncode == 0, done.stderr


def test_a_signed_checkpoint_older_than_the_log_needs_a_prune_to_cover_it(tmp_path: Path) -> None:
    directory, key_file = tmp_path / "audit", _key_file(tmp_path)
    _gateway_run(directory, key_file, 0, 40)
    walk = walk_stream(directory, DECISIONS)
    later = walk.entries[15:]  # as if events #1 to #15 were gone and the start accepted
    signer = Signer(load_key(key_file))
    problems = trust_problems(directory, DECISIONS, later, signer, pruned_through=0)
    assert problems == [
        "decisions: the signed checkpoint at event #10 (decisions.checkpoints:1) is older than the oldest "
        f"event on disk, #16 ({later[0].where}, event id {later[0].event_id}), and no audit.prune event of "
        "the admin chain covers it: events #1 to #15 were deleted, not pruned by retention"
    ]
    assert trust_problems(directory, DECISIONS, later, signer, pruned_through=15) == []


def test_an_audit_directory_others_could_read_is_made_the_gateways_alone(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)  # as an older gateway left it, or a volume's mount point
    _open(directory, None).close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
