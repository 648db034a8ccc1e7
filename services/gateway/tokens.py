"""Minting development tokens and the development key pair that `thermocline up` uses."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


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
) -> str:
    """A signed JWT for `subject`, valid from now for `ttl_s` seconds."""
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
    return jwt.encode(claims, private_key, algorithm=algorithm, headers={"typ": "JWT"})
