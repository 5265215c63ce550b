"""Tool calls out of an assistant turn's text, in the formats of the models trillora loads.

Each model family was trained to write its calls its own way; the parser must match the one the
model's chat template shows it, or every call reads as plain text:

- `hermes` (Qwen3, Qwen2.5, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call;
- `kimi_k2`: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>`, then `<|tool_calls_section_end|>`;
- `deepseek_v3`: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
  and the arguments in a ```json fence, `<｜tool▁call▁end｜>`; V3.1's `NAME<｜tool▁sep｜>{json}` too;
- `glm45` (GLM-4.5): `<tool_call>NAME` then per argument `<arg_key>K</arg_key><arg_value>V</arg_value>`
  (strings raw, anything else as JSON), `</tool_call>`. Without the tool's schema a value that reads
  as JSON is taken as JSON: a string argument "12" comes back as the number 12.

- `harmony` (gpt-oss): a turn is messages `<|start|>assistant<|channel|>CHANNEL<|message|>BODY<|end|>`; a
  call is a message to `functions.NAME` (`to=` after the channel as the model writes it, or after the
  role as the chat template replays it), its body JSON, ended by `<|call|>`. The `analysis` channel is
  reasoning, `final` the answer (else the `commentary` preambles).

A call that is there but broken (bad JSON, no name, arguments that are not an object) is kept as
an error rather than dropped, so the env can answer it and the metrics count it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..errors import ConfigError

ToolFormat = Literal["hermes", "kimi_k2", "deepseek_v3", "glm45", "harmony"]
TOOL_FORMATS: tuple[str, ...] = get_args(ToolFormat)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""


@dataclass
class ParsedTurn:
    """An assistant turn: its text without the calls, the calls that parsed, the ones that did not."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasoning: str = ""  # what the format marks as reasoning (Harmony's analysis channel)


def _arguments(raw, where: str) -> tuple[dict | None, str | None]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            return None, f"{where}: arguments are not valid JSON ({e.msg})"
    if not isinstance(raw, dict):
        return None, f"{where}: arguments must be a JSON object, got {type(raw).__name__}"
    return raw, None


def _hermes(text: str) -> ParsedTurn:
    calls, errors = [], []
    for k, m in enumerate(re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S)):
        body = m.group(1).strip()
        where = f"tool call {k}"
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"{where}: not valid JSON ({e.msg})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f'{where}: needs an object with a string "name"')
            continue
        args, err = _arguments(obj.get("arguments", {}), where)
        if err:
            errors.append(err)
        else:
            calls.append(ToolCall(obj["name"], args, f"call_{k}"))
    content = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S).strip()
    return ParsedTurn(content, calls, errors)


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)", re.S
)


def _kimi_k2(text: str) -> ParsedTurn:
    head, sep, section = text.partition("<|tool_calls_section_begin|>")
    if not sep:
        return ParsedTurn(text.strip())
    section = section.split("<|tool_calls_section_end|>", 1)[0]
    calls, errors = [], []
    for k, m in enumerate(_KIMI_CALL.finditer(section)):
        call_id = m.group(1)
        name = re.sub(r"^functions\.", "", call_id).rsplit(":", 1)[0]
        args, err = _arguments(m.group(2).strip(), f"tool call {k} ({call_id})")
        if err or not name:
            errors.append(err or f"tool call {k}: no function name in {call_id!r}")
        else:
            calls.append(ToolCall(name, args, call_id))
    if not calls and not errors:
        errors.append("tool call section without a complete call")
    return ParsedTurn(head.strip(), calls, errors)


_DS_BEGIN, _DS_SEP, _DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _deepseek_v3(text: str) -> ParsedTurn:
    head, sep, section = text.partition("<｜tool▁calls▁begin｜>")
    if not sep:
        return ParsedTurn(text.strip())
    calls, errors = [], []
    for k, block in enumerate(section.split(_DS_BEGIN)[1:]):
        block = block.split(_DS_END, 1)[0]
        kind, sep, rest = block.partition(_DS_SEP)
        if not sep:
            errors.append(f"tool call {k}: no {_DS_SEP}")
            continue
        fence = re.match(r"(.*?)\n```(?:json)?\n(.*?)\n?```", rest, re.S)
        if kind.strip() == "function" and fence:  # V3: function<sep>NAME ```json ... ```
            name, raw = fence.group(1).strip(), fence.group(2)
        else:  # V3.1: NAME<sep>{json}
            name, raw = kind.strip(), rest
        args, err = _arguments(raw.strip(), f"tool call {k} ({name})")
        if err or not name:
            errors.append(err or f"tool call {k}: no function name")
        else:
            calls.append(ToolCall(name, args, f"call_{k}"))
    if not calls and not errors:
        errors.append("tool call section without a complete call")
    return ParsedTurn(head.strip(), calls, errors)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm45(text: str) -> ParsedTurn:
    calls, errors = [], []
    for k, m in enumerate(re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S)):
        body = m.group(1)
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or "\n" in name:
            errors.append(f"tool call {k}: no function name before the arguments")
            continue
        arguments = {}
        for key, raw in _GLM_ARG.findall(body):
            try:
                arguments[key.strip()] = json.loads(raw)
            except json.JSONDecodeError:
                arguments[key.strip()] = raw  # a string argument, written raw
        calls.append(ToolCall(name, arguments, f"call_{k}"))
    content = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S).strip()
    return ParsedTurn(content, calls, errors)


_HARMONY_BODY = re.compile(r"(.*?)<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)
CALL_END_TOKENS = ("<|call|>",)
"""Tokens that end a turn at a tool call (Harmony): the engine stops there so the env can answer."""


def _harmony(text: str) -> ParsedTurn:
    if "<|message|>" not in text:
        return ParsedTurn(text.strip())
    final, preamble, reasoning, calls, errors = [], [], [], [], []
    for header, body in (m.groups() for part in text.split("<|start|>") if (m := _HARMONY_BODY.match(part))):
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        recipient = re.search(r"\bto=(\S+?)(?:\s|<\||$)", header)
        if recipient:
            name, k = recipient.group(1), len(calls) + len(errors)
            if not name.startswith("functions."):
                errors.append(f"tool call {k}: recipient {name!r} is not a function (functions.NAME)")
                continue
            args, err = _arguments(body.strip(), f"tool call {k} ({name})")
            if err:
                errors.append(err)
            else:
                calls.append(ToolCall(name.removeprefix("functions."), args, f"call_{k}"))
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body.strip())
        elif channel and channel.group(1) == "final":
            final.append(body.strip())
        elif channel and channel.group(1) == "commentary":
            preamble.append(body.strip())
    return ParsedTurn("\n".join(final or preamble), calls, errors, reasoning="\n".join(reasoning))


PARSERS = {"hermes": _hermes, "kimi_k2": _kimi_k2, "deepseek_v3": _deepseek_v3, "glm45": _glm45, "harmony": _harmony}

_MARKERS = (
    ("<|channel|>", "harmony"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<arg_key>", "glm45"),
    ("<tool_call>", "hermes"),
)


def parse_tool_calls(text: str, fmt: str) -> ParsedTurn:
    return PARSERS[check_format(fmt)](text)


def check_format(fmt: str) -> str:
    if fmt not in PARSERS:
        raise ConfigError(f"unknown tool-call format {fmt!r}; allowed: {', '.join(TOOL_FORMATS)}")
    return fmt


def detect_format(tokenizer, explicit: str | None = None) -> str:
    """The format named, or the one whose marker tokens the tokenizer has (its vocabulary or chat template)."""
    if explicit:
        return check_format(explicit)
    vocab = tokenizer.get_vocab()
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(str(t) for t in template)
    for marker, fmt in _MARKERS:
        if marker in vocab or marker in template:
            return fmt
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    raise ConfigError(
        f"cannot tell the tool-call format of tokenizer {name!r} (none of "
        f"{', '.join(m for m, _ in _MARKERS)} in its vocabulary or chat template); set "
        f"task.options.tool_format to one of: {', '.join(TOOL_FORMATS)}"
    )
