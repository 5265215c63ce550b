"""gpt-oss's Harmony format in the agentic path: channels, calls in both header orders, the turn
stopping at `<|call|>`, and a tool episode merged into the chat template's own rendering.

The template is the released one's message-rendering part (tests/data/harmony_excerpt.jinja)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_messages import encode, play
from test_tool_calls import format_tool_call

from trillora.chat.renderer import ChatRenderer
from trillora.chat.tool_calls import ToolCall, detect_format, parse_tool_calls
from trillora.envs.calculator import multiply
from trillora.envs.env import Trajectory
from trillora.envs.tools import ToolEnv, function_schema
from trillora.envs.trajectory import merge_trajectory
from trillora.tiny import build_tokenizer

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = (Path(__file__).parent / "data" / "harmony_excerpt.jinja").read_text()
    return tokenizer


def test_a_call_as_the_model_writes_it_after_its_reasoning():
    text = (
        "<|channel|>analysis<|message|>Need the product.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.multiply <|constrain|>json<|message|>{"a": 12, "b": 3}'
    )
    p = parse_tool_calls(text, "harmony")
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("multiply", {"a": 12, "b": 3})]
    assert p.reasoning == "Need the product." and p.content == "" and p.errors == []


def test_a_call_as_the_template_replays_it(tok):
    """Recipient after the role (`assistant to=functions.NAME<|channel|>commentary json`): the template's form."""
    messages = [
        {"role": "user", "content": "12*3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 3}}}],
        },
    ]
    text = tok.apply_chat_template(messages, tokenize=False).split("<|start|>user<|message|>12*3?<|end|>", 1)[1]
    assert (
        text == '<|start|>assistant to=functions.multiply<|channel|>commentary json<|message|>{"a": 12, "b": 3}<|call|>'
    )
    p = parse_tool_calls(text, detect_format(tok))
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("multiply", {"a": 12, "b": 3})]


def test_final_channel_is_the_answer_and_broken_calls_are_kept_as_errors():
    p = parse_tool_calls(
        "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>36", "harmony"
    )
    assert (p.content, p.reasoning, p.tool_calls) == ("36", "easy", [])
    bad = parse_tool_calls('<|channel|>commentary to=functions.multiply json<|message|>{"a": 1', "harmony")
    assert bad.tool_calls == [] and "arguments are not valid JSON" in bad.errors[0]
    builtin = parse_tool_calls("<|channel|>analysis to=python code<|message|>print(1)", "harmony")
    assert "recipient 'python' is not a function" in builtin.errors[0]
    assert parse_tool_calls("plain text", "harmony").content == "plain text"
    written = format_tool_call(ToolCall("multiply", {"a": 2, "b": 5}), "harmony")
    assert parse_tool_calls(written, "harmony").tool_calls[0].arguments == {"a": 2, "b": 5}


def test_turn_stops_at_call_and_at_return(tok):
    r = ChatRenderer(tok)
    ids = tok.convert_tokens_to_ids
    assert r.end_text == "<|return|>"
    assert r.stop_tokens == sorted([ids("<|return|>"), ids("<|call|>"), tok.eos_token_id])
    turn = r.parse(
        encode(tok, "<|channel|>analysis<|message|>sum<|end|><|start|>assistant<|channel|>final<|message|>7<|return|>"),
        with_tools=False,
    )
    assert (turn.parsed.content, turn.reasoning, turn.truncated) == ("7", "sum", False)


def test_tool_episode_merges_into_the_templates_rendering(tok):
    """The policy calls in the template's own header order, gets the result, answers; the merged
    sequence is the template's rendering of the whole conversation, the mask the policy's tokens."""
    env = ToolEnv(
        ChatRenderer(tok),
        [{"role": "user", "content": "1234*567="}],
        [multiply],
        lambda text: float(text.strip() == "699678"),
    )
    call = ' to=functions.multiply<|channel|>commentary json<|message|>{"a": 1234, "b": 567}<|call|>'
    answer = "<|channel|>final<|message|>699678<|return|>"
    transitions = play(env, [call, answer])
    assert [t.reward for t in transitions] == [0.0, 1.0] and transitions[0].metrics["tool_calls"] == 1.0
    [sample] = merge_trajectory(Trajectory(transitions, []))
    conversation = [
        {"role": "user", "content": "1234*567="},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 1234, "b": 567}}}],
        },
        {"role": "tool", "content": "699678"},
        {"role": "assistant", "content": "699678"},
    ]
    whole = tok.apply_chat_template(conversation, tools=[function_schema(multiply)], tokenize=False)
    assert sample.tokens == encode(tok, whole)
    assert (
        tok.decode([t for t, m in zip(sample.tokens, sample.mask, strict=True) if m], skip_special_tokens=False)
        == call + answer
    )
