"""RFC 8725 through a real gateway process: every bad token is UNAUTHENTICATED with its reason."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import grpc
import jwt
import pytest
from jwt.algorithms import RSAAlgorithm

from services.cli.client import build_request, call_metadata
from services.cli.mesh import Mesh
from services.common.redaction import redact
from services.gateway.audit_chain import segment_paths
from services.gateway.tokens import key_id, mint_token
from tests.conftest import STORIES_PROMPT
from tests.gateway.conftest import call, logs_with_a_credential, raw_grpc_call, refusal, send, token

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _claims(**overrides: object) -> dict[str, object]:
    claims: dict[str, object] = {
        "sub": "tester",
        "tenant": "acme",
        "iss": "thermocline-dev",
        "aud": "thermocline",
        "exp": int(time.time()) + 600,
    }
    for name, value in overrides.items():
        if value is None:
            claims.pop(name, None)
        else:
            claims[name] = value
    return claims


def _signed(mesh: Mesh, claims: dict[str, object], **header: object) -> str:
    private = mesh.private_key_path.read_bytes()
    headers = {"typ": "JWT", "kid": key_id(private, "RS256"), **header}
    return jwt.encode(claims, private, algorithm="RS256", headers=headers)


def _expect(mesh: Mesh, bearer: str, reason: str) -> None:
    error = refusal(mesh.target("gateway"), bearer)
    assert error.code() == UNAUTHENTICATED, error.details()
    assert reason in error.details()


def test_a_good_token_passes(stories_mesh: Mesh) -> None:
    assert call(stories_mesh.target("gateway"), token(stories_mesh)).done is not None


def test_alg_none_is_refused(stories_mesh: Mesh) -> None:
    header = _b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    unsigned = f"{header}.{_b64(json.dumps(_claims()).encode())}."
    _expect(stories_mesh, unsigned, "alg 'none'")


def test_hs256_signed_with_our_rsa_public_key_is_refused(stories_mesh: Mesh) -> None:
    public_pem = stories_mesh.public_key_path.read_bytes()
    kid = key_id(stories_mesh.private_key_path.read_bytes(), "RS256")
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    payload = _b64(json.dumps(_claims()).encode())
    signature = hmac.new(public_pem, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    _expect(stories_mesh, f"{header}.{payload}.{_b64(signature)}", "pinned to RS256")


@pytest.mark.parametrize("claim", ["exp", "iss", "aud", "sub"])
def test_a_missing_required_claim_is_refused(stories_mesh: Mesh, claim: str) -> None:
    _expect(stories_mesh, _signed(stories_mesh, _claims(**{claim: None})), f"'{claim}'")


@pytest.mark.parametrize(
    ("claim", "value", "reason"),
    [("aud", "another-service", "audience is wrong"), ("iss", "https://evil.example", "issuer is wrong")],
)
def test_a_wrong_audience_or_issuer_is_refused(
    stories_mesh: Mesh, claim: str, value: str, reason: str
) -> None:
    _expect(stories_mesh, _signed(stories_mesh, _claims(**{claim: value})), reason)


def test_a_wrong_typ_is_refused(stories_mesh: Mesh) -> None:
    _expect(stories_mesh, _signed(stories_mesh, _claims(), typ="secevent+jwt"), "typ 'secevent+jwt' refused")


def test_expiry_is_refused_beyond_the_leeway_and_accepted_within_it(stories_mesh: Mesh) -> None:
    # the mesh runs the default 30 s leeway
    _expect(stories_mesh, _signed(stories_mesh, _claims(exp=int(time.time()) - 120)), "expired")
    within = _signed(stories_mesh, _claims(exp=int(time.time()) - 5))
    assert call(stories_mesh.target("gateway"), within).done is not None


def test_nbf_in_the_future_is_refused(stories_mesh: Mesh) -> None:
    _expect(stories_mesh, _signed(stories_mesh, _claims(nbf=int(time.time()) + 600)), "not valid yet")


def test_iat_in_the_future_is_refused_naming_iat_not_nbf(stories_mesh: Mesh) -> None:
    # the mesh runs the default 30 s leeway; the token has no nbf
    error = refusal(
        stories_mesh.target("gateway"), _signed(stories_mesh, _claims(iat=int(time.time()) + 600))
    )
    assert error.code() == UNAUTHENTICATED
    assert "issued in the future (iat" in error.details() and "nbf" not in error.details()


@pytest.mark.parametrize(
    "kid",
    [
        "no-such-key",
        "../../../../../../dev/null",
        "/proc/self/environ",
        "' OR '1'='1' --",
        "x'; DROP TABLE keys; --",
    ],
)
def test_unknown_or_hostile_kids_are_refused(stories_mesh: Mesh, kid: str) -> None:
    # With an empty HS256 secret a kid that was read as a path to /dev/null would verify.
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    payload = _b64(json.dumps(_claims()).encode())
    signature = hmac.new(b"", f"{header}.{payload}".encode(), hashlib.sha256).digest()
    forged = f"{header}.{payload}.{_b64(signature)}"
    _expect(stories_mesh, forged, "unknown signing key")
    signed = _signed(stories_mesh, _claims(), kid=kid)
    _expect(stories_mesh, signed, "unknown signing key")


class _Recorder(BaseHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        _Recorder.requests.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"keys": []}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def key_server() -> Iterator[str]:
    _Recorder.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/jwks.json"
    server.shutdown()


@pytest.mark.parametrize("header", ["jku", "x5u"])
def test_remote_key_headers_are_refused_and_never_fetched(
    stories_mesh: Mesh, key_server: str, header: str
) -> None:
    _expect(stories_mesh, _signed(stories_mesh, _claims(), **{header: key_server}), "never fetched")
    assert _Recorder.requests == []


def test_an_embedded_jwk_is_refused(stories_mesh: Mesh) -> None:
    embedded = {"kty": "oct", "k": _b64(b"k" * 32)}
    forged = jwt.encode(_claims(), b"k" * 32, algorithm="HS256", headers={"typ": "JWT", "jwk": embedded})
    _expect(stories_mesh, forged, "remote or embedded key")


def _forged(mesh: Mesh, header: dict[str, object]) -> str:
    """A token signed with the mesh's key whose header holds what PyJWT would refuse to write."""
    private = mesh.private_key_path.read_bytes()
    full = {"alg": "RS256", "typ": "JWT", "kid": key_id(private, "RS256"), **header}
    signing_input = f"{_b64(json.dumps(full).encode())}.{_b64(json.dumps(_claims()).encode())}"
    codec = RSAAlgorithm(RSAAlgorithm.SHA256)
    return f"{signing_input}.{_b64(codec.sign(signing_input.encode(), codec.prepare_key(private)))}"


@pytest.mark.parametrize(
    "header", [{"crit": ["x-unknown"], "x-unknown": 1}, {"crit": "b64"}, {"kid": None}, {"kid": 7}]
)
def test_a_malformed_header_is_unauthenticated_and_audited(
    stories_mesh: Mesh, header: dict[str, object]
) -> None:
    request_id = f"bad-header-{uuid.uuid4().hex[:8]}"
    metadata = [*call_metadata(_forged(stories_mesh, header)), ("x-request-id", request_id)]
    error = send(stories_mesh.target("gateway"), build_request(STORIES_PROMPT, max_tokens=1), metadata)
    assert error is not None and error.code() == UNAUTHENTICATED, error
    assert "malformed token header" in error.details()
    events = [
        json.loads(line)
        for path in segment_paths(stories_mesh.audit_dir, "decisions")
        for line in path.read_text().splitlines()
        if request_id in line
    ]
    assert [(e["decision"], e["reason"]) for e in events] == [("deny", error.details())]


@pytest.mark.parametrize("exp", [10**30, 1e300, int(time.time()) + 25 * 3600], ids=["10**30", "1e300", "25h"])
def test_a_token_valid_for_longer_than_a_day_is_refused_naming_exp(stories_mesh: Mesh, exp: float) -> None:
    # the mesh runs the default THERMOCLINE_GATEWAY_JWT_MAX_LIFETIME_S of 24 h
    _expect(stories_mesh, _signed(stories_mesh, _claims(exp=exp)), "token's 'exp' is")


def test_a_payload_that_names_its_tenant_twice_is_refused(stories_mesh: Mesh) -> None:
    private = stories_mesh.private_key_path.read_bytes()
    header = {"alg": "RS256", "typ": "JWT", "kid": key_id(private, "RS256")}
    payload = json.dumps(_claims(tenant="acme"))[:-1] + ', "tenant": "victim"}'
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(payload.encode())}"
    codec = RSAAlgorithm(RSAAlgorithm.SHA256)
    token = f"{signing_input}.{_b64(codec.sign(signing_input.encode(), codec.prepare_key(private)))}"
    _expect(stories_mesh, token, "token payload repeats the key 'tenant'")


@pytest.mark.parametrize("tenant", ["acme\n", 123, "", "a" * 129, "acme/../x"])
def test_an_invalid_tenant_claim_is_refused(stories_mesh: Mesh, tenant: object) -> None:
    _expect(stories_mesh, _signed(stories_mesh, _claims(tenant=tenant)), "tenant' claim")


@pytest.mark.parametrize("tenant", ["default", "thermocline-warm-up"])
def test_a_tenant_claim_that_names_the_engines_own_cache_salt_is_refused(
    stories_mesh: Mesh, tenant: str
) -> None:
    _expect(
        stories_mesh, _signed(stories_mesh, _claims(tenant=tenant)), f"'tenant' claim '{tenant}' is a name"
    )


def _token_of_length(mesh: Mesh, length: int) -> str:
    """A valid token padded with a filler claim to exactly `length` characters."""
    pad = length - len(_signed(mesh, _claims(pad="")))
    for extra in range(pad * 3 // 4 - 8, pad * 3 // 4 + 8):
        bearer = _signed(mesh, _claims(pad="x" * extra))
        if len(bearer) == length:
            return bearer
    raise AssertionError(f"no padding gives a token of {length} characters")


def test_tokens_up_to_16_kib_always_pass_and_longer_ones_are_refused_with_the_limit(
    stories_mesh: Mesh,
) -> None:
    longest = _token_of_length(stories_mesh, 16 * 1024)
    for _ in range(10):  # between gRPC's soft and hard metadata limits, calls were refused at random
        assert call(stories_mesh.target("gateway"), longest, max_tokens=1).done is not None
    too_long = _token_of_length(stories_mesh, 16 * 1024 + 1)
    _expect(stories_mesh, too_long, "token is 16385 characters, longer than the 16384 allowed")


def test_no_log_line_carries_a_credential(stories_mesh: Mesh) -> None:
    secret = token(stories_mesh, subject="leaky")
    # a value that is not UTF-8 made grpc log the whole entry, token included, at ERROR
    headers = [(b"authorization", b"Bearer " + secret.encode() + b"\xff")]
    request = build_request(STORIES_PROMPT, max_tokens=1).SerializeToString()
    raw_grpc_call(
        stories_mesh.target("gateway"), "/thermocline.gateway.v1.GatewayService/Generate", headers, request
    )
    call(stories_mesh.target("gateway"), secret, max_tokens=1)
    # every log the shared mesh has written so far: this test's calls and every earlier test's
    logs = {path.name: path.read_text(errors="replace") for path in stories_mesh.logs_dir.glob("*.log")}
    assert "Invalid encoding" in logs["gateway.log"]  # grpc did log the entry, redacted
    for name, text in logs.items():
        assert secret.split(".")[2] not in text, f"{name} holds the token's signature"
        assert not re.search(r"eyJ[A-Za-z0-9_-]{8,}\.eyJ", text), f"{name} holds a JWT"


def test_the_run_wide_log_check_finds_a_token_and_passes_a_redacted_one() -> None:
    leaked = mint_token("s" * 32, subject="leaky", algorithm="HS256")
    # outside the session's temporary directory: the run-wide check would rightly fail on it there
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "mesh-a" / "logs").mkdir(parents=True)
        (root / "mesh-a" / "logs" / "gateway.log").write_text(f"refused: Bearer {redact(leaked)}\n")
        (root / "mesh-b").mkdir()
        (root / "mesh-b" / "engine.log").write_text(f"metadata ('authorization', '{leaked}')\n")
        assert logs_with_a_credential(root) == ["mesh-b/engine.log"]
