"""Minting development tokens and the development key pair that `thermocline up` uses."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from services.gateway.jwks import public_jwk, secret_kid


def ensure_dev_keys(directory: Path) -> tuple[Path, Path]:
    """An RSA-2048 key pair in `directory` (made once): (private PEM, public PEM)."""
    directory.mkdir(parents=True, exist_ok=True)
    private_path, public_path = directory / "jwt-private.pem", directory / "jwt-public.pem"
    if private_path.exists() and public_path.exists():
        return private_path, public_path
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    private_path.write_bytes(private_pem)
    private_path.chmod(0o600)
    public_path.write_bytes(public_pem)
    return private_path, public_path


def mint_token(
    private_key: str | bytes,
    *,
    subject: str,
    tenant: str | None = None,
    issuer: str = "thermocline-dev",
    audience: str = "thermocline",
    ttl_s: float = 3600.0,
    algorithm: str = "RS256",
    extra_claims: dict[str, object] | None = None,
    kid: str | None = None,
    headers: dict[str, object] | None = None,
) -> str:
    """A signed JWT for `subject`, valid from now for `ttl_s` seconds.

    `kid` defaults to the key's RFC 7638 thumbprint, which is the id the gateway gives a PEM key.
    """
    now = int(time.time())
    claims: dict[str, object] = {
        "sub": subject,
        "tenant": tenant or subject,
        "iss": issuer,
        "aud": audience,
        "iat": now,
        "nbf": now,
        "exp": now + int(ttl_s),
        "jti": uuid.uuid4().hex,
        **(extra_claims or {}),
    }
    key_bytes = private_key.encode() if isinstance(private_key, str) else private_key
    if kid is None:
        kid = key_id(key_bytes, algorithm)
    header = {"typ": "JWT", "kid": kid, **(headers or {})}
    return jwt.encode(claims, private_key, algorithm=algorithm, headers=header)


def key_id(key: bytes, algorithm: str) -> str:
    """The `kid` the gateway assigns a PEM key (or HS256 secret): its RFC 7638 thumbprint."""
    if algorithm == "HS256":
        return secret_kid(key.strip())
    return str(public_jwk(key, algorithm)["kid"])


def write_jwks(public_pems: list[bytes], path: Path, algorithm: str = "RS256") -> dict[str, object]:
    """Writes a JWKS file holding the public halves of `public_pems`; returns the document."""
    document: dict[str, object] = {"keys": [public_jwk(pem, algorithm) for pem in public_pems]}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(document, indent=2))
    temporary.replace(path)
    return document
