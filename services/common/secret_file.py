"""Secret files that a local mesh makes for itself: the service token, the audit signing key."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

SECRET_BYTES = 32


def ensure_secret_file(path: Path) -> Path:
    """A random hex secret of SECRET_BYTES at `path`, made once with mode 0600 and never rewritten.

    O_EXCL with the mode given at creation: no moment exists when the file holds the secret and
    others can read it, and a file that is already there (a secret in use) is left as it is."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return path
