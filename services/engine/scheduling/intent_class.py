"""Intent classes: per-class priority, batch share, queue timeout, reserved slots and caps.

Loaded from a TOML file (format and example: deploy/engine/intent_classes.toml); without one,
the engine serves the gateway's four priority classes with the settings of `builtin()`.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from services.engine.errors import UnknownIntentClass

DEFAULT_CLASS = "standard"  # what an empty intent_class means
_FIX = (
    "raise THERMOCLINE_ENGINE_MAX_BATCH_SIZE above the reserved total, or lower reserved_slots in the "
    "THERMOCLINE_ENGINE_INTENT_CLASSES file"
)


@dataclass(frozen=True)
class IntentClass:
    """One class of requests and what the scheduler promises it."""

    name: str
    priority: int = 0  # higher is admitted first and preempted last
    max_batch_share: float = 1.0  # most running sequences of this class, as a share of max_batch_size
    queue_timeout_s: float = 60.0  # longest wait before admission; past it the request ends
    reserved_slots: int = 0  # batch slots other classes may not take
    max_new_tokens: int = 0  # cap on generated tokens (0: the engine's own limit)
    hot_tokens: int | None = None  # tier overrides for this class (None: the deployment's)
    warm_tokens: int | None = None
    max_hot_tokens: int | None = None  # cap of the attention-driven hot window (None: the deployment's)
    retrieval_mode: str | None = None  # "off" or "semantic" (None: the deployment's default)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an intent class needs a non-empty name")
        if not 0.0 < self.max_batch_share <= 1.0:
            raise ValueError(
                f"class {self.name!r}: max_batch_share must be in (0, 1], got {self.max_batch_share}"
            )
        if not math.isfinite(self.queue_timeout_s) or self.queue_timeout_s <= 0:
            raise ValueError(f"class {self.name!r}: queue_timeout_s must be > 0, got {self.queue_timeout_s}")
        if self.retrieval_mode not in (None, "off", "semantic"):
            raise ValueError(
                f"class {self.name!r}: retrieval_mode must be 'off' or 'semantic', "
                f"got {self.retrieval_mode!r}"
            )
        for name in ("reserved_slots", "max_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"class {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")

    def max_running(self, max_batch_size: int) -> int:
        """Running sequences this class may hold at once."""
        return max(1, math.floor(self.max_batch_share * max_batch_size))


@dataclass(frozen=True)
class IntentClasses:
    """The known classes by name."""

    by_name: dict[str, IntentClass]

    def __post_init__(self) -> None:
        if DEFAULT_CLASS not in self.by_name and "default" not in self.by_name:
            raise ValueError(
                f"the intent classes must include {DEFAULT_CLASS!r} (used when a request names none)"
            )

    def get(self, name: str) -> IntentClass:
        """The class called `name` (empty means `default`); unknown names are refused."""
        found = self.by_name.get(name or self.default_name)
        if found is None:
            raise UnknownIntentClass(name, sorted(self.by_name))
        return found

    def check_fits(self, max_batch_size: int) -> None:
        """Reserved slots must fit the batch and leave a slot for the classes that reserve none.

        A class starts a request only while the free slots, less that one, cover the other
        classes' unfilled reservations (`Scheduler._class_may_start`): with every slot reserved,
        a class without a reservation could never start, and its requests would wait out their
        queue timeout.
        """
        reserved = sum(c.reserved_slots for c in self.by_name.values())
        if reserved > max_batch_size:
            raise ValueError(
                f"intent classes reserve {reserved} slots but max_batch_size is {max_batch_size}"
                f" ({self._reservations()}); {_FIX}"
            )
        unreserved = sorted(c.name for c in self.by_name.values() if c.reserved_slots == 0)
        if unreserved and reserved >= max_batch_size:
            raise ValueError(
                f"intent classes reserve all {max_batch_size} batch slots ({self._reservations()}), so "
                f"{', '.join(unreserved)} could never start; {_FIX}"
            )

    def _reservations(self) -> str:
        return ", ".join(f"{c.name} {c.reserved_slots}" for c in self.by_name.values() if c.reserved_slots)

    @property
    def default_name(self) -> str:
        """The class of requests that name none."""
        return DEFAULT_CLASS if DEFAULT_CLASS in self.by_name else "default"

    @classmethod
    def builtin(cls) -> IntentClasses:
        """The gateway's priority classes (deploy/gateway/intents.json), with no reserved slots."""
        classes = (
            IntentClass("critical", priority=30, queue_timeout_s=10.0),
            IntentClass("interactive", priority=20, queue_timeout_s=30.0),
            IntentClass(DEFAULT_CLASS, priority=10, queue_timeout_s=60.0),
            IntentClass("batch", priority=0, max_batch_share=0.5, queue_timeout_s=600.0),
        )
        return cls({c.name: c for c in classes})

    @classmethod
    def load(cls, path: str | Path) -> IntentClasses:
        """Read `[class.<name>]` tables from a TOML file."""
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        tables: dict[str, Any] = data.get("class", {})
        known = {f.name for f in fields(IntentClass)} - {"name"}
        classes = {}
        for name, table in tables.items():
            unknown = set(table) - known
            if unknown:
                raise ValueError(
                    f"{path}: class {name!r} has unknown keys {sorted(unknown)}; known: {sorted(known)}"
                )
            classes[name] = IntentClass(name=name, **table)
        return cls(classes)
