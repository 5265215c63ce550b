"""Run configs from TOML files and `key=value` overrides, and back to TOML.

    trillora train examples/arithmetic.toml rollout.temperature=0.8 lora.rank=16

Unknown keys get a close-match suggestion, wrong types and values name the key and what is
allowed; the result is validated once (`TrainConfig.validate`) and never mutated afterwards.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from .sections import TrainConfig

# --- loading --------------------------------------------------------------------------


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check `value` against a field's annotation; ints are accepted for floats, lists for tuples."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is invalid; allowed: {', '.join(map(str, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        return _coerce(key, value, next(a for a in options if a is not type(None)))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if origin is tuple or annotation is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        args = typing.get_args(annotation)
        if args and Ellipsis not in args and len(args) != len(value):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {len(value)}: {list(value)!r}")
        item = args[0] if args else Any
        return tuple(v if item is Any else _coerce(key, v, item) for v in value)
    if annotation is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return dict(value)
    if annotation in (int, float, str, bool) and type(value) is not annotation:
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {full!r}{hint}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a table [{full}], got {value!r}")
            kwargs[key] = _build(annotation, value, f"{full}.")
        else:
            kwargs[key] = _coerce(full, value, annotation)
    try:
        return cls(**kwargs)
    except ValueError as e:  # section-level validation (e.g. LoraConfig) already names the key
        raise ConfigError(str(e)) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is read as TOML, else kept as a string."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. rollout.temperature=0.8)")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    except (RecursionError, ValueError) as e:  # nested too deeply, or an integer past the digit limit
        raise ConfigError(f"override {key.strip()!r}: {type(e).__name__}: {str(e)[:200]}") from None
    return key.strip().split("."), value


def _read_toml(path: Path) -> dict:
    """The file's tables, or a ConfigError naming the file, the line where it can, and the cause."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 (byte {raw[e.start : e.start + 1]!r}); TOML files are UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: tables or arrays nested too deeply") from None
    except ValueError as e:  # an integer past Python's digit limit
        raise ConfigError(f"{path}: {e}") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        data = _read_toml(path)
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k!r} is not a table")
        node[keys[-1]] = value
    if data.get("parallel") == "auto":  # the planner picks the layout at launch
        data["parallel"] = {"auto": True}
    return _build(TrainConfig, data, "").validate()


# --- writing --------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if v is None:
        raise ConfigError("None cannot be written to TOML")
    raise ConfigError(f"cannot write {type(v).__name__} to TOML")


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config; `load_config` of it gives back an equal config."""
    top, tables = [], []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            rows = [
                f"{k.name} = {_toml_value(getattr(value, k.name))}"
                for k in dataclasses.fields(value)
                if getattr(value, k.name) is not None
            ]
            tables.append(f"[{f.name}]\n" + "\n".join(rows))
        else:
            top.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(top) + "\n\n" + "\n\n".join(tables) + "\n"
