"""Keeps credentials out of log lines: bearer tokens, JWTs and the service token are replaced before a
line is written.

Libraries log what they are handed: grpc, for one, logs a whole metadata entry (bearer token and
all) when its value is not UTF-8. The formatter below redacts every formatted line, traceback
included, whichever logger wrote it. The service token (service_auth.py) is redacted twice over:
after its metadata key, and wherever its value appears, once the process has read it (add_secret).
"""

from __future__ import annotations

import logging
import re

REDACTED = "[credential redacted]"
_CREDENTIALS = re.compile(
    r"(?i:bearer)\s+[^\s'\"]+"  # an authorization value
    r"|eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"  # a compact JWS: {"... in base64url
    r"|(?i:x-thermocline-service-token)['\"]?\s*[:,=]\s*b?['\"]?[^\s'\",)]+"  # the service token's entry
)
_secrets: set[str] = set()


def add_secret(value: str) -> None:
    """Redacts `value` itself from every later line of this process (the service token it holds)."""
    _secrets.add(value)


def redact(text: str) -> str:
    """`text` with every bearer token, JWT and known secret replaced."""
    for secret in _secrets:
        text = text.replace(secret, REDACTED)
    return _CREDENTIALS.sub(REDACTED, text)


class RedactingFormatter(logging.Formatter):
    """A formatter whose output never holds a credential."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))
