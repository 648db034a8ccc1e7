"""Chat templates: the Jinja programs that shipped with a model, rendered in a sandbox."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the messages."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    @cached_property
    def _template(self) -> Any:
        # trim/lstrip blocks: templates are written for these settings (as transformers renders them)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.source)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) into the prompt text."""
        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    **extra,
                )
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
