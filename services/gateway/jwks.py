"""The gateway's fixed set of token-verification keys, looked up by `kid`, reloaded on rotation.

Keys come from one local file, never from the token: either a JWKS document
(`{"keys": [{"kid": ..., "alg": ..., "kty": ..., ...}]}`, every key with its own pinned `alg`)
or a single PEM public key (or HS256 secret) whose algorithm the configuration pins and whose
`kid` is its RFC 7638 thumbprint. Rotation is a file edit: the set is re-read when the file's
mtime or size changes, so an operator adds the new key, waits out the old tokens, then drops
the old key. A file that fails to parse leaves the previous set in force.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

log = logging.getLogger(__name__)

ASYMMETRIC_ALGORITHMS = ("RS256", "ES256")
SYMMETRIC_ALGORITHMS = ("HS256",)
MIN_SECRET_BYTES = 32
# The JWK members that identify a key, per key type (RFC 7638 §3.2).
_THUMBPRINT_MEMBERS = {"RSA": ("e", "kty", "n"), "EC": ("crv", "kty", "x", "y"), "oct": ("k", "kty")}


@dataclass(frozen=True)
class VerificationKey:
    """One key of the set: its id, the one algorithm it verifies, and the key itself."""

    kid: str
    algorithm: str
    key: Any


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def jwk_thumbprint(jwk: dict[str, Any]) -> str:
    """The RFC 7638 SHA-256 thumbprint of a public JWK, base64url encoded."""
    members = _THUMBPRINT_MEMBERS.get(str(jwk.get("kty")))
    if members is None:
        raise ValueError(f"unsupported JWK key type {jwk.get('kty')!r}")
    canonical = json.dumps({m: jwk[m] for m in members}, separators=(",", ":"), sort_keys=True)
    return _b64url(hashlib.sha256(canonical.encode()).digest())


def public_jwk(pem: bytes, algorithm: str) -> dict[str, Any]:
    """The public JWK (with `kid` and `alg`) of a PEM key, public or private."""
    codec: Any = RSAAlgorithm if algorithm == "RS256" else ECAlgorithm
    key = codec(codec.SHA256).prepare_key(pem)
    public = key.public_key() if hasattr(key, "private_numbers") else key
    jwk: dict[str, Any] = json.loads(codec.to_jwk(public))
    jwk |= {"alg": algorithm, "use": "sig"}
    jwk["kid"] = jwk_thumbprint(jwk)
    return jwk


def secret_kid(secret: bytes) -> str:
    """The `kid` of an HS256 secret: its RFC 7638 thumbprint."""
    return jwk_thumbprint({"kty": "oct", "k": _b64url(secret)})


def _from_jwk(entry: dict[str, Any]) -> VerificationKey:
    """One JWKS entry as a key; refuses entries without a pinned algorithm or a kid."""
    kid, algorithm = entry.get("kid"), entry.get("alg")
    if not isinstance(kid, str) or not kid:
        raise ValueError("every JWKS key needs a non-empty 'kid'")
    if algorithm not in ASYMMETRIC_ALGORITHMS + SYMMETRIC_ALGORITHMS:
        raise ValueError(f"JWKS key {kid!r}: 'alg' must be one of RS256, ES256, HS256, got {algorithm!r}")
    if entry.get("use", "sig") != "sig":
        raise ValueError(f"JWKS key {kid!r} is not a signing key (use={entry.get('use')!r})")
    if "d" in entry:
        raise ValueError(f"JWKS key {kid!r} holds a private key; publish only the public part")
    key = jwt.PyJWK(entry, algorithm=algorithm).key
    if algorithm == "HS256" and len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"JWKS key {kid!r}: HS256 secret is {len(key)} bytes; use at least 32")
    return VerificationKey(kid=kid, algorithm=algorithm, key=key)


def parse_jwks(text: str) -> dict[str, VerificationKey]:
    """The keys of a JWKS document, by kid."""
    document = json.loads(text)
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError("a JWKS file must be a JSON object with a non-empty 'keys' list")
    keys = [_from_jwk(entry) for entry in entries]
    by_kid = {key.kid: key for key in keys}
    if len(by_kid) != len(keys):
        raise ValueError("JWKS key ids must be unique")
    return by_kid


def parse_single_key(data: bytes, algorithm: str) -> dict[str, VerificationKey]:
    """A one-key set from a PEM public key (RS256/ES256) or a shared secret (HS256)."""
    if algorithm in SYMMETRIC_ALGORITHMS:
        secret = data.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"HS256 secret is {len(secret)} bytes; use at least 32")
        return {secret_kid(secret): VerificationKey(secret_kid(secret), algorithm, secret)}
    jwk = public_jwk(data, algorithm)
    key = jwt.PyJWK(jwk, algorithm=algorithm).key
    return {jwk["kid"]: VerificationKey(jwk["kid"], algorithm, key)}


def parse_key_file(data: bytes, algorithm: str) -> dict[str, VerificationKey]:
    """A JWKS document when the file holds JSON, otherwise a single PEM key or secret."""
    if data.lstrip().startswith(b"{"):
        return parse_jwks(data.decode("utf-8"))
    return parse_single_key(data, algorithm)


class KeySet:
    """The keys that verify tokens, from one local file, re-read when the file changes."""

    def __init__(self, path: Path, algorithm: str) -> None:
        self.path = path
        self.algorithm = algorithm
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._keys = self._read()

    def _file_stamp(self) -> tuple[int, int]:
        try:
            stat = self.path.stat()
        except OSError as error:
            raise ValueError(f"cannot read JWT key file {self.path}: {error.strerror}") from None
        return stat.st_mtime_ns, stat.st_size

    def _read(self) -> dict[str, VerificationKey]:
        try:
            return parse_key_file(self.path.read_bytes(), self.algorithm)
        except OSError as error:
            raise ValueError(f"cannot read JWT key file {self.path}: {error.strerror}") from None
        except (ValueError, jwt.PyJWKError, jwt.InvalidKeyError) as error:
            raise ValueError(f"JWT key file {self.path}: {error}") from None

    def refresh(self) -> None:
        """Re-reads the file when it changed; a broken file keeps the previous keys in force."""
        try:
            stamp = self._file_stamp()
        except ValueError as error:
            log.error("%s; keeping the %d key(s) loaded before", error, len(self._keys))
            return
        if stamp == self._stamp:
            return
        with self._lock:
            try:
                self._keys = self._read()
                log.info("JWT key set reloaded: kids %s", sorted(self._keys))
            except ValueError as error:
                log.error("%s; keeping the %d key(s) loaded before", error, len(self._keys))
            self._stamp = stamp

    @property
    def kids(self) -> list[str]:
        """The key ids in force, sorted."""
        return sorted(self._keys)

    def find(self, kid: str | None) -> VerificationKey | None:
        """The key for `kid`; a token without `kid` may use the only key of a one-key set."""
        self.refresh()
        keys = self._keys
        if kid is None:
            return next(iter(keys.values())) if len(keys) == 1 else None
        return keys.get(kid)
