"""Role-based access control: roles grant operations on models; claims in the token pick roles.

Deny by default: a caller holds exactly the permissions of the roles its claims map to (and the
roles those inherit), and nothing else. The policy file format (JSON) is documented, with an
example, in deploy/gateway/policy.json and deploy/gateway/README.md.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import PermissionDenied
from services.gateway.config import load_policy_file

OPERATIONS = ("invoke", "list_models", "read_audit", "admin")


@dataclass(frozen=True)
class Role:
    """A named role: model patterns → operations, plus the roles it inherits."""

    name: str
    grants: tuple[tuple[str, frozenset[str]], ...]
    inherits: tuple[str, ...] = ()

    def allows(self, operation: str, model: str) -> bool:
        """Whether this role itself (not its parents) grants `operation` on `model`."""
        return any(
            operation in operations and fnmatch.fnmatchcase(model, pattern)
            for pattern, operations in self.grants
        )


@dataclass(frozen=True)
class Binding:
    """Callers whose `claim` holds `value` (a string, or one entry of a list) get `roles`."""

    claim: str
    value: str
    roles: tuple[str, ...]

    def matches(self, claims: Mapping[str, Any]) -> bool:
        """Whether the token's claims satisfy this binding ("*" matches any present value)."""
        held = claims.get(self.claim)
        values = held if isinstance(held, list) else [held] if held is not None else []
        return any(self.value == "*" or str(v) == self.value for v in values)


def _parse_role(name: str, entry: Mapping[str, Any]) -> Role:
    grants = []
    for pattern, operations in dict(entry.get("grants", {})).items():
        unknown = set(operations) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"role {name!r}: unknown operation(s) {sorted(unknown)}; known: {OPERATIONS}")
        grants.append((str(pattern), frozenset(operations)))
    return Role(name=name, grants=tuple(grants), inherits=tuple(entry.get("inherits", ())))


def _parse_binding(entry: Mapping[str, Any]) -> Binding:
    return Binding(claim=str(entry["claim"]), value=str(entry["value"]), roles=tuple(entry["roles"]))


@dataclass(frozen=True)
class Policy:
    """The whole RBAC policy: roles, claim bindings, and roles every verified caller holds."""

    roles: Mapping[str, Role]
    bindings: tuple[Binding, ...] = ()
    role_claim: str | None = None

    def __post_init__(self) -> None:
        named = [r for role in self.roles.values() for r in role.inherits]
        named += [r for binding in self.bindings for r in binding.roles]
        missing = sorted(set(named) - set(self.roles))
        if missing:
            raise ValueError(f"policy names undefined role(s) {missing}")
        for name in self.roles:
            self.closure([name])  # raises on an inheritance cycle

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> Policy:
        """A policy from its parsed JSON."""
        roles = {name: _parse_role(name, entry) for name, entry in dict(document["roles"]).items()}
        bindings = tuple(_parse_binding(entry) for entry in document.get("bindings", ()))
        return cls(roles=roles, bindings=bindings, role_claim=document.get("role_claim"))

    @classmethod
    def load(cls, path: Path) -> Policy:
        """Reads and validates a policy file."""
        return load_policy_file(path, "RBAC policy", cls.from_dict)

    def closure(self, names: Iterable[str]) -> list[str]:
        """`names` and every role they inherit, each once, parents after children."""
        seen: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in path:
                raise ValueError(f"role inheritance cycle: {' -> '.join((*path, name))}")
            if name not in seen:
                seen.append(name)
            for parent in self.roles[name].inherits:
                visit(parent, (*path, name))

        for name in names:
            visit(name, ())
        return seen

    def roles_of(self, claims: Mapping[str, Any]) -> list[str]:
        """The roles a token's claims grant, inherited ones included."""
        direct = [r for binding in self.bindings if binding.matches(claims) for r in binding.roles]
        if self.role_claim:
            held = claims.get(self.role_claim)
            values = held if isinstance(held, list) else [held]
            direct += [str(v) for v in values if str(v) in self.roles]
        return self.closure(direct)

    def is_allowed(self, roles: Iterable[str], operation: str, model: str) -> bool:
        """Whether any of `roles` (already closed over inheritance) grants `operation` on `model`."""
        return any(self.roles[name].allows(operation, model) for name in roles)

    def authorize(self, subject: str, roles: list[str], operation: str, model: str) -> None:
        """Raises PermissionDenied naming the missing permission unless it is granted."""
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}")
        if self.is_allowed(roles, operation, model):
            return
        held = ", ".join(roles) if roles else "none"
        raise PermissionDenied(
            f"permission '{operation}' on model '{model}' is missing: caller {subject!r} holds "
            f"roles [{held}]; ask an administrator for a role that grants it"
        )


DEVELOPMENT_POLICY: dict[str, Any] = {
    "roles": {
        "reader": {"grants": {"*": ["list_models"]}},
        "user": {"inherits": ["reader"], "grants": {"*": ["invoke"]}},
        "auditor": {"grants": {"*": ["read_audit"]}},
        "admin": {"inherits": ["user", "auditor"], "grants": {"*": ["admin"]}},
    },
    "role_claim": "roles",
    "bindings": [{"claim": "sub", "value": "*", "roles": ["user"]}],
}
