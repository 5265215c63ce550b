"""The one base class for errors a user fixes by changing their input, and the few that every
layer raises. The CLI catches `TrilloraError` once and prints its message on one line; anything
else is a bug in trillora and keeps its traceback.

Each subclass also keeps the built-in base it always had (`ValueError`, `RuntimeError`,
`FileNotFoundError`), so `except ValueError` in user code goes on working.
"""

from __future__ import annotations


class TrilloraError(Exception):
    """Something the user must change; the message names the file, line, key or value."""


class ConfigError(TrilloraError, ValueError):
    """A configuration (run TOML, `key=value`, a model's config.json) that cannot be used; the
    message names the key and the allowed values."""


class MissingPath(TrilloraError, FileNotFoundError):
    """A file or folder the user named that is not there."""


class TrainingDiverged(TrilloraError, RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient; the last good state is saved."""
