"""Typed reads of environment variables: the one place the process environment is consulted.

Every Thermocline variable carries the `THERMOCLINE_` prefix; the standard `OTEL_*` and
`REDIS_URL` variables are read here too, so a grep for `os.environ` finds this file alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PREFIX = "THERMOCLINE_"


class EnvError(ValueError):
    """An environment variable holds a value that cannot be used."""


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    value = (os.environ if environ is None else environ).get(name)
    return None if value is None or value.strip() == "" else value.strip()


def get_str(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's text, or `default` when unset or empty."""
    value = _raw(name, environ)
    return default if value is None else value


def get_optional_str(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's text, or None when unset or empty."""
    return _raw(name, environ)


def get_int(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """The variable as an integer; a malformed value is an EnvError naming the variable."""
    value = _raw(name, environ)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not an integer") from None


def get_float(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """The variable as a float; a malformed value is an EnvError naming the variable."""
    value = _raw(name, environ)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not a number") from None


def get_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """The variable as a boolean (1/0, true/false, yes/no, on/off)."""
    value = _raw(name, environ)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}={value!r} is not a boolean; use true or false")


def otlp_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """The OTLP collector address from the standard OpenTelemetry variables, if any."""
    return _raw("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", environ) or _raw("OTEL_EXPORTER_OTLP_ENDPOINT", environ)


def redis_url(environ: Mapping[str, str] | None = None) -> str:
    """The Redis URL from the conventional REDIS_URL variable."""
    return get_str("REDIS_URL", "redis://127.0.0.1:6379/0", environ)


def trace_sample_ratio(environ: Mapping[str, str] | None = None) -> float | None:
    """`THERMOCLINE_TRACE_SAMPLE_RATIO` in [0, 1], or None to leave sampling to `OTEL_TRACES_SAMPLER`."""
    name = "THERMOCLINE_TRACE_SAMPLE_RATIO"
    if _raw(name, environ) is None:
        return None
    ratio = get_float(name, 1.0, environ)
    if not 0.0 <= ratio <= 1.0:
        raise EnvError(f"{name}={ratio} is outside [0, 1]")
    return ratio
