"""Verifies an audit directory: each stream's chain, where it may start, which streams must exist,
and, with the signing key, its signed checkpoints (`thermocline audit verify`).

The chain shows an edited, deleted or reordered line between two that survive. What it cannot
show alone, this module checks from the admin chain, the log's record of itself (audit_streams.py):
- Where a chain starts. From the genesis hash, or from the last hash of a segment that retention
  deleted. Retention deletes only whole closed segments, and records each in an `audit.prune` event
  of the admin chain; only those events count, and with the key only those its signed checkpoints
  cover. A prune record anywhere else (a stray file, an unsigned tail of the admin chain) is what
  someone who cut the oldest events would leave. The segment it names must be gone, and the chain
  must resume in a later one.
- Whether a stream is there at all. Every stream the gateway writes must be: each gateway creates
  them when it opens the log, and names them in its `audit.start` event.
- Whether a chain still holds the tips that `audit.start` events recorded (or retention pruned
  them): a chain cut back, or rewritten, below a gateway start contradicts a chained event, even
  without the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.audit_chain import GENESIS_HASH, chain_hash, segment_paths
from services.gateway.audit_checkpoint import ChainEntry, Signer, trust_problems, trusted_through
from services.gateway.audit_streams import ADMIN, AdminNote, PruneNote, StreamTip, segment_number

_CHAIN_FIELDS = ("prev_hash", "hash")


@dataclass
class VerifyReport:
    """The outcome of verifying one directory."""

    num_events: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def is_ok(self) -> bool:
        """True when every stream verified."""
        return not self.problems


@dataclass
class ChainWalk:
    """One stream's chain as it is on disk, up to its first break."""

    stream: str
    entries: list[ChainEntry] = field(default_factory=list)
    start_prev_hash: str = GENESIS_HASH  # the oldest line's prev_hash
    start_segment: str = ""
    problem: str | None = None
    prunes: list[PruneNote] = field(default_factory=list)  # admin only
    tips: list[StreamTip] = field(default_factory=list)  # admin only

    @property
    def last_seq(self) -> int:
        """The seq of the last event that chains (0: none)."""
        return self.entries[-1].seq if self.entries else 0


@dataclass(frozen=True)
class AdminNotes:
    """The admin chain's prune and start records that count: chained, and signed when a key is given."""

    prunes: list[PruneNote]
    tips: list[StreamTip]
    has_start: bool  # any audit.start at all: a log written before gateways recorded their streams has none


def verify_directory(directory: Path, streams: Iterable[str], signer: Signer | None = None) -> VerifyReport:
    """Verifies every stream of an audit directory; with the signing key, its signed checkpoints too."""
    walks = {stream: walk_stream(directory, stream) for stream in streams}
    report = VerifyReport(num_events={stream: len(walk.entries) for stream, walk in walks.items()})
    if all(_is_gone(directory, stream) for stream in walks):
        report.problems.append(
            f"no audit stream in {directory} (no segment or head of {', '.join(walks)}): "
            "no gateway has written here, or the whole log was deleted"
        )
        return report
    notes = admin_notes(directory, walks.get(ADMIN, ChainWalk(ADMIN)), signer)
    for walk in walks.values():
        report.problems.extend(_stream_problems(directory, walk, notes, signer))
    return report


def walk_stream(directory: Path, stream: str) -> ChainWalk:
    """Reads one stream's chain line by line until it breaks; collects the admin chain's notes."""
    walk, expected = ChainWalk(stream), None
    for path, number, line in _lines(segment_paths(directory, stream)):
        where = f"{path.name}:{number}"
        try:
            record = json.loads(line)
            event = {k: v for k, v in record.items() if k not in _CHAIN_FIELDS}
            prev, stored = record["prev_hash"], record["hash"]
        except (ValueError, KeyError, AttributeError, TypeError):
            walk.problem = f"{where}: not a chained JSON record"
            return walk
        if expected is None:
            walk.start_prev_hash, walk.start_segment = prev, path.name
        elif prev != expected:
            walk.problem = f"{where}: prev_hash does not match the entry before; deleted or reordered"
            return walk
        if chain_hash(event, prev) != stored:
            walk.problem = f"{where}: hash does not match the content; the entry was edited"
            return walk
        expected = stored
        entry = ChainEntry(int(record.get("seq", 0)), stored, where, str(record.get("event_id", "")))
        walk.entries.append(entry)
        if stream == ADMIN:
            _collect_note(walk, record, AdminNote(entry.seq, where, entry.event_id))
    return walk


def _lines(paths: list[Path]) -> Iterator[tuple[Path, int, bytes]]:
    for path in paths:
        for number, line in enumerate(path.read_bytes().splitlines(), start=1):
            yield path, number, line


def _collect_note(walk: ChainWalk, record: dict[str, object], note: AdminNote) -> None:
    prune = PruneNote.from_record(record, note)
    if prune is not None:
        walk.prunes.append(prune)
    walk.tips.extend(StreamTip.from_record(record, note))


def admin_notes(directory: Path, admin: ChainWalk, signer: Signer | None) -> AdminNotes:
    """The admin chain's notes up to its first break, and with a key up to what its signatures cover."""
    through_seq = trusted_through(directory, ADMIN, admin.entries, signer) if signer else None
    prunes = [p for p in admin.prunes if through_seq is None or p.note.seq <= through_seq]
    tips = [t for t in admin.tips if through_seq is None or t.note.seq <= through_seq]
    return AdminNotes(prunes, tips, has_start=bool(admin.tips))


def _stream_problems(directory: Path, walk: ChainWalk, notes: AdminNotes, signer: Signer | None) -> list[str]:
    """The first problem of each check, in the order a reader needs them."""
    if _is_gone(directory, walk.stream):
        return [_gone(walk.stream, notes)]
    if walk.problem:
        return [walk.problem]
    pruned_through, start_problem = _check_start(directory, walk, notes.prunes)
    if start_problem:
        return [start_problem]
    problems = _check_head(directory, walk)
    if signer is not None and not problems:
        problems = trust_problems(directory, walk.stream, walk.entries, signer, pruned_through)
    if not problems:
        problems = _tip_problems(walk, notes.tips, pruned_through)
    return problems


def _is_gone(directory: Path, stream: str) -> bool:
    return not segment_paths(directory, stream) and not (directory / f"{stream}.head").exists()


def _gone(stream: str, notes: AdminNotes) -> str:
    what = f"{stream}: the whole stream is gone (no {stream}-*.jsonl segment, no {stream}.head)"
    named = [tip for tip in notes.tips if tip.stream == stream]
    if named:
        tip = max(named, key=lambda t: t.count)
        return (
            f"{what}, though the admin chain's audit.start at {tip.note.where} (event id "
            f"{tip.note.event_id}) records it with {tip.count} events; every {stream} event was deleted"
        )
    if stream == ADMIN:
        return f"{what}; every gateway writes to it when it starts, so it was deleted, prune records and all"
    if not notes.has_start:
        return (
            f"{what}; this log has no audit.start event (it was written before gateways recorded "
            f"their streams at start), so it cannot show whether {stream} was deleted or never "
            f"written: such a gateway made no {stream} file until its first {stream} event"
        )
    return f"{what}; every gateway creates it when it opens the log, so it was deleted"


def _check_start(directory: Path, walk: ChainWalk, prunes: list[PruneNote]) -> tuple[int, str | None]:
    """(the seq through which retention pruned this stream, the problem with where it starts)."""
    if not walk.entries or walk.start_prev_hash == GENESIS_HASH:
        return 0, None
    notes = [p for p in prunes if p.stream == walk.stream and p.last_hash == walk.start_prev_hash]
    if not notes:
        return 0, _unknown_start(walk)
    mismatches = [_not_whole_segment(directory, walk, note) for note in notes]
    if None in mismatches:
        return max(walk.entries[0].seq - 1, 0), None
    return 0, mismatches[-1]


def _not_whole_segment(directory: Path, walk: ChainWalk, note: PruneNote) -> str | None:
    """Why this prune record does not explain where the chain starts; None when it does."""
    if segment_number(note.segment) >= segment_number(walk.start_segment):
        why = f"the chain resumes in {walk.start_segment}, not in a later segment"
    elif (directory / note.segment).exists():
        why = f"{note.segment} is still here"
    else:
        return None
    first = walk.entries[0]
    return (
        f"{first.where}: the {walk.stream} chain resumes after {note.segment}, which the audit.prune at "
        f"{note.note.where} records as deleted by retention, but {why}: events were removed from "
        f"inside a segment, before event #{first.seq} (event id {first.event_id})"
    )


def _unknown_start(walk: ChainWalk) -> str:
    first = walk.entries[0]
    if first.seq > 2:
        missing = f"events #1 to #{first.seq - 1} are missing before event #{first.seq}"
    elif first.seq == 2:
        missing = "event #1 is missing before event #2"
    else:
        missing = "entries before it are missing"
    return (
        f"{first.where}: the {walk.stream} chain starts from an unknown hash; {missing} "
        f"(event id {first.event_id}): no audit.prune event of the admin chain names that hash as the "
        "last of a segment that retention deleted, so the log is incomplete before it"
    )


def _check_head(directory: Path, walk: ChainWalk) -> list[str]:
    """The head file's hash must be in the chain (it may lag the log by one crash, never lead it)."""
    head_path = directory / f"{walk.stream}.head"
    if not head_path.exists():
        return [] if not walk.entries else [f"{head_path.name} is missing"]
    seen = {entry.hash for entry in walk.entries}
    if walk.start_prev_hash == GENESIS_HASH:
        seen.add(GENESIS_HASH)  # the head of a stream opened before its first event was written
    if json.loads(head_path.read_text()).get("hash") in seen:
        return []
    if not walk.entries:
        return [f"{walk.stream}: every segment is gone, though {head_path.name} names an event of it"]
    cut = f"{walk.stream}: the last entry that {head_path.name} names is gone; entries were cut from the end"
    return [cut]


def _tip_problems(walk: ChainWalk, tips: list[StreamTip], pruned_through: int) -> list[str]:
    """The first tip an `audit.start` recorded that the chain no longer holds, if any."""
    by_seq = {entry.seq: entry for entry in walk.entries}
    hashes = {entry.hash for entry in walk.entries}
    for tip in tips:
        if tip.stream != walk.stream or tip.count <= pruned_through:
            continue
        entry = by_seq.get(tip.count)
        if (entry is not None and entry.hash == tip.hash) or (entry is None and tip.hash in hashes):
            continue  # the second: events written before they had a seq
        return [_lost_tip(walk, tip)]
    return []


def _lost_tip(walk: ChainWalk, tip: StreamTip) -> str:
    recorded = (
        f"{walk.stream}: the admin chain's audit.start at {tip.note.where} (event id {tip.note.event_id}) "
        f"records the chain at event #{tip.count} when a gateway started"
    )
    if tip.count > walk.last_seq:
        return (
            f"{recorded}, but the chain on disk ends at event #{walk.last_seq}: events from "
            f"#{walk.last_seq + 1} on were cut"
        )
    return f"{recorded}, and the chain on disk holds another event there: it was rewritten up to #{tip.count}"
