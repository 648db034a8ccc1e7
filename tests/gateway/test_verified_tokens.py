"""The verified-token cache against real signed tokens and real key files: a repeat skips the
signature check, but never the clock or the key set."""

from __future__ import annotations

import time
from pathlib import Path

import jwt
import pytest

from services.common.errors import Unauthenticated
from services.gateway.auth import JwtVerifier
from services.gateway.config import JwtConfig
from services.gateway.tokens import ensure_dev_keys, key_id, mint_token, write_jwks
from services.gateway.verified_tokens import MAX_CACHED_TOKEN_CHARS, check_times

LEEWAY_S = 5


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    private_path, public_path = ensure_dev_keys(tmp_path_factory.mktemp("keys"))
    return private_path.read_bytes(), public_path


def _verifier(key_file: Path, max_cached_tokens: int = 16) -> JwtVerifier:
    return JwtVerifier(JwtConfig(key_file=key_file, leeway_s=LEEWAY_S, max_cached_tokens=max_cached_tokens))


def _bearer(token: str) -> str:
    return f"Bearer {token}"


def test_a_repeated_token_is_served_from_the_cache(keys: tuple[bytes, Path]) -> None:
    verifier = _verifier(keys[1])
    bearer = _bearer(mint_token(keys[0], subject="alice", tenant="acme"))
    first = verifier.verify(bearer)
    assert len(verifier.verified) == 1
    assert verifier.verify(bearer) is first


def test_a_cached_token_is_refused_once_it_expires(keys: tuple[bytes, Path]) -> None:
    verifier = _verifier(keys[1])
    bearer = _bearer(mint_token(keys[0], subject="alice", ttl_s=60))
    verifier.verify(bearer)
    now = time.time()
    verifier.verified.clock = lambda: now + 60 + LEEWAY_S - 2  # within the leeway: still served
    assert verifier.verify(bearer).subject == "alice"
    verifier.verified.clock = lambda: now + 60 + LEEWAY_S + 2
    with pytest.raises(Unauthenticated, match="token has expired"):
        verifier.verify(bearer)
    assert len(verifier.verified) == 0


def test_a_cached_token_is_refused_once_its_key_is_retired(tmp_path: Path, keys: tuple[bytes, Path]) -> None:
    old_private, old_public = keys[0], keys[1].read_bytes()
    _, new_public = ensure_dev_keys(tmp_path / "new")
    jwks = tmp_path / "jwks.json"
    write_jwks([old_public, new_public.read_bytes()], jwks)
    verifier = _verifier(jwks)
    bearer = _bearer(mint_token(old_private, subject="alice"))
    assert verifier.verify(bearer).subject == "alice"
    write_jwks([new_public.read_bytes()], jwks)  # the operator revokes the old key
    with pytest.raises(Unauthenticated, match="unknown signing key"):
        verifier.verify(bearer)
    assert len(verifier.verified) == 0


def test_a_cached_token_without_kid_is_refused_once_the_key_set_grows(
    tmp_path: Path, keys: tuple[bytes, Path]
) -> None:
    _, new_public = ensure_dev_keys(tmp_path / "new")
    jwks = tmp_path / "jwks.json"
    write_jwks([keys[1].read_bytes()], jwks)
    verifier = _verifier(jwks)
    claims = {"sub": "alice", "iss": "thermocline-dev", "aud": "thermocline", "exp": int(time.time()) + 600}
    bearer = _bearer(jwt.encode(claims, keys[0], algorithm="RS256", headers={"typ": "JWT"}))
    assert verifier.verify(bearer).subject == "alice"  # a one-key set takes a token without kid
    write_jwks([keys[1].read_bytes(), new_public.read_bytes()], jwks)
    with pytest.raises(Unauthenticated, match="unknown signing key"):
        verifier.verify(bearer)


def test_a_refused_token_is_never_cached(tmp_path: Path, keys: tuple[bytes, Path]) -> None:
    other_private, _ = ensure_dev_keys(tmp_path / "other")
    verifier = _verifier(keys[1])
    forged = mint_token(other_private.read_bytes(), subject="mallory", kid=key_id(keys[0], "RS256"))
    for _ in range(2):
        with pytest.raises(Unauthenticated, match="signature does not verify"):
            verifier.verify(_bearer(forged))
    assert len(verifier.verified) == 0


def test_the_cache_is_bounded(keys: tuple[bytes, Path]) -> None:
    verifier = _verifier(keys[1], max_cached_tokens=2)
    for subject in ("a", "b", "c"):
        verifier.verify(_bearer(mint_token(keys[0], subject=subject)))
    assert len(verifier.verified) == 2
    long_token = mint_token(keys[0], subject="d", extra_claims={"pad": "x" * MAX_CACHED_TOKEN_CHARS})
    assert verifier.verify(_bearer(long_token)).subject == "d"
    assert len(verifier.verified) == 2  # a long token is verified every time, never cached
    off = _verifier(keys[1], max_cached_tokens=0)
    off.verify(_bearer(mint_token(keys[0], subject="e")))
    assert len(off.verified) == 0


@pytest.mark.parametrize(
    ("claims", "reason"),
    [
        ({"exp": 1000 - LEEWAY_S}, "expired"),  # PyJWT: expired when exp <= now - leeway
        ({"exp": 2000, "nbf": 1000 + LEEWAY_S + 1}, r"not valid yet \(nbf is in the future"),
        ({"exp": 2000, "iat": 1000 + LEEWAY_S + 1}, r"issued in the future \(iat is 6 s ahead"),
    ],
)
def test_the_clock_checks_follow_pyjwt(claims: dict[str, int], reason: str) -> None:
    with pytest.raises(Unauthenticated, match=reason):
        check_times(claims, now_s=1000, leeway_s=LEEWAY_S)
    check_times({"exp": 1001 - LEEWAY_S, "nbf": 1000 + LEEWAY_S, "iat": 1000 + LEEWAY_S}, 1000, LEEWAY_S)
