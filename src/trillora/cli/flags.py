"""Command-line flags derived from a config dataclass: one `--field-name` per field, with the type,
default and choices of its annotation and the docstring under it as help
(`config.reference.field_docs`), so a flag is never a hand copy of a field."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from ..config.reference import field_docs


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (), positional: tuple[str, ...] = ()):
    """Add a flag for each field of `cls` but `skip` (`positional` ones as positional arguments).
    bool: `--name` sets True (`--no-name` too where the default is True); `X | None`: a value of X
    or nothing; `list[X]` in a union: repeat the flag; `Literal[...]`: its values as choices. A
    field that is a dataclass itself gives its own fields' flags, unprefixed (`--tp`), each with the
    default the outer field's default holds."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            _add_nested(parser, hints[f.name], _default(f), skip)
            continue
        help_text = docs.get(f.name, "").replace("%", "%%")
        if f.name in positional:
            parser.add_argument(f.name, help=help_text)
            continue
        default = _default(f)
        flag, hint = "--" + f.name.replace("_", "-"), hints[f.name]
        options = _union_members(hint)
        if hint is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(flag, action=action, default=default, help=help_text)
        elif any(typing.get_origin(o) is list for o in options):  # str | list[str]: the flag repeated
            parser.add_argument(flag, action="append", default=default, help=help_text + " (repeat for several)")
        elif typing.get_origin(options[0]) is typing.Literal:
            parser.add_argument(flag, default=default, choices=typing.get_args(options[0]), help=help_text)
        else:
            parser.add_argument(flag, type=options[0], default=default, metavar=f.name.upper(), help=help_text)


def _add_nested(parser: argparse.ArgumentParser, cls: type, value, skip: tuple[str, ...]) -> None:
    """The flags of a nested dataclass's fields, defaults from `value` (the outer field's default)."""
    add_flags(parser, cls, skip)
    parser.set_defaults(**{f.name: getattr(value, f.name) for f in dataclasses.fields(cls) if f.name not in skip})


def config_of(cls: type, args: argparse.Namespace, **given):
    """`cls` from the parsed flags of its fields (a nested dataclass's from its own; `given` wins)."""
    hints, values = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            nested = {g.name: getattr(args, g.name) for g in dataclasses.fields(hints[f.name]) if hasattr(args, g.name)}
            values[f.name] = dataclasses.replace(_default(f), **nested)
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**values | given)


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _union_members(hint) -> list:
    """The types an annotation allows, None left out (`int | None` -> [int])."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)]
    return [hint]
