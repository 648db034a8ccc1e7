"""One hash-chained, append-only JSON-lines audit stream, split into segment files, and its verifier.

Each line is the event's fields plus `prev_hash` and `hash`, where
`hash = sha256(canonical_json(event) || prev_hash)` (the hex text of the previous hash, 64 zeros
for the first event ever). Editing a line breaks its hash, deleting or reordering lines breaks
the next line's `prev_hash`, and the `<stream>.head` file (count and hash of the last line
written) catches a truncated tail. Segments are `<stream>-<seq>.jsonl`; the chain runs across
them. When retention deletes old segments, an `audit.prune` event records each one's last hash,
so the verifier (audit_verify.py) can tell a pruned start from a cut one.

The directory is made 0700 and every file in it 0600: events name subjects and tenants, and
carry prompt hashes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from services.gateway.audit_checkpoint import Signer, checkpoints_path

log = logging.getLogger(__name__)

GENESIS_HASH = "0" * 64
_CHAIN_FIELDS = ("prev_hash", "hash")


def canonical_json(event: Mapping[str, Any]) -> bytes:
    """The bytes that are hashed: sorted keys, no spaces, UTF-8."""
    return json.dumps(event, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# Characters a JSON string may hold raw that text readers take as line breaks (NEL, the Unicode
# line and paragraph separators) or that reorder what a terminal shows (bidirectional overrides and
# isolates). Written as \u escapes, so one event stays one line for any log shipper and reads as
# what it holds; the hash is over the parsed event, so escaping does not change it.
_ESCAPED_IN_LINES = {
    ord(c): f"\\u{ord(c):04x}"
    for c in "\u0085\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
}


def line_json(record: Mapping[str, Any]) -> bytes:
    """One audit line: the canonical JSON, with line breaks and bidi controls escaped."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.translate(_ESCAPED_IN_LINES).encode()


def chain_hash(event: Mapping[str, Any], prev_hash: str) -> str:
    """h_n = sha256(e_n || h_{n-1})."""
    return hashlib.sha256(canonical_json(event) + prev_hash.encode("ascii")).hexdigest()


def _sequence(path: Path) -> int:
    return int(path.stem.rsplit("-", 1)[1])


def segment_paths(directory: Path, stream: str) -> list[Path]:
    """The stream's segment files (`<stream>-<digits>.jsonl`), oldest first."""
    name = re.compile(rf"{re.escape(stream)}-\d+\.jsonl")
    return sorted((p for p in directory.glob(f"{stream}-*.jsonl") if name.fullmatch(p.name)), key=_sequence)


def last_record(path: Path) -> dict[str, Any] | None:
    """The segment's last complete line, parsed; None when it has none."""
    complete = path.read_bytes().rpartition(b"\n")[0]
    last = complete.rsplit(b"\n", 1)[-1]
    return json.loads(last) if last else None


def last_line_hash(path: Path) -> tuple[str | None, bool]:
    """The hash of the segment's last complete line, and whether a torn tail follows it."""
    data = path.read_bytes()
    complete, _, torn = data.rpartition(b"\n")
    last = complete.rsplit(b"\n", 1)[-1] if complete else b""
    return (json.loads(last)["hash"] if last else None), bool(torn)


def private_opener(path: str, flags: int) -> int:
    """`open(..., opener=private_opener)` creates the file 0600: only the gateway reads the log."""
    return os.open(path, flags, 0o600)


class ChainWriter:
    """Appends events to one stream. Not thread-safe: one writer thread at a time."""

    def __init__(
        self,
        directory: Path,
        stream: str,
        rotate_bytes: int,
        signer: Signer | None = None,
        checkpoint_interval_s: float = 60.0,
    ) -> None:
        self.directory = directory
        self.stream = stream
        self.rotate_bytes = rotate_bytes
        self.signer = signer
        self.checkpoint_interval_s = checkpoint_interval_s
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # the mode applies to it, not its parents
        self.last_hash, self.count = self._recover()
        self._file: IO[bytes] | None = None
        self._last_checkpoint_at: float | None = None
        if self.count == 0 and not self.head_path.exists():
            self._write_head()  # a new stream is on disk from the start: deleting it whole then shows

    @property
    def head_path(self) -> Path:
        """Where the count and hash of the last written line are kept."""
        return self.directory / f"{self.stream}.head"

    def _recover(self) -> tuple[str, int]:
        """The chain's tip after a restart; drops a torn last line (never acknowledged)."""
        for path in reversed(segment_paths(self.directory, self.stream)):
            last_hash, is_torn = last_line_hash(path)
            if is_torn:
                self._truncate_torn_tail(path)
            if last_hash is not None:
                return last_hash, _last_seq(path) or self._head_count()
        return GENESIS_HASH, 0

    def _head_count(self) -> int:
        if not self.head_path.exists():
            return 0
        return int(json.loads(self.head_path.read_text()).get("count", 0))

    def _truncate_torn_tail(self, path: Path) -> None:
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1
        log.warning("audit segment %s ends in a torn line (%d bytes); dropping it", path, len(data) - keep)
        with path.open("r+b") as file:
            file.truncate(keep)
            os.fsync(file.fileno())

    def _open_segment(self) -> IO[bytes]:
        segments = segment_paths(self.directory, self.stream)
        current = segments[-1] if segments else None
        if current is None or current.stat().st_size >= self.rotate_bytes:
            number = _sequence(current) + 1 if current else 1
            current = self.directory / f"{self.stream}-{number:08d}.jsonl"
        # unbuffered: a failed write leaves nothing queued
        file = open(current, "ab", buffering=0, opener=private_opener)  # noqa: SIM115 (kept open)
        _fsync_directory(self.directory)
        return file

    def append(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Chains and writes `events`, then fsyncs; on return they are durable.

        When the write or the fsync fails (a full disk), the segment is cut back to where it was
        and the chain's tip is restored, so the next append continues a chain that is on disk.
        A segment removed while open (its directory deleted, say) takes writes and fsyncs that
        reach no file anyone can read: that counts as a failed write too. The next append opens a
        new segment once the directory exists again; the chain there starts from the lost tip, so
        `verify` reports the break instead of a clean start.
        """
        if self._file is None or self._file.tell() >= self.rotate_bytes:
            self.close()
            self._file = self._open_segment()
        tip, start = (self.last_hash, self.count), self._file.tell()
        try:
            self._write_all(self._chained_lines(events))
            os.fsync(self._file.fileno())
            self._check_still_linked()
        except OSError:
            self._roll_back(tip, start)
            raise
        self._write_head()
        self._maybe_checkpoint()

    def _check_still_linked(self) -> None:
        """OSError unless the open segment is still the file at its path."""
        assert self._file is not None
        opened = os.fstat(self._file.fileno())
        try:
            named = os.stat(self._file.name)
        except FileNotFoundError:
            named = None
        if (
            opened.st_nlink == 0
            or named is None
            or (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino)
        ):
            raise OSError(errno.ENOENT, f"audit segment {self._file.name} was removed or replaced while open")

    def _chained_lines(self, events: Iterable[Mapping[str, Any]]) -> bytes:
        lines = []
        for event in events:
            self.count += 1
            numbered = {**event, "seq": self.count}  # inside the hash: checkpoints name events by seq
            prev_hash, self.last_hash = self.last_hash, chain_hash(numbered, self.last_hash)
            record = {**numbered, "prev_hash": prev_hash, "hash": self.last_hash}
            lines.append(line_json(record) + b"\n")
        return b"".join(lines)

    def _write_all(self, data: bytes) -> None:
        assert self._file is not None
        view = memoryview(data)
        while view:
            written = self._file.write(view)
            view = view[written or 0 :]

    def _roll_back(self, tip: tuple[str, int], start: int) -> None:
        """Forgets a batch that did not reach the disk: the tip in memory and any bytes written."""
        self.last_hash, self.count = tip
        assert self._file is not None
        try:
            self._file.truncate(start)
        except OSError:  # the next start-up drops a torn tail the same way
            log.exception("could not cut the failed audit batch from %s", self._file.name)
        self.close()

    def _write_head(self) -> None:
        """Records the tip; the events are durable already, so a failure here only lags the head."""
        temporary = self.head_path.with_suffix(".head.tmp")
        head: dict[str, Any] = {"count": self.count, "hash": self.last_hash}
        try:
            temporary.unlink(missing_ok=True)  # one a crash left may predate the 0600 mode
            with open(temporary, "w", opener=private_opener) as file:
                file.write(json.dumps(self.signer.sign(head) if self.signer else head))
            temporary.replace(self.head_path)
        except OSError:
            log.exception("could not update %s; it lags the log until the next write", self.head_path.name)
            temporary.unlink(missing_ok=True)

    def _maybe_checkpoint(self) -> None:
        """Appends a signed checkpoint of the tip when the last one is older than the interval."""
        now = time.monotonic()
        if self.signer is None or (
            self._last_checkpoint_at is not None
            and now - self._last_checkpoint_at < self.checkpoint_interval_s
        ):
            return
        record = self.signer.sign(
            {"count": self.count, "hash": self.last_hash, "timestamp_unix_s": time.time()}
        )
        try:
            with open(checkpoints_path(self.directory, self.stream), "ab", opener=private_opener) as file:
                file.write(canonical_json(record) + b"\n")
                file.flush()
                os.fsync(file.fileno())
        except OSError:
            log.exception("could not append an audit checkpoint; the next batch tries again")
            return
        self._last_checkpoint_at = now

    def close(self) -> None:
        """Closes the open segment, if any."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def current_segment(self) -> Path | None:
        """The segment being written, if one is open."""
        return Path(self._file.name) if self._file is not None else None  # type: ignore[arg-type]


def _last_seq(path: Path) -> int:
    """The `seq` of the segment's last complete line (0 for lines written before events had one)."""
    record = last_record(path)
    return int(record.get("seq", 0)) if record else 0


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
