"""Bearer-token verification: a JWT signed with the one configured key and algorithm.

Following RFC 8725: the algorithm is pinned by configuration and never taken from the token,
`none` is refused outright, `exp`, `iss` and `aud` are required, and header fields that point
at other keys (`jku`, `x5u`, `jwk`) are refused rather than followed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jwt

from services.common.errors import Unauthenticated
from services.gateway.config import JwtConfig

_REMOTE_KEY_HEADERS = ("jku", "x5u", "jwk", "x5c")


@dataclass(frozen=True)
class Principal:
    """Who is calling, as the verified token says."""

    subject: str
    tenant: str
    claims: dict[str, Any]


def load_key(config: JwtConfig) -> str | bytes:
    """Reads the verification key; an HS256 secret must be at least 32 bytes."""
    try:
        data = config.key_file.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read JWT key file {config.key_file}: {error.strerror}") from None
    if config.algorithm == "HS256":
        secret = data.strip()
        if len(secret) < 32:
            raise ValueError(f"HS256 secret in {config.key_file} is {len(secret)} bytes; use at least 32")
        return secret
    return data.decode("ascii")


def bearer_token(authorization: str | None) -> str:
    """The token of an `authorization: Bearer <token>` entry."""
    if not authorization:
        raise Unauthenticated("missing credentials: send metadata 'authorization: Bearer <JWT>'")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization metadata must read 'Bearer <JWT>'")
    return token.strip()


class JwtVerifier:
    """Verifies tokens against one key, one algorithm, one issuer and one audience."""

    def __init__(self, config: JwtConfig) -> None:
        self.config = config
        self._key = load_key(config)

    def verify(self, authorization: str | None) -> Principal:
        """The caller's principal; Unauthenticated with the reason when the token fails."""
        token = bearer_token(authorization)
        self._check_header(token)
        claims = self._decode(token)
        subject = str(claims.get("sub") or "")
        if not subject:
            raise Unauthenticated("token has no 'sub' claim naming the caller")
        return Principal(subject=subject, tenant=str(claims.get("tenant") or subject), claims=claims)

    def _check_header(self, token: str) -> None:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            raise Unauthenticated("malformed token: not a compact JWS (header.payload.signature)") from None
        algorithm = str(header.get("alg", ""))
        if algorithm.lower() == "none":
            raise Unauthenticated("unsigned token (alg 'none') refused")
        if algorithm != self.config.algorithm:
            raise Unauthenticated(
                f"token algorithm {algorithm!r} refused; this gateway accepts {self.config.algorithm}"
            )
        remote = [name for name in _REMOTE_KEY_HEADERS if name in header]
        if remote:
            raise Unauthenticated(
                f"token header names a remote or embedded key ({', '.join(remote)}); refused"
            )

    def _decode(self, token: str) -> dict[str, Any]:
        try:
            return jwt.decode(
                token,
                self._key,
                algorithms=[self.config.algorithm],
                audience=self.config.audience,
                issuer=self.config.issuer,
                leeway=self.config.leeway_s,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("token has expired; mint a new one") from None
        except jwt.ImmatureSignatureError:
            raise Unauthenticated("token is not valid yet (nbf is in the future)") from None
        except jwt.InvalidAudienceError:
            raise Unauthenticated(
                f"token audience is wrong; this gateway is {self.config.audience!r}"
            ) from None
        except jwt.InvalidIssuerError:
            raise Unauthenticated(
                f"token issuer is wrong; this gateway trusts {self.config.issuer!r}"
            ) from None
        except jwt.MissingRequiredClaimError as error:
            raise Unauthenticated(f"token lacks the required '{error.claim}' claim") from None
        except jwt.InvalidSignatureError:
            raise Unauthenticated("token signature does not verify against the gateway's key") from None
        except jwt.InvalidTokenError as error:
            raise Unauthenticated(f"invalid token: {error}") from None
