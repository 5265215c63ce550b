"""Tool-call parsing in each model family's format, and tool schemas from Python functions
(transformers' `get_json_schema` as the oracle)."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from transformers.utils import get_json_schema

from trillora.chat import tool_calls
from trillora.chat.tool_calls import TOOL_FORMATS, ToolCall, detect_format, parse_tool_calls
from trillora.envs.tools import function_schema
from trillora.errors import ConfigError
from trillora.tiny import build_chat_tokenizer, build_tokenizer


def format_tool_call(call: ToolCall, fmt: str, index: int = 0) -> str:
    """A call written the way `fmt`'s models write it: the parsers' round trip."""
    args = json.dumps(call.arguments)
    if fmt == "hermes":
        return f'<tool_call>\n{{"name": "{call.name}", "arguments": {args}}}\n</tool_call>'
    if fmt == "kimi_k2":
        return (
            f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{call.name}:{index}"
            f"<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"
        )
    if fmt == "harmony":  # as gpt-oss writes it after the `<|start|>assistant` generation prompt
        return f"<|channel|>commentary to=functions.{call.name} <|constrain|>json<|message|>{args}<|call|>"
    if fmt == "glm45":
        pairs = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            f"</arg_value>\n"
            for k, v in call.arguments.items()
        )
        return f"<tool_call>{call.name}\n{pairs}</tool_call>"
    assert fmt == "deepseek_v3", fmt
    call_text = (
        f"{tool_calls._DS_BEGIN}function{tool_calls._DS_SEP}{call.name}\n```json\n{args}\n```{tool_calls._DS_END}"
    )
    return f"<｜tool▁calls▁begin｜>{call_text}<｜tool▁calls▁end｜>"


def test_hermes_calls_text_and_errors():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 3}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    p = parse_tool_calls(text, "hermes")
    assert p.content == "Let me compute."
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("multiply", {"a": 12, "b": 3}), ("add", {"a": 1})]
    assert p.errors == []
    bad = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "h", "arguments": "{not json"}</tool_call>',
        "hermes",
    )
    assert bad.tool_calls == [] and len(bad.errors) == 4
    assert "not valid JSON" in bad.errors[0] and "name" in bad.errors[1]
    assert "must be a JSON object, got list" in bad.errors[2] and "arguments are not valid JSON" in bad.errors[3]
    unclosed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}', "hermes")  # cut by max_new_tokens
    assert [c.name for c in unclosed.tool_calls] == ["f"]
    assert parse_tool_calls("just an answer: 42", "hermes").tool_calls == []


def test_kimi_k2_section():
    text = (
        "I'll check both.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )
    p = parse_tool_calls(text, "kimi_k2")
    assert p.content == "I'll check both."
    assert [(c.name, c.arguments, c.id) for c in p.tool_calls] == [
        ("get_weather", {"city": "Beijing"}, "functions.get_weather:0"),
        ("get_time", {}, "functions.get_time:1"),
    ]
    bad = parse_tool_calls(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        "{oops}<|tool_call_end|><|tool_calls_section_end|>",
        "kimi_k2",
    )
    assert bad.tool_calls == [] and "not valid JSON" in bad.errors[0] and "functions.f:0" in bad.errors[0]
    assert parse_tool_calls("<|tool_calls_section_begin|>garbage", "kimi_k2").errors


def test_deepseek_v3_and_v31_calls():
    v3 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Hangzhou"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    p = parse_tool_calls(v3, "deepseek_v3")
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_weather", {"city": "Hangzhou"})] and p.errors == []
    v31 = (
        'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    )
    p = parse_tool_calls(v31, "deepseek_v3")
    assert p.content == "Sure." and [(c.name, c.arguments) for c in p.tool_calls] == [("get_time", {"tz": "UTC"})]
    bad = parse_tool_calls(
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>", "deepseek_v3"
    )
    assert bad.tool_calls == [] and "JSON object" in bad.errors[0]


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_each_format_parses_what_it_writes(fmt):
    call = ToolCall("multiply", {"a": 1234, "b": 567})
    before = "<|channel|>commentary<|message|>ok<|end|><|start|>assistant" if fmt == "harmony" else "ok "  # a preamble
    p = parse_tool_calls(before + format_tool_call(call, fmt), fmt)
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("multiply", {"a": 1234, "b": 567})]
    assert p.content == "ok" and p.errors == []


# The assistant tool-call lines of GLM-4.5's chat template (as released), rendered by transformers
GLM45_CALLS = """{%- for m in messages %}<|{{ m.role }}|>
{%- if m.content %}{{ '\\n' + m.content }}{% endif %}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- endfor %}"""


def test_glm45_calls_as_its_chat_template_writes_them():
    """GLM-4.5's tool calls as transformers renders its template: strings raw, other values as
    JSON, two calls in one turn; the format is told from the tokenizer's `<arg_key>` marker."""
    tok = build_chat_tokenizer()
    tok.chat_template = GLM45_CALLS
    args = {"city": "北京", "days": 3, "units": {"t": "c"}, "tags": ["a", "b"], "exact": False}
    messages = [
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": args}},
                {"type": "function", "function": {"name": "clock", "arguments": {}}},
            ],
        }
    ]
    text = tok.apply_chat_template(messages, tokenize=False).split("<|assistant|>", 1)[1]
    assert "<arg_key>city</arg_key>\n<arg_value>北京</arg_value>" in text  # the template's own layout
    p = parse_tool_calls(text, detect_format(tok))
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("weather", args), ("clock", {})]
    assert p.content == "checking" and p.errors == []
    bad = parse_tool_calls("<tool_call><arg_key>x</arg_key><arg_value>1</arg_value></tool_call>", "glm45")
    assert bad.tool_calls == [] and "no function name" in bad.errors[0]


def test_format_chosen_by_the_tokenizer_or_named_or_refused():
    assert detect_format(build_chat_tokenizer()) == "hermes"
    assert detect_format(build_tokenizer(), "kimi_k2") == "kimi_k2"
    with pytest.raises(ConfigError, match="hermes, kimi_k2, deepseek_v3, glm45, harmony"):
        detect_format(build_tokenizer())
    with pytest.raises(
        ConfigError, match="unknown tool-call format 'mistral'; allowed: hermes, kimi_k2, deepseek_v3, glm45, harmony"
    ):
        parse_tool_calls("x", "mistral")


def search(
    query: str,
    limit: int = 5,
    exact: bool = False,
    sort: Literal["date", "score"] = "score",
    tags: list[str] | None = None,
    weight: float = 1.0,
):
    """Search the archive for documents.

    Longer explanation that is not part of the description.

    Args:
        query: the words to look for
        limit: how many results
        exact: only exact matches
        sort: the order of results
        tags: only documents with these tags
        weight: how much the title counts

    Returns:
        The documents.
    """


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@pytest.mark.parametrize("fn", [search, multiply])
def test_function_schema_matches_transformers(fn):
    oracle = get_json_schema(fn)
    oracle["function"].pop("return", None)
    assert function_schema(fn) == oracle


def test_function_schema_without_docs():
    def f(x, y: float = 1.0):
        pass

    assert function_schema(f) == {
        "type": "function",
        "function": {
            "name": "f",
            "description": "",
            "parameters": {"type": "object", "properties": {"x": {}, "y": {"type": "number"}}, "required": ["x"]},
        },
    }
