"""Helpers for the gateway's integration tests: policy files, tokens, calls through a real gateway."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc

from services.cli.client import StreamResult, build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_PROMPT


def write_policy_files(directory: Path, tenants: dict[str, Any] | None = None) -> dict[str, str]:
    """RBAC, intents and tenant files for a test mesh; returns the gateway env that names them."""
    directory.mkdir(parents=True, exist_ok=True)
    policy = {
        "roles": {
            "reader": {"grants": {"*": ["list_models"]}},
            "user": {"inherits": ["reader"], "grants": {"*": ["invoke"]}},
            "admin": {"inherits": ["user"], "grants": {"*": ["admin", "read_audit"]}},
        },
        "role_claim": "roles",
        "bindings": [{"claim": "groups", "value": "ml-platform", "roles": ["admin"]}],
    }
    intents = {
        "default_intent": None,
        "intents": {
            "chat": {"priority_class": "interactive"},
            "code-completion": {"priority_class": "interactive"},
            "batch": {"priority_class": "batch"},
        },
    }
    files = {"POLICY_FILE": policy, "INTENTS_FILE": intents, "TENANTS_FILE": tenants or {}}
    env = {}
    for name, document in files.items():
        path = directory / f"{name.lower()}.json"
        path.write_text(json.dumps(document))
        env[f"THERMOCLINE_GATEWAY_{name}"] = str(path)
    return env


def token(mesh: Mesh, subject: str = "tester", tenant: str = "acme", **claims: object) -> str:
    """A token from the mesh's development key."""
    return mint_token(mesh.private_key_path.read_bytes(), subject=subject, tenant=tenant, extra_claims=claims)


def call(
    target: str,
    bearer: str | None,
    *,
    intent: str | None = None,
    max_tokens: int = 2,
    prompt: str = STORIES_PROMPT,
    extra_metadata: list[tuple[str, str]] | None = None,
) -> StreamResult:
    """One Generate through the gateway at `target`, read to its end."""
    metadata = call_metadata(bearer, intent) + (extra_metadata or [])
    with grpc.insecure_channel(target) as channel:
        return collect(stream_generate(channel, build_request(prompt, max_tokens=max_tokens), metadata, 60))


def refusal(target: str, bearer: str | None, **kwargs: Any) -> grpc.RpcError:
    """The error of a call that must fail."""
    try:
        call(target, bearer, **kwargs)
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call was expected to fail, and it succeeded")
