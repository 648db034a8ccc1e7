"""Signed checkpoints of the audit chain: what a hash chain alone cannot show.

Anyone who can write the audit directory can edit an event and recompute every later hash and the
`.head` file; the chain then verifies. So the writer also signs its tip with a key kept outside
the audit directory (HMAC-SHA256): every batch re-signs `<stream>.head`, and at most every
`checkpoint_interval_s` a checkpoint `{seq, hash}` is appended to `<stream>.checkpoints`, much as
AWS CloudTrail signs a digest file each hour. Each event carries its `seq` (1, 2, ... per stream)
inside its hash. Without the key nobody can sign a rewritten chain, so `verify` with the key
finds the last signed checkpoint that still matches, and every event after it is untrusted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.secret_file import ensure_secret_file

MIN_KEY_BYTES = 32


def load_key(path: Path) -> bytes:
    """The signing key in `path` (at least 32 bytes, surrounding whitespace ignored)."""
    try:
        key = path.read_bytes().strip()
    except OSError as error:
        raise ValueError(f"cannot read the audit signing key {path}: {error.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"audit signing key {path} holds {len(key)} bytes; use at least {MIN_KEY_BYTES}")
    return key


def ensure_key(path: Path) -> Path:
    """A random signing key at `path` (made once, mode 0600)."""
    return ensure_secret_file(path)


def check_key_outside(key_file: Path, audit_directory: Path) -> None:
    """Refuses a key inside the directory it protects: whoever can rewrite the log could read it."""
    key, directory = key_file.resolve(), audit_directory.resolve()
    if key == directory or directory in key.parents:
        raise ValueError(
            f"the audit signing key {key_file} lies inside the audit directory {audit_directory}; "
            "keep it elsewhere (e.g. with the JWT keys), readable by the gateway alone"
        )


class Signer:
    """Signs and checks checkpoint records with one key."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.key_id = hashlib.sha256(b"thermocline-audit-key:" + key).hexdigest()[:16]

    def sign(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """`record` with this key's id and its MAC added."""
        body = {**record, "key_id": self.key_id}
        return {**body, "mac": self._mac(body)}

    def is_valid(self, record: Mapping[str, Any]) -> bool:
        """Whether `record` carries a MAC made with this key over its other fields."""
        body = {k: v for k, v in record.items() if k != "mac"}
        return isinstance(record.get("mac"), str) and hmac.compare_digest(record["mac"], self._mac(body))

    def _mac(self, body: Mapping[str, Any]) -> str:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, canonical, hashlib.sha256).hexdigest()


def checkpoints_path(directory: Path, stream: str) -> Path:
    """Where a stream's signed checkpoints are appended."""
    return directory / f"{stream}.checkpoints"


@dataclass(frozen=True)
class ChainEntry:
    """Where one event of the chain is, for the verifier's report."""

    seq: int
    hash: str
    where: str
    event_id: str


@dataclass(frozen=True)
class SignedTip:
    """One validly signed checkpoint or head: the chain had `seq` events, the last with `hash`."""

    seq: int
    hash: str
    where: str


def trusted_through(directory: Path, stream: str, entries: list[ChainEntry], signer: Signer) -> int:
    """The last seq up to which every signed checkpoint and head on disk matches the chain."""
    signed, _ = signed_tips(directory, stream, signer)
    return _match(stream, entries, _within(signed, entries))[0]


def trust_problems(
    directory: Path, stream: str, entries: list[ChainEntry], signer: Signer, pruned_through: int = 0
) -> list[str]:
    """Checks the stream's signed checkpoints and head against the chain as it is on disk.

    The first problem, if any, names the first event that can no longer be trusted; records
    whose signature fails follow it (they are forged or edited, and vouch for nothing). A signed
    checkpoint older than the oldest event on disk is a problem unless retention pruned through it:
    `pruned_through`, which the verifier takes only from a verified `audit.prune` event.
    """
    signed, forged = signed_tips(directory, stream, signer)
    if entries and not signed:
        return [
            f"{stream}: no validly signed checkpoint or head; nothing in this stream can be trusted",
            *forged,
        ]
    problem = _match(stream, entries, _within(signed, entries))[1]
    problems = [problem] if problem else []
    deleted = [tip for tip in signed if pruned_through < tip.seq < _first_seq(entries)]
    if deleted:
        problems.append(_deleted_before(stream, entries[0], deleted[0]))
    return [*problems, *forged]


def _first_seq(entries: list[ChainEntry]) -> int:
    return entries[0].seq if entries else 0


def _within(signed: list[SignedTip], entries: list[ChainEntry]) -> list[SignedTip]:
    """The signed tips the chain on disk should hold: none below its oldest event, nor the empty
    stream's head (seq 0, made when the gateway opened a stream with no event yet)."""
    return [tip for tip in signed if tip.seq > 0 and tip.seq >= _first_seq(entries)]


def _match(stream: str, entries: list[ChainEntry], signed: list[SignedTip]) -> tuple[int, str | None]:
    """(the last seq that every signed tip up to it vouches for, the first mismatch if any)."""
    by_seq = {entry.seq: entry for entry in entries}
    trusted_seq = 0
    for tip in signed:
        entry = by_seq.get(tip.seq)
        if entry is None or entry.hash != tip.hash:
            return trusted_seq, _untrusted(stream, entries, trusted_seq, tip.seq)
        trusted_seq = max(trusted_seq, tip.seq)
    return trusted_seq, None


def signed_tips(directory: Path, stream: str, signer: Signer) -> tuple[list[SignedTip], list[str]]:
    """The checkpoints and head whose signature verifies, by seq; and what is wrong with the rest."""
    path = checkpoints_path(directory, stream)
    lines = path.read_text().splitlines() if path.exists() else []
    sources = [(f"{path.name}:{n}", line) for n, line in enumerate(lines, start=1)]
    head = directory / f"{stream}.head"
    if head.exists():
        sources.append((head.name, head.read_text()))
    tips, forged = [], []
    for where, text in sources:
        try:
            record = json.loads(text)
        except ValueError:
            forged.append(f"{where}: not a JSON checkpoint")
            continue
        if not isinstance(record, dict) or not signer.is_valid(record):
            forged.append(
                f"{where}: signature does not verify with this key (forged, edited, or another key)"
            )
            continue
        tips.append(SignedTip(int(record["count"]), str(record["hash"]), where))
    return sorted(tips, key=lambda tip: tip.seq), forged


def _untrusted(stream: str, entries: list[ChainEntry], trusted_seq: int, broken_seq: int) -> str:
    first = next((entry for entry in entries if entry.seq > trusted_seq), None)
    start = f"event #{trusted_seq + 1}" + (f" ({first.where}, event id {first.event_id})" if first else "")
    return (
        f"{stream}: the chain was rewritten: the signed checkpoint at event #{broken_seq} does not match it; "
        f"the log can no longer be trusted from {start} on (signed checkpoints match up to #{trusted_seq})"
    )


def _deleted_before(stream: str, first: ChainEntry, tip: SignedTip) -> str:
    return (
        f"{stream}: the signed checkpoint at event #{tip.seq} ({tip.where}) is older than the oldest "
        f"event on disk, #{first.seq} ({first.where}, event id {first.event_id}), and no audit.prune "
        f"event of the admin chain covers it: events #1 to #{first.seq - 1} were deleted, not pruned "
        "by retention"
    )
