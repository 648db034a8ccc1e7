"""Keeps credentials out of log lines: bearer tokens and JWTs are replaced before a line is written.

Libraries log what they are handed: grpc, for one, logs a whole metadata entry (bearer token and
all) when its value is not UTF-8. The formatter below redacts every formatted line, traceback
included, whichever logger wrote it.
"""

from __future__ import annotations

import logging
import re

REDACTED = "[credential redacted]"
_CREDENTIALS = re.compile(
    r"(?i:bearer)\s+[^\s'\"]+"  # an authorization value
    r"|eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"  # a compact JWS: {"... in base64url
)


def redact(text: str) -> str:
    """`text` with every bearer token and JWT replaced."""
    return _CREDENTIALS.sub(REDACTED, text)


class RedactingFormatter(logging.Formatter):
    """A formatter whose output never holds a credential."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))
