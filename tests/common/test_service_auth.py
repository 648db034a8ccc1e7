"""The service token's file, the start-up rule for listeners without one, and its redaction
(services/common/service_auth.py); the refusals themselves are tested against real processes in
tests/kvstore/test_service_auth.py and tests/engine/serving/test_service_auth.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ServerConfig
from services.common.redaction import redact
from services.common.service_auth import (
    METADATA_KEY,
    TOKEN_FILE_SETTING,
    ServiceAuthError,
    ensure_token_file,
    is_loopback,
    read_token,
)


def test_a_made_token_reads_back_and_is_private(tmp_path: Path) -> None:
    path = ensure_token_file(tmp_path / "keys" / "service.token")
    assert path.stat().st_mode & 0o777 == 0o600
    token = read_token(path)
    assert len(token.value) == 64 and token.matches(token.value) and not token.matches(token.value[:-1] + "x")
    assert token.value not in repr(token)


@pytest.mark.parametrize("content", ["short", "x" * 40 + " " + "y" * 10, "é" * 40])
def test_a_weak_or_unsendable_token_is_refused_naming_the_setting(tmp_path: Path, content: str) -> None:
    path = tmp_path / "service.token"
    path.write_text(content)
    with pytest.raises(ServiceAuthError, match=TOKEN_FILE_SETTING):
        read_token(path)


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ServiceAuthError, match=r"absent\.token"):
        read_token(tmp_path / "absent.token")


HOSTS = [
    ("127.0.0.1", True),
    ("::1", True),
    ("localhost", True),
    ("0.0.0.0", False),
    ("[::]", False),
    ("engine", False),
]


@pytest.mark.parametrize(("host", "loopback"), HOSTS)
def test_loopback_is_told_from_the_rest(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_an_internal_service_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    beyond = {"THERMOCLINE_KVSTORE_HOST": "0.0.0.0"}
    with pytest.raises(ServiceAuthError, match=TOKEN_FILE_SETTING):
        ServerConfig.from_env("kvstore", 50054, beyond)
    assert ServerConfig.from_env("gateway", 50051, {"THERMOCLINE_GATEWAY_HOST": "0.0.0.0"}, is_public=True)
    assert ServerConfig.from_env("kvstore", 50054, {}).service_token is None  # loopback: allowed
    token_file = str(ensure_token_file(tmp_path / "service.token"))
    config = ServerConfig.from_env("kvstore", 50054, beyond | {TOKEN_FILE_SETTING: token_file})
    assert config.service_token is not None and config.service_token.path == Path(token_file)


def test_the_token_never_reaches_a_log_line(tmp_path: Path) -> None:
    token = read_token(ensure_token_file(tmp_path / "service.token"))  # reading it registers it
    for line in (f"metadata {((METADATA_KEY, token.value),)}", f"raw bytes b'{token.value}'"):
        assert token.value not in redact(line)
    assert "[credential redacted]" in redact(f"{METADATA_KEY}: not-the-token-but-sent-as-one")
