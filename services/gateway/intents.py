"""The intent policy: which `x-intent` values exist, the default, and each one's priority class.

An intent says what a request is for (`code-completion`, `medical-diagnosis`); the engine
schedules by priority class. The mapping is tenant-aware: a tenant's own table (see tenants.py)
overrides the intent's class. An intent may name the `roles` that may declare it: a high-priority
intent is otherwise any caller's to claim. The file format (JSON) is in deploy/gateway/intents.json.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgument, PermissionDenied
from services.gateway.config import load_policy_file

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class IntentPolicy:
    """Known intents → engine priority class; `default_intent` None makes `x-intent` required;
    `roles`: intents that only callers holding one of the listed roles may declare."""

    priority_classes: Mapping[str, str]
    default_intent: str | None = "default"
    roles: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.priority_classes:
            raise ValueError("the intent policy must name at least one intent")
        bad = [name for name in self.priority_classes if not _NAME.match(name)]
        if bad:
            raise ValueError(f"intent names must be lower-case [a-z0-9._-], at most 64 chars: {bad}")
        if self.default_intent is not None and self.default_intent not in self.priority_classes:
            raise ValueError(f"default intent {self.default_intent!r} is not among the known intents")
        if self.default_intent in self.roles:
            raise ValueError(f"default intent {self.default_intent!r} may not be limited to roles")

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> IntentPolicy:
        """A policy from its parsed JSON."""
        intents = dict(document["intents"])
        classes = {name: str(entry.get("priority_class", name)) for name, entry in intents.items()}
        roles = {}
        for name, entry in intents.items():
            if "roles" in entry:
                listed = entry["roles"]
                if not isinstance(listed, list) or not listed or not all(isinstance(r, str) for r in listed):
                    raise ValueError(f"intent {name!r}: 'roles' must be a non-empty list of role names")
                roles[name] = frozenset(listed)
        return cls(priority_classes=classes, default_intent=document.get("default_intent"), roles=roles)

    @classmethod
    def load(cls, path: Path) -> IntentPolicy:
        """Reads and validates an intents file."""
        return load_policy_file(path, "intent policy", cls.from_dict)

    @property
    def known(self) -> list[str]:
        """The known intents, sorted."""
        return sorted(self.priority_classes)

    def resolve(self, requested: str | None, caller_roles: Iterable[str] = ()) -> str:
        """The intent of a call; INVALID_ARGUMENT when it is missing without default, or unknown;
        PERMISSION_DENIED when the intent is limited to roles the caller holds none of."""
        if not requested:
            if self.default_intent is None:
                raise InvalidArgument(
                    f"metadata 'x-intent' is required; known intents: {', '.join(self.known)}"
                )
            return self.default_intent
        if requested not in self.priority_classes:
            shown = requested if len(requested) <= 64 else requested[:64] + "..."
            raise InvalidArgument(f"unknown intent {shown!r}; known intents: {', '.join(self.known)}")
        allowed = self.roles.get(requested)
        if allowed is not None and not allowed.intersection(caller_roles):
            raise PermissionDenied(
                f"intent {requested!r} may be declared only by callers with role "
                f"{' or '.join(sorted(allowed))}; send another intent or none"
            )
        return requested

    def priority_class(self, intent: str, tenant_overrides: Mapping[str, str]) -> str:
        """The engine priority class for `intent`, after the tenant's own overrides."""
        return tenant_overrides.get(intent, self.priority_classes[intent])


DEVELOPMENT_INTENTS: dict[str, Any] = {
    "default_intent": "default",
    "intents": {
        "default": {"priority_class": "standard"},
        "code-completion": {"priority_class": "interactive"},
        "medical-diagnosis": {"priority_class": "critical"},
        "batch": {"priority_class": "batch"},
    },
}
