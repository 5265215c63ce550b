"""The value check every config section shares."""

from __future__ import annotations

from ..errors import ConfigError


def check_positive(key: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{key}={value!r} is invalid; must be {'>= 0' if zero_ok else '> 0'}")
