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


def trust_problems(directory: Path, stream: str, entries: list[ChainEntry], signer: Signer) -> list[str]:
    """Checks the stream's signed checkpoints and head against the chain as it is on disk.

    The first problem, if any, names the first event that can no longer be trusted; records
    whose signature fails follow it (they are forged or edited, and vouch for nothing).
    """
    signed, forged = _signed_records(directory, stream, signer)
    if entries and not signed:
        return [
            f"{stream}: no validly signed checkpoint or head; nothing in this stream can be trusted",
            *forged,
        ]
    by_seq = {entry.seq: entry for entry in entries}
    trusted_seq = 0
    for record in signed:
        seq = int(record["count"])
        entry = by_seq.get(seq)
        if entry is None and entries and seq < entries[0].seq:
            continue  # pruned by retention
        if entry is None or entry.hash != record["hash"]:
            return [_untrusted(stream, entries, trusted_seq, seq), *forged]
        trusted_seq = max(trusted_seq, seq)
    return forged


def _signed_records(directory: Path, stream: str, signer: Signer) -> tuple[list[dict[str, Any]], list[str]]:
    """The checkpoints and head whose signature verifies, in order; and what is wrong with the rest."""
    path = checkpoints_path(directory, stream)
    lines = path.read_text().splitlines() if path.exists() else []
    sources = [(f"{path.name}:{n}", line) for n, line in enumerate(lines, start=1)]
    head = directory / f"{stream}.head"
    if head.exists():
        sources.append((head.name, head.read_text()))
    records, forged = [], []
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
        records.append(record)
    return sorted(records, key=lambda r: int(r["count"])), forged


def _untrusted(stream: str, entries: list[ChainEntry], trusted_seq: int, broken_seq: int) -> str:
    first = next((entry for entry in entries if entry.seq > trusted_seq), None)
    start = f"event #{trusted_seq + 1}" + (f" ({first.where}, event id {first.event_id})" if first else "")
    return (
        f"{stream}: the chain was rewritten: the signed checkpoint at event #{broken_seq} does not match it; "
        f"the log can no longer be trusted from {start} on (signed checkpoints match up to #{trusted_seq})"
    )
