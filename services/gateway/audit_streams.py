"""The audit log's streams, and the admin events in which the log records its own starts and prunes.

The admin chain is the log's memory of itself. Each gateway start writes an `audit.start` event
naming every stream with its tip (event count and last hash) at that moment, so a stream deleted
whole, or cut back below a recorded tip, contradicts a chained event. Retention writes an
`audit.prune` event for each whole segment it deletes, naming that segment's last hash, so a
chain may start from that hash. The writer (audit.py) and the verifier (audit_verify.py) read and
write these records only through this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DECISIONS, ADMIN = "decisions", "admin"
STREAMS = (DECISIONS, ADMIN)
PRUNE_ACTION, START_ACTION = "audit.prune", "audit.start"


def stream_of_segment(segment_name: str) -> str:
    """`decisions` for `decisions-00000003.jsonl`."""
    return segment_name.rsplit("-", 1)[0]


def segment_number(segment_name: str) -> int:
    """3 for `decisions-00000003.jsonl`."""
    return int(segment_name.removesuffix(".jsonl").rsplit("-", 1)[1])


def prune_details(segment_name: str, last_hash: str, last_seq: int) -> dict[str, Any]:
    """The details of the `audit.prune` event that records a deleted segment."""
    return {"segment": segment_name, "last_hash": last_hash, "last_seq": last_seq}


def start_details(tips: Mapping[str, tuple[int, str]]) -> dict[str, Any]:
    """The details of an `audit.start` event: each stream's (count, hash) when the gateway opened it."""
    return {stream: {"count": count, "hash": last_hash} for stream, (count, last_hash) in tips.items()}


@dataclass(frozen=True)
class AdminNote:
    """Where an admin event about the log itself is, for the verifier's report."""

    seq: int  # its seq in the admin chain: it counts only where the key's checkpoints cover it
    where: str
    event_id: str


@dataclass(frozen=True)
class PruneNote:
    """One segment that retention deleted, as an `audit.prune` event records it."""

    stream: str
    segment: str
    last_hash: str
    note: AdminNote

    @classmethod
    def from_record(cls, record: Mapping[str, Any], note: AdminNote) -> PruneNote | None:
        """The note in an `audit.prune` record (older ones lack `last_seq`); None for other records."""
        details = record.get("details")
        if record.get("action") != PRUNE_ACTION or not isinstance(details, Mapping):
            return None
        segment, last_hash = details.get("segment"), details.get("last_hash")
        if not isinstance(segment, str) or not isinstance(last_hash, str) or "-" not in segment:
            return None
        return cls(stream_of_segment(segment), segment, last_hash, note)


@dataclass(frozen=True)
class StreamTip:
    """A stream's event count and last hash when a gateway started, as an `audit.start` event records it."""

    stream: str
    count: int
    hash: str
    note: AdminNote

    @classmethod
    def from_record(cls, record: Mapping[str, Any], note: AdminNote) -> list[StreamTip]:
        """The tips an `audit.start` record names; [] for other records."""
        details = record.get("details")
        if record.get("action") != START_ACTION or not isinstance(details, Mapping):
            return []
        return [
            cls(stream, int(tip["count"]), str(tip["hash"]), note)
            for stream, tip in details.items()
            if isinstance(tip, Mapping) and isinstance(tip.get("count"), int) and "hash" in tip
        ]
