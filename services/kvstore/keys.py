"""Block keys: a caller's hash, salted with its tenant's secret and scoped to its model.

The engine names a block by its content hash. Two tenants with the same prompt prefix produce the
same hash, so the hash alone must never find a block: the store keys each record by
`sha256(tenant salt | model | hash)`, where the tenant salt is an HMAC of the tenant name under a
secret that only the store holds. A tenant that knows another's hashes still derives a different
key, and nothing in the index or on disk lets it go the other way.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections import OrderedDict
from pathlib import Path
from typing import NewType

from services.common.errors import InvalidArgument
from services.common.kvstore_api import MAX_NAME_BYTES, BlockHash, Namespace

__all__ = [
    "MAX_NAME_BYTES",
    "BlockHash",
    "Namespace",
    "SecretMissing",
    "StoreKey",
    "TenantSalts",
    "check_hash",
]

StoreKey = NewType("StoreKey", bytes)  # 32 bytes: what the index and the records are keyed by

MAX_HASH_CHARS = 128
SECRET_BYTES = 32
MAX_CACHED_SALTS = 4096  # tenants whose salt is kept; a salt is one HMAC, recomputed past this
_HEX = re.compile(r"[0-9a-f]+")


def check_hash(block_hash: str) -> BlockHash:
    """A caller's hash, checked: 8 to 128 lowercase hex characters."""
    if not 8 <= len(block_hash) <= MAX_HASH_CHARS or not _HEX.fullmatch(block_hash):
        raise InvalidArgument(
            f"block hash {block_hash[:40]!r} is not 8..{MAX_HASH_CHARS} lowercase hex characters"
        )
    return BlockHash(block_hash)


class SecretMissing(Exception):
    """The data dir holds segments, but not the secret their keys were derived with."""


def _write_secret(path: Path) -> None:
    """A new secret, whole or not at all: a temporary file, fsynced, renamed over, and the
    directory fsynced (a crash mid-write left an empty secret, and the store could not start)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".new")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(secrets.token_bytes(SECRET_BYTES))
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class TenantSalts:
    """Derives each tenant's salt from the store's secret, and keys from salts."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError(f"the tenant secret must be at least 16 bytes, got {len(secret)}")
        self._secret = secret
        self._salts: OrderedDict[str, bytes] = OrderedDict()  # least recently used first

    @classmethod
    def load_or_create(cls, path: Path, may_create: bool = True) -> TenantSalts:
        """The secret in `path`, created (mode 0600) on a first start; keep it with the segments.

        With `may_create` False (the data dir holds segments) a missing secret is SecretMissing:
        a new one would leave every stored block unreachable while the store looked healthy."""
        if not path.exists():
            if not may_create:
                raise SecretMissing(
                    f"the tenant secret {path} is missing, but the data dir holds segments keyed with it: "
                    "restore it from the backup of this data dir, or delete the segments to start empty"
                )
            _write_secret(path)
        return cls(path.read_bytes())

    def salt(self, tenant: str) -> bytes:
        """HMAC-SHA256 of the tenant name under the secret. The last MAX_CACHED_SALTS tenants' salts
        are kept: callers name their tenant, so an unbounded cache grew with every name sent."""
        salt = self._salts.get(tenant)
        if salt is None:
            salt = hmac.new(self._secret, tenant.encode(), hashlib.sha256).digest()
            if len(self._salts) >= MAX_CACHED_SALTS:
                self._salts.popitem(last=False)
            self._salts[tenant] = salt
        else:
            self._salts.move_to_end(tenant)
        return salt

    @property
    def num_cached_salts(self) -> int:
        """Salts kept now (at most MAX_CACHED_SALTS)."""
        return len(self._salts)

    def key(self, namespace: Namespace, block_hash: BlockHash) -> StoreKey:
        """The store key of one block."""
        digest = hashlib.sha256(self.salt(namespace.tenant))
        model = namespace.model.encode()
        digest.update(len(model).to_bytes(2, "little") + model)
        digest.update(block_hash.encode())
        return StoreKey(digest.digest())
