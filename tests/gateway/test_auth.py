"""JWT verification against real signed tokens (PyJWT and real RSA keys, no fakes)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import time
from pathlib import Path

import jwt
import pytest
from jwt.algorithms import RSAAlgorithm

from services.common.errors import Unauthenticated
from services.gateway.auth import JwtVerifier
from services.gateway.config import JwtConfig
from services.gateway.tokens import ensure_dev_keys, key_id, mint_token, write_jwks


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    private_path, public_path = ensure_dev_keys(tmp_path_factory.mktemp("keys"))
    return private_path.read_bytes(), public_path


@pytest.fixture(scope="module")
def verifier(keys: tuple[bytes, Path]) -> JwtVerifier:
    return JwtVerifier(JwtConfig(key_file=keys[1], leeway_s=5))


def _bearer(token: str) -> str:
    return f"Bearer {token}"


def _b64(data: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_a_minted_token_verifies(keys: tuple[bytes, Path], verifier: JwtVerifier) -> None:
    principal = verifier.verify(_bearer(mint_token(keys[0], subject="alice", tenant="acme")))
    assert (principal.subject, principal.tenant) == ("alice", "acme")


@pytest.mark.parametrize(
    ("claims", "reason"),
    [
        ({"aud": "someone-else"}, "audience is wrong"),
        ({"iss": "evil"}, "issuer is wrong"),
        ({"exp": -60}, "expired"),  # times are offsets from when the test runs, not from collection
        ({"nbf": 600}, "not valid yet"),
    ],
)
def test_bad_claims_are_refused(
    keys: tuple[bytes, Path], verifier: JwtVerifier, claims: dict[str, object], reason: str
) -> None:
    now = int(time.time())
    claims = {k: now + v if k in ("exp", "nbf") else v for k, v in claims.items()}  # type: ignore[operator]
    token = mint_token(keys[0], subject="alice", extra_claims=claims)
    with pytest.raises(Unauthenticated, match=reason):
        verifier.verify(_bearer(token))


def test_expiry_within_the_leeway_is_accepted(keys: tuple[bytes, Path], verifier: JwtVerifier) -> None:
    token = mint_token(keys[0], subject="alice", extra_claims={"exp": int(time.time()) - 2})
    assert verifier.verify(_bearer(token)).subject == "alice"


def test_missing_exp_is_refused(keys: tuple[bytes, Path], verifier: JwtVerifier) -> None:
    claims = {"sub": "alice", "iss": "thermocline-dev", "aud": "thermocline"}
    token = jwt.encode(claims, keys[0], algorithm="RS256")
    with pytest.raises(Unauthenticated, match="'exp'"):
        verifier.verify(_bearer(token))


def test_alg_none_is_refused(verifier: JwtVerifier) -> None:
    claims = {"sub": "alice", "iss": "thermocline-dev", "aud": "thermocline", "exp": int(time.time()) + 60}
    token = f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(claims)}."
    with pytest.raises(Unauthenticated, match="alg 'none'"):
        verifier.verify(_bearer(token))


def test_hs256_signed_with_the_public_key_is_refused(keys: tuple[bytes, Path], verifier: JwtVerifier) -> None:
    claims = {"sub": "alice", "iss": "thermocline-dev", "aud": "thermocline", "exp": int(time.time()) + 60}
    header = _b64({"alg": "HS256", "typ": "JWT"})
    payload = _b64(claims)
    signature = hmac.new(keys[1].read_bytes(), f"{header}.{payload}".encode(), hashlib.sha256).digest()
    token = f"{header}.{payload}.{base64.urlsafe_b64encode(signature).rstrip(b'=').decode()}"
    with pytest.raises(Unauthenticated, match="algorithm 'HS256' refused"):
        verifier.verify(_bearer(token))


def test_a_token_from_another_key_is_refused(
    tmp_path: Path, keys: tuple[bytes, Path], verifier: JwtVerifier
) -> None:
    other_private, _ = ensure_dev_keys(tmp_path)
    our_kid = key_id(keys[0], "RS256")
    with pytest.raises(Unauthenticated, match="signature does not verify"):
        verifier.verify(_bearer(mint_token(other_private.read_bytes(), subject="mallory", kid=our_kid)))
    with pytest.raises(Unauthenticated, match="unknown signing key"):
        verifier.verify(_bearer(mint_token(other_private.read_bytes(), subject="mallory")))


def test_jku_header_is_refused_and_not_followed(keys: tuple[bytes, Path], verifier: JwtVerifier) -> None:
    claims = {"sub": "alice", "iss": "thermocline-dev", "aud": "thermocline", "exp": int(time.time()) + 60}
    token = jwt.encode(claims, keys[0], algorithm="RS256", headers={"jku": "http://127.0.0.1:1/keys"})
    with pytest.raises(Unauthenticated, match="remote or embedded key"):
        verifier.verify(_bearer(token))


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer ", "Bearer not-a-jwt"])
def test_missing_or_malformed_credentials(verifier: JwtVerifier, header: str | None) -> None:
    with pytest.raises(Unauthenticated):
        verifier.verify(header)


def test_short_hs256_secret_is_refused_at_start(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("too-short")
    with pytest.raises(ValueError, match="at least 32"):
        JwtVerifier(JwtConfig(key_file=secret, algorithm="HS256"))


def _es256_pem(directory: Path) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private, public


def test_jwks_rotation_adds_and_retires_keys(tmp_path: Path, keys: tuple[bytes, Path]) -> None:
    old_private, old_public = keys[0], keys[1].read_bytes()
    new_private, new_public = ensure_dev_keys(tmp_path / "new")
    jwks = tmp_path / "jwks.json"
    write_jwks([old_public], jwks)
    verifier = JwtVerifier(JwtConfig(key_file=jwks))
    new_token = _bearer(mint_token(new_private.read_bytes(), subject="bob"))
    with pytest.raises(Unauthenticated, match="unknown signing key"):
        verifier.verify(new_token)
    write_jwks([old_public, new_public.read_bytes()], jwks)  # rotation, step 1: publish the new key
    assert verifier.verify(new_token).subject == "bob"
    assert verifier.verify(_bearer(mint_token(old_private, subject="alice"))).subject == "alice"
    write_jwks([new_public.read_bytes()], jwks)  # step 2: retire the old key
    with pytest.raises(Unauthenticated, match="unknown signing key"):
        verifier.verify(_bearer(mint_token(old_private, subject="alice")))
    jwks.write_text("{ not json")  # a broken edit keeps the keys in force
    assert verifier.verify(new_token).subject == "bob"


def test_algorithms_are_pinned_per_key(tmp_path: Path, keys: tuple[bytes, Path]) -> None:
    es_private, es_public = _es256_pem(tmp_path)
    jwks = tmp_path / "jwks.json"
    document = {"keys": [*write_jwks([keys[1].read_bytes()], jwks)["keys"]]}  # type: ignore[misc]
    from services.gateway.jwks import public_jwk

    document["keys"].append(public_jwk(es_public, "ES256"))
    jwks.write_text(json.dumps(document))
    verifier = JwtVerifier(JwtConfig(key_file=jwks))
    es_kid = key_id(es_private, "ES256")
    assert verifier.verify(_bearer(mint_token(es_private, subject="eve", algorithm="ES256"))).subject == "eve"
    # an RS256 token that names the ES256 key's kid is refused before any signature check
    with pytest.raises(Unauthenticated, match="pinned to ES256"):
        verifier.verify(_bearer(mint_token(keys[0], subject="eve", kid=es_kid)))


def test_jwks_entries_must_pin_an_algorithm(tmp_path: Path, keys: tuple[bytes, Path]) -> None:
    jwks = tmp_path / "jwks.json"
    document = write_jwks([keys[1].read_bytes()], jwks)
    del document["keys"][0]["alg"]  # type: ignore[index]
    jwks.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="'alg' must be one of"):
        JwtVerifier(JwtConfig(key_file=jwks))


def test_wrong_or_missing_typ_is_refused(keys: tuple[bytes, Path], verifier: JwtVerifier) -> None:
    with pytest.raises(Unauthenticated, match="typ 'at\\+jwt' refused"):
        verifier.verify(_bearer(mint_token(keys[0], subject="alice", headers={"typ": "at+jwt"})))
    untyped = mint_token(keys[0], subject="alice", headers={"typ": None})
    assert "typ" not in jwt.get_unverified_header(untyped)
    with pytest.raises(Unauthenticated, match="typ None refused"):
        verifier.verify(_bearer(untyped))


def _forged(keys: tuple[bytes, Path], header: dict[str, object], claims: dict[str, object]) -> str:
    """A token signed with our key whose header holds whatever the test says (PyJWT would refuse to)."""
    signing_input = f"{_b64({'alg': 'RS256', **header})}.{_b64(claims)}"
    codec = RSAAlgorithm(RSAAlgorithm.SHA256)
    signature = codec.sign(signing_input.encode(), codec.prepare_key(keys[0]))
    return f"{signing_input}.{base64.urlsafe_b64encode(signature).rstrip(b'=').decode()}"


def _claims(**overrides: object) -> dict[str, object]:
    claims: dict[str, object] = {
        "sub": "alice",
        "iss": "thermocline-dev",
        "aud": "thermocline",
        "exp": int(time.time()) + 60,
    }
    claims.update(overrides)
    return {name: value for name, value in claims.items() if value is not None}


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ({"crit": ["x-unknown"], "x-unknown": 1}, "Unsupported critical extension"),
        ({"crit": "b64"}, "must be a non-empty list"),
        ({"kid": None}, "Key ID header parameter must be a string"),
        ({"kid": 7}, "Key ID header parameter must be a string"),
    ],
)
def test_malformed_headers_are_unauthenticated_with_a_reason(
    keys: tuple[bytes, Path], verifier: JwtVerifier, header: dict[str, object], reason: str
) -> None:
    token = _forged(keys, {"typ": "JWT", "kid": key_id(keys[0], "RS256"), **header}, _claims())
    with pytest.raises(Unauthenticated, match=f"malformed token header: .*{reason}"):
        verifier.verify(_bearer(token))


@pytest.mark.parametrize("claim", ["exp", "nbf", "iat"])
def test_dates_must_be_json_numbers(keys: tuple[bytes, Path], verifier: JwtVerifier, claim: str) -> None:
    as_text = str(int(time.time()) + (60 if claim == "exp" else -60))
    token = mint_token(keys[0], subject="alice", extra_claims={claim: as_text})
    with pytest.raises(Unauthenticated, match=f"'{claim}' must be a JSON number"):
        verifier.verify(_bearer(token))


def test_a_token_without_sub_is_refused(keys: tuple[bytes, Path], verifier: JwtVerifier) -> None:
    token = jwt.encode(
        _claims(sub=None), keys[0], algorithm="RS256", headers={"kid": key_id(keys[0], "RS256")}
    )
    with pytest.raises(Unauthenticated, match="lacks the required 'sub' claim"):
        verifier.verify(_bearer(token))


@pytest.mark.parametrize("subject", ["", "a" * 257, "alice\nbob"])
def test_an_empty_long_or_unprintable_sub_is_refused(
    keys: tuple[bytes, Path], verifier: JwtVerifier, subject: str
) -> None:
    with pytest.raises(Unauthenticated, match="'sub'"):
        verifier.verify(_bearer(mint_token(keys[0], subject=subject, tenant="acme")))


def test_an_oversize_token_is_refused_and_the_limit_stated(
    keys: tuple[bytes, Path], verifier: JwtVerifier
) -> None:
    token = mint_token(keys[0], subject="alice", extra_claims={"pad": "x" * 13_000})
    assert len(token) > 16 * 1024
    with pytest.raises(Unauthenticated, match=f"token is {len(token)} characters, longer than the 16384"):
        verifier.verify(_bearer(token))


@pytest.mark.parametrize(
    ("claim", "says", "not_says"),
    [("iat", "issued in the future (iat", "nbf"), ("nbf", "not valid yet (nbf", "iat")],
)
def test_a_date_in_the_future_is_refused_naming_that_claim(
    keys: tuple[bytes, Path], verifier: JwtVerifier, claim: str, says: str, not_says: str
) -> None:
    # mint_token sets both iat and nbf to now; only `claim` moves past the 5 s leeway
    token = mint_token(keys[0], subject="alice", extra_claims={claim: int(time.time()) + 600})
    with pytest.raises(Unauthenticated) as refused:
        verifier.verify(_bearer(token))
    assert says in refused.value.message and not_says not in refused.value.message


@pytest.mark.parametrize("claim", ["exp", "nbf", "iat"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_dates_must_be_finite(
    keys: tuple[bytes, Path], verifier: JwtVerifier, claim: str, value: float
) -> None:
    # JSON has no such numbers, but Python's reader takes NaN and Infinity; no clock compares with them
    token = _forged(keys, {"typ": "JWT", "kid": key_id(keys[0], "RS256")}, _claims(**{claim: value}))
    with pytest.raises(Unauthenticated, match=f"'{claim}' must be a finite JSON number"):
        verifier.verify(_bearer(token))


def _forged_text(keys: tuple[bytes, Path], header: str, payload: str) -> str:
    """A token signed with our key over header and payload JSON exactly as written (repeated keys)."""
    encode = lambda text: base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()  # noqa: E731
    signing_input = f"{encode(header)}.{encode(payload)}"
    codec = RSAAlgorithm(RSAAlgorithm.SHA256)
    signature = codec.sign(signing_input.encode(), codec.prepare_key(keys[0]))
    return f"{signing_input}.{base64.urlsafe_b64encode(signature).rstrip(b'=').decode()}"


@pytest.mark.parametrize("exp", [1e300, 10**30], ids=["1e300", "10**30"])
def test_a_token_that_never_expires_is_refused_naming_exp(
    keys: tuple[bytes, Path], verifier: JwtVerifier, exp: float
) -> None:
    token = _forged(keys, {"typ": "JWT", "kid": key_id(keys[0], "RS256")}, _claims(exp=exp))
    with pytest.raises(Unauthenticated, match=r"token's 'exp' is .* the gateway's limit of 86400 s"):
        verifier.verify(_bearer(token))


def test_the_lifetime_counts_from_now_without_iat_and_from_iat_with_it(
    keys: tuple[bytes, Path], verifier: JwtVerifier
) -> None:
    kid, now, hour = key_id(keys[0], "RS256"), int(time.time()), 3600
    within = _forged(keys, {"typ": "JWT", "kid": kid}, _claims(exp=now + 23 * hour))
    assert verifier.verify(_bearer(within)).subject == "alice"
    beyond = _forged(keys, {"typ": "JWT", "kid": kid}, _claims(exp=now + 25 * hour))
    # the verifier reads the clock after this test did: a second may have ticked between
    with pytest.raises(Unauthenticated, match=r"'exp' is (89999|90000) s from now"):
        verifier.verify(_bearer(beyond))
    # 5 h left, but minted for 25 h: a token refused when new stays refused
    old = _forged(keys, {"typ": "JWT", "kid": kid}, _claims(iat=now - 20 * hour, exp=now + 5 * hour))
    with pytest.raises(Unauthenticated, match="'exp' is 90000 s after its 'iat'"):
        verifier.verify(_bearer(old))


def test_the_maximum_lifetime_is_a_setting(keys: tuple[bytes, Path]) -> None:
    strict = JwtVerifier(JwtConfig(key_file=keys[1], max_lifetime_s=600))
    with pytest.raises(Unauthenticated, match=r"limit of 600 s .*THERMOCLINE_GATEWAY_JWT_MAX_LIFETIME_S"):
        strict.verify(_bearer(mint_token(keys[0], subject="alice", ttl_s=3600)))
    assert strict.verify(_bearer(mint_token(keys[0], subject="alice", ttl_s=300))).subject == "alice"
    with pytest.raises(ValueError, match="THERMOCLINE_GATEWAY_JWT_MAX_LIFETIME_S must lie in"):
        JwtConfig(key_file=keys[1], max_lifetime_s=0)


@pytest.mark.parametrize(
    ("part", "repeated"),
    [
        ("payload", "tenant"),  # a proxy reading the first copy sees tenant 'dev'
        ("payload", "sub"),
        ("header", "kid"),
        ("header", "alg"),
    ],
)
def test_a_repeated_key_in_the_header_or_payload_is_refused(
    keys: tuple[bytes, Path], verifier: JwtVerifier, part: str, repeated: str
) -> None:
    kid, exp = key_id(keys[0], "RS256"), int(time.time()) + 60
    header = f'{{"alg": "RS256", "typ": "JWT", "kid": "{kid}"}}'
    payload = (
        f'{{"sub": "alice", "tenant": "dev", "iss": "thermocline-dev", "aud": "thermocline", "exp": {exp}}}'
    )
    copies = {"tenant": '"victim"', "sub": '"mallory"', "kid": f'"{kid}"', "alg": '"RS256"'}
    if part == "header":
        header = header[:-1] + f', "{repeated}": {copies[repeated]}}}'
    else:
        payload = payload[:-1] + f', "{repeated}": {copies[repeated]}}}'
    with pytest.raises(Unauthenticated, match=f"token {part} repeats the key '{repeated}'"):
        verifier.verify(_bearer(_forged_text(keys, header, payload)))
