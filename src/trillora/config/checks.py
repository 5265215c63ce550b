"""The value checks every config section shares."""

from __future__ import annotations

from ..errors import ConfigError


def check_positive(key: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{key}={value!r} is invalid; must be {'>= 0' if zero_ok else '> 0'}")


def check_fields(section, prefix: str, positive: str = "", zero_ok: str = "") -> None:
    """`check_positive` on `section`'s fields named in `positive` (> 0) and `zero_ok` (>= 0), space-separated."""
    for names, zero in ((positive, False), (zero_ok, True)):
        for name in names.split():
            check_positive(f"{prefix}{name}", getattr(section, name), zero_ok=zero)
