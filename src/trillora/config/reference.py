"""The configuration reference, generated from the config dataclasses themselves: every key with
its type, default and the docstring written under it, so the page cannot drift from the code
(the docs site builds it; `python -m trillora.config.reference` prints it)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from pathlib import Path

from .sections import TrainConfig


def field_docs(cls: type) -> dict[str, str]:
    """{field: the string literal right under it} over `cls` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _kind(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint)).replace("typing.", "").replace("|", "\\|")


def table(cls: type, prefix: str = "", defaults: object = None) -> list[str]:
    """Markdown rows for `cls`'s plain fields (a dataclass-valued field gets its own section);
    `defaults`: the instance whose values are the defaults (a section built with other ones)."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        value = getattr(defaults, f.name) if defaults is not None else _default(f)
        if dataclasses.is_dataclass(value):
            continue
        shown = f"`{value!r}`".replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {_kind(hints[f.name])} | {shown} | {docs.get(f.name, '')} |")
    return rows


def markdown(root: type = TrainConfig) -> str:
    """The reference of `root` (the run config): its top-level keys, then one section per table."""
    out = ["## Top level", "", *table(root)]
    for f in dataclasses.fields(root):
        value = _default(f)
        if dataclasses.is_dataclass(value):
            doc = (inspect.getdoc(type(value)) or "").split("\n\n")[0]
            generic = doc.startswith(type(value).__name__ + "(")  # the dataclass's own signature, not a docstring
            out += [
                "",
                f"## [{f.name}]",
                "",
                *([] if generic else [" ".join(doc.split()), ""]),
                *table(type(value), f"{f.name}.", value),
            ]
    return "\n".join(out) + "\n"


BEGIN, END = "<!-- generated: trillora.config.reference -->", "<!-- end of the generated reference -->"


def filled(page: str, begin: str = BEGIN, end: str = END, text: str | None = None) -> str:
    """`page` with the text between its `begin` and `end` markers replaced by `text` (by default the
    current reference)."""
    head, _, rest = page.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n\n{markdown() if text is None else text}\n{end}{tail}"


def flag_table(cls: type, names: tuple[str, ...]) -> str:
    """Markdown rows of `cls`'s fields `names` as command-line flags (`max_fused` is `--max-fused`):
    each flag, its default and the docstring written under it."""
    docs, defaults = field_docs(cls), {f.name: _default(f) for f in dataclasses.fields(cls)}
    rows = ["| flag | default | what it bounds |", "|---|---|---|"]
    rows += [f"| `--{n.replace('_', '-')}` | `{defaults[n]!r}` | {docs.get(n, '')} |" for n in names]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # `--write docs/config.md` refreshes the page's copy; alone, prints the reference
    import sys

    if sys.argv[1:2] == ["--write"]:
        path = Path(sys.argv[2])
        path.write_text(filled(path.read_text()))
    else:
        print(markdown())
