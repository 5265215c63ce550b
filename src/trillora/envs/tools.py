"""Tools from plain Python functions, and the env that lets the policy call them.

A function's signature and docstring are its JSON schema (the format chat templates take in
`tools=`: name, the docstring's text before `Args:` as description, typed parameters described by the
docstring's `Args:` lines, the ones without a default required). Calls are the model's output, so
everything about them can be wrong; each failure is answered as the tool's output (the model can
recover) and counted in the turn's metrics:

    parse_error    a call that does not parse (broken markup, arguments that are not JSON)
    unknown_tool   a name that is not one of the tools
    bad_arguments  arguments that do not fit the signature or the schema's types
    tool_error     the tool raised
    tool_timeout   the tool ran past `tool_timeout` seconds
    tool_limit     more than `max_tool_calls` calls in the episode (it ends, reward 0)
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..chat.renderer import AssistantTurn, ChatRenderer
from ..chat.tool_calls import ToolCall
from ..tasks.guard import RewardTimeout, time_limit
from .messages import MessageEnv, Reply

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _type_schema(hint: Any) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        schema = _type_schema(inner[0]) if len(inner) == 1 else {}
        return {**schema, "nullable": True} if len(inner) < len(args) else schema
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        return {"type": "array", **({"items": _type_schema(args[0])} if args else {})}
    if origin is dict or hint is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    return {}


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """The description (the text before `Args:`, as transformers' `get_json_schema` reads it) and each
    argument's description."""
    doc = inspect.getdoc(fn) or ""
    head, _, rest = doc.partition("\nArgs:")
    described: dict[str, str] = {}
    for line in rest.split("\n"):
        m = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)", line)
        if m:
            described[m.group(1)] = m.group(2).strip()
        elif line.strip() and not line.startswith((" ", "\t")):
            break  # the next section (Returns:, Raises:)
    return head.strip(), described


def function_schema(fn: Callable) -> dict:
    """`fn`'s JSON schema for a chat template's `tools=`."""
    description, described = _docstring(fn)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = _type_schema(hints.get(name, Any))
        if name in described:
            prop["description"] = described[name]
        properties[name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(name)
    parameters = {"type": "object", "properties": properties, **({"required": required} if required else {})}
    return {"type": "function", "function": {"name": fn.__name__, "description": description, "parameters": parameters}}


def _fits(value: Any, schema: dict) -> bool:
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if value is None:
        return bool(schema.get("nullable"))
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list) and all(_fits(v, schema.get("items", {})) for v in value)
    if kind == "object":
        return isinstance(value, dict)
    return True


def call_tool(
    functions: dict[str, Callable],
    call: ToolCall,
    timeout: float,
    max_output: int = 2000,
    schemas: dict[str, dict] | None = None,
) -> tuple[str, str]:
    """(the tool message's content, what happened: "ok" or one of the failure counters). `schemas`:
    the tools' schemas by name when already built."""
    fn = functions.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; available: {', '.join(functions)}", "unknown_tool"
    schema = (schemas[call.name] if schemas else function_schema(fn))["function"]["parameters"]
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return f"error: bad arguments for {call.name}: {e}", "bad_arguments"
    for key, value in call.arguments.items():
        if key in schema["properties"] and not _fits(value, schema["properties"][key]):
            want = schema["properties"][key].get("type", "?")
            return f"error: bad arguments for {call.name}: {key} must be {want}, got {value!r}", "bad_arguments"
    try:
        with time_limit(timeout):
            out = fn(**call.arguments)
    except RewardTimeout:
        return f"error: {call.name} timed out after {timeout:g} s", "tool_timeout"
    except Exception as e:  # the tool's own failure, shown to the model as its output
        return f"error: {type(e).__name__}: {e}", "tool_error"
    text = out if isinstance(out, str) else str(out)
    return text[:max_output], "ok"


class ToolEnv(MessageEnv):
    """The policy may call `tools` (plain functions) any number of turns; a turn without calls is its
    answer, scored by `score(answer_text)`, and ends the episode."""

    COUNTERS = ("tool_calls", "parse_error", "unknown_tool", "bad_arguments", "tool_error", "tool_timeout")

    def __init__(
        self,
        renderer: ChatRenderer,
        messages: list[dict],
        tools: Sequence[Callable],
        score: Callable[[str], float],
        max_tool_calls: int = 4,
        tool_timeout: float = 5.0,
    ):
        super().__init__(renderer, messages, [function_schema(f) for f in tools])
        self.functions = {f.__name__: f for f in tools}
        self.schemas = {s["function"]["name"]: s for s in self.tools}
        self.score, self.max_tool_calls, self.tool_timeout = score, max_tool_calls, tool_timeout
        self.calls = 0

    def respond(self, turn: AssistantTurn) -> Reply:
        parsed = turn.parsed
        metrics = dict.fromkeys(self.COUNTERS + ("answered", "tool_limit"), 0.0)  # every turn, every counter
        if not parsed.tool_calls and not parsed.errors:
            metrics["answered"] = 1.0
            return Reply(reward=float(self.score(parsed.content)), done=True, metrics=metrics)
        self.calls += len(parsed.tool_calls) + len(parsed.errors)
        metrics["tool_calls"] = float(len(parsed.tool_calls) + len(parsed.errors))
        metrics["parse_error"] = float(len(parsed.errors))
        if self.calls > self.max_tool_calls:
            metrics["tool_limit"] = 1.0
            return Reply(done=True, metrics=metrics)
        messages = [{"role": "tool", "content": f"error: {e}"} for e in parsed.errors]
        for call in parsed.tool_calls:
            content, outcome = call_tool(self.functions, call, self.tool_timeout, schemas=self.schemas)
            if outcome != "ok":
                metrics[outcome] += 1.0
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content})
        return Reply(messages, metrics=metrics)
