"""Bearer-token verification, following RFC 8725 (JSON Web Token Best Current Practices).

The key is chosen by the token's `kid` from a fixed local key set (jwks.py), and the algorithm
is the one that key pins: the token's `alg` must equal it, so `none` and HS256-with-a-public-key
tricks fail before any signature check. `exp`, `iss`, `aud` and `sub` are required, `nbf` and
`iat` are honoured, and `typ` must be the configured one (explicit typing). The dates are checked,
with a small leeway, by one rule (verified_tokens.check_times) that names the claim that failed;
`exp` may lie at most `THERMOCLINE_GATEWAY_JWT_MAX_LIFETIME_S` from now (and from `iat`), so a
token minted never to expire is refused. A header or payload that repeats a key is refused: JSON
readers disagree on which copy wins (PyJWT's reader takes the last, others the first), so one
signed token would name two tenants. Header fields that point at other keys (`jku`, `x5u`,
`jwk`, `x5c`) are refused, never followed.
A token that passed is remembered (verified_tokens.py): its repeats skip the signature check but
not the clock or the key set.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

import jwt

from services.common.errors import Unauthenticated
from services.gateway.config import JwtConfig
from services.gateway.jwks import KeySet, VerificationKey
from services.gateway.request_bounds import MAX_TOKEN_CHARS
from services.gateway.verified_tokens import VerifiedToken, VerifiedTokens, check_times

_REMOTE_KEY_HEADERS = ("jku", "x5u", "jwk", "x5c")
MAX_SUBJECT_CHARS = 256
# RFC 7519 §2 NumericDate: these claims must be JSON numbers; PyJWT would also take "1796145153".
_NUMERIC_DATE_CLAIMS = ("exp", "nbf", "iat")


@dataclass(frozen=True)
class Principal:
    """Who is calling, as the verified token says."""

    subject: str
    tenant: str
    claims: dict[str, Any]
    roles: list[str] = field(default_factory=list)


def _shown(value: object) -> str:
    """A header value quoted safely for an error message (bounded, repr-escaped)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "...'"


def bearer_token(authorization: str | None) -> str:
    """The token of an `authorization: Bearer <token>` entry."""
    if not authorization:
        raise Unauthenticated("missing credentials: send metadata 'authorization: Bearer <JWT>'")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization metadata must read 'Bearer <JWT>'")
    if len(token) > MAX_TOKEN_CHARS:
        raise Unauthenticated(f"token is {len(token)} characters, longer than the {MAX_TOKEN_CHARS} allowed")
    return token.strip()


class JwtVerifier:
    """Verifies tokens against a fixed key set, one issuer and one audience."""

    def __init__(self, config: JwtConfig) -> None:
        self.config = config
        self.keys = KeySet(config.key_file, config.algorithm)
        self.verified = VerifiedTokens(config.leeway_s, config.max_cached_tokens)

    def verify(self, authorization: str | None) -> Principal:
        """The caller's principal; Unauthenticated with the reason when the token fails."""
        token = bearer_token(authorization)
        if (principal := self.verified.get(token, self.keys.find)) is not None:
            return principal
        _check_unique_keys(token)
        header = self._header(token)
        key = self._key_for(header)
        claims = self._decode(token, key)
        _check_numeric_dates(claims)
        now_s = self.verified.clock()
        check_times(claims, now_s, self.config.leeway_s)
        self._check_lifetime(claims, now_s)
        principal = self._principal(claims)
        self.verified.put(token, VerifiedToken(principal, header.get("kid"), key))
        return principal

    def _check_lifetime(self, claims: dict[str, Any], now_s: float) -> None:
        """Refuses an `exp` further than the maximum lifetime from now (with the clock skew
        allowed) or, with an `iat`, from it. Checked once: a cached token's time left only shrinks."""
        max_s, exp = self.config.max_lifetime_s, claims["exp"]
        if exp - now_s > max_s + self.config.leeway_s:
            _refuse_lifetime(f"{_seconds(exp - now_s)} s from now", max_s)
        if "iat" in claims and exp - claims["iat"] > max_s:
            _refuse_lifetime(f"{_seconds(exp - claims['iat'])} s after its 'iat'", max_s)

    def _principal(self, claims: dict[str, Any]) -> Principal:
        """The principal a verified token's claims name, once their types and sizes pass."""
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise Unauthenticated("token has no 'sub' claim naming the caller")
        if len(subject) > MAX_SUBJECT_CHARS or not subject.isprintable():
            raise Unauthenticated(f"token's 'sub' claim must be 1-{MAX_SUBJECT_CHARS} printable characters")
        tenant = claims.get("tenant", subject)
        if not isinstance(tenant, str) or not tenant:
            raise Unauthenticated("token's 'tenant' claim must be a non-empty string")
        return Principal(subject=subject, tenant=tenant, claims=claims)

    def _header(self, token: str) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            raise Unauthenticated("malformed token: not a compact JWS (header.payload.signature)") from None
        except jwt.InvalidTokenError as error:  # e.g. a `crit` we do not support, a `kid` that is no string
            raise Unauthenticated(f"malformed token header: {_bounded(str(error))}") from None
        remote = [name for name in _REMOTE_KEY_HEADERS if name in header]
        if remote:
            raise Unauthenticated(
                f"token header names a remote or embedded key ({', '.join(remote)}); refused, never fetched"
            )
        algorithm = header.get("alg")
        if not isinstance(algorithm, str) or algorithm.lower() == "none":
            raise Unauthenticated("unsigned token (alg 'none') refused")
        typ = header.get("typ")
        if not isinstance(typ, str) or typ.lower() != self.config.typ.lower():
            wanted = self.config.typ
            raise Unauthenticated(f"token typ {_shown(typ)} refused; this gateway requires typ '{wanted}'")
        return header

    def _key_for(self, header: dict[str, Any]) -> VerificationKey:
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise Unauthenticated("token kid must be a string")
        key = self.keys.find(kid)
        if key is None:
            wanted = "a 'kid' header" if kid is None else f"a known kid, not {_shown(kid)}"
            raise Unauthenticated(f"unknown signing key: the token needs {wanted}; ask for a fresh token")
        if header["alg"] != key.algorithm:
            raise Unauthenticated(
                f"token algorithm {_shown(header['alg'])} refused; "
                f"key {key.kid!r} is pinned to {key.algorithm}"
            )
        return key

    def _decode(self, token: str, key: VerificationKey) -> dict[str, Any]:
        try:
            return jwt.decode(
                token,
                key.key,
                algorithms=[key.algorithm],
                audience=self.config.audience,
                issuer=self.config.issuer,
                leeway=self.config.leeway_s,
                # the dates are checked after, by check_times: PyJWT calls an `iat` in the future
                # "not yet valid", as it calls an `nbf`, and the cache's repeats need the same rule
                options={
                    "require": ["exp", "iss", "aud", "sub"],
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
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
            raise Unauthenticated(f"invalid token: {_bounded(str(error))}") from None


def _bounded(text: str, max_chars: int = 200) -> str:
    """A library's error text, which may quote the token, cut to a size fit for a status message."""
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def _refuse_lifetime(how_far: str, max_lifetime_s: float) -> None:
    raise Unauthenticated(
        f"token's 'exp' is {how_far}, over the gateway's limit of {max_lifetime_s:g} s on a token's "
        "lifetime (THERMOCLINE_GATEWAY_JWT_MAX_LIFETIME_S); ask the issuer for one that expires sooner"
    )


def _seconds(value: float) -> str:
    """A span of seconds for a message: whole below a billion, else in 3 figures (an `exp` of 1e300)."""
    return f"{value:.0f}" if value < 1e9 else f"{value:.3g}"


def _check_unique_keys(token: str) -> None:
    """Refuses a header or payload whose JSON repeats a key in any object. A segment that is not
    base64url JSON is left to PyJWT, which refuses it with its own reason."""
    for part, segment in zip(("header", "payload"), token.split(".")[:2], strict=False):
        try:
            text = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
            json.loads(text, object_pairs_hook=functools.partial(_unique_keys, part))
        except (binascii.Error, ValueError):
            return
        except RecursionError:
            raise Unauthenticated(f"malformed token: its {part} nests too deeply") from None


def _unique_keys(part: str, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object of a token's `part`, refused when it repeats a key."""
    fields: dict[str, Any] = {}
    for key, value in pairs:
        if key in fields:
            raise Unauthenticated(
                f"token {part} repeats the key {_shown(key)}; readers disagree on which copy counts, "
                "so the token is refused: ask the issuer for one that names each claim once"
            )
        fields[key] = value
    return fields


def _check_numeric_dates(claims: dict[str, Any]) -> None:
    """Refuses `exp`, `nbf` or `iat` given as anything but a finite JSON number."""
    for name in _NUMERIC_DATE_CLAIMS:
        value = claims.get(name)
        if name not in claims:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Unauthenticated(
                f"token claim '{name}' must be a JSON number (seconds since the epoch), "
                f"not {type(value).__name__}"
            )
        if not math.isfinite(value):  # Python's JSON reader takes NaN and Infinity
            raise Unauthenticated(
                f"token claim '{name}' must be a finite JSON number (seconds since the epoch), not {value}"
            )
