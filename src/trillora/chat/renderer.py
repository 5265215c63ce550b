"""Chat messages to tokens with the tokenizer's own chat template, and assistant turns back to messages.

The first prompt is the template's rendering of the conversation (with the tools' JSON schemas, as
the template puts them). Later turns do not re-render the history: the policy's own tokens stay as
they were sampled and only what the env adds is rendered, as the template writes it after the
history (`continuation`). So every turn extends the last (one training sequence per episode), and a
template that would rewrite the history (Qwen3 drops old thinking once a new user turn comes) gets a
fresh full rendering instead, where the trainer starts a new sequence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import ConfigError
from .tool_calls import CALL_END_TOKENS, ParsedTurn, detect_format, parse_tool_calls

_PROBE = "QZXJV"  # a marker no template rewrites


@dataclass
class AssistantTurn:
    """A parsed assistant turn: what the env reads and the message the history keeps."""

    text: str
    parsed: ParsedTurn
    truncated: bool  # no end-of-turn token: the engine stopped at max_new_tokens
    reasoning: str = ""
    message: dict = field(default_factory=dict)


class ChatRenderer:
    def __init__(self, tokenizer, tool_format: str | None = None):
        self.tokenizer = tokenizer
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"tokenizer {name!r} has no chat template; message envs and chat data render "
                f"with it (use a chat model's tokenizer, or set tokenizer.chat_template)"
            )
        self._tool_format = tool_format
        self._specials = [t for t in tokenizer.all_special_tokens if t]
        # a tool's output may write none of the template's markers: the special tokens, and added tokens
        # that look like markup (`<tool_call>`, DeepSeek's `<｜User｜>`), special or not
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        self._markers = sorted({*self._specials, *(t.content for t in added if re.fullmatch(r"<[^<>\s]+>", t.content))})
        self.end_text, self.separator = self._turn_end()
        ids = self._encode(self.end_text) if self.end_text else []
        eos = tokenizer.eos_token_id
        vocab = tokenizer.get_vocab()
        calls = [vocab[t] for t in CALL_END_TOKENS if t in vocab]  # Harmony ends a turn at a call too
        self.stop_tokens = sorted({*ids[:1], *([eos] if eos is not None else []), *calls})

    @property
    def tool_format(self) -> str:
        """Asked for only when tools are: a template without tool markers can still render chat."""
        return detect_format(self.tokenizer, self._tool_format)

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [self._plain_tool(m) for m in messages],
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def _plain_tool(self, message: dict) -> dict:
        """A tool's output (what a model-written program printed) cannot write the template's markers:
        they are dropped from every string in it (parts, keys, nested values: a template renders
        what is not a string with `str()`), so a forged `<|im_end|><|im_start|>user` stays text."""
        if message.get("role") != "tool" or "content" not in message:
            return message
        return {**message, "content": self._plain(message["content"])}

    def _plain(self, value):
        if isinstance(value, str):
            return _without(self._markers, value)
        if isinstance(value, (list, tuple)):
            return [self._plain(v) for v in value]
        if isinstance(value, dict):
            return {self._plain(k): self._plain(v) for k, v in value.items()}
        return value

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _turn_end(self) -> tuple[str, str]:
        """What the template writes after an assistant's text: its end-of-turn token and the separator
        before the next message (Qwen: "<|im_end|>" and "\\n")."""
        text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}], None, False)
        after = text[text.rindex(_PROBE) + len(_PROBE) :]
        ids = self._encode(after)
        if not ids:
            return "", ""
        end = self.tokenizer.decode(ids[:1], skip_special_tokens=False)
        return (end, after[len(end) :]) if after.startswith(end) else ("", after)

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The whole conversation, ending with the assistant's generation prompt."""
        return self._encode(self._render(messages, tools, True))

    def continuation(
        self, history: list[dict], added: list[dict], tools: list[dict] | None, ended: bool
    ) -> list[int] | None:
        """The tokens that follow an assistant turn (the last of `history`) when `added` messages come
        next, up to the next generation prompt; None when the template renders the history
        differently once `added` are there (then `prompt(history + added)` is the next context).
        `ended`: the sampled turn already holds its end-of-turn token."""
        before = self._render(history, tools, False)
        after = self._render(history + added, tools, True)
        if not after.startswith(before):
            return None
        text = ("" if ended else self.end_text) + self._tail(before) + after[len(before) :]
        return self._encode(text)

    def _tail(self, before: str) -> str:
        """The separator the template put after the last end-of-turn token of `before`."""
        if not self.end_text or self.end_text not in before:
            return self.separator
        return before[before.rindex(self.end_text) + len(self.end_text) :]

    def parse(self, action: list[int], with_tools: bool) -> AssistantTurn:
        """The action's text (up to its end-of-turn token), its thinking and its tool calls."""
        stops = set(self.stop_tokens)
        truncated = not action or action[-1] not in stops
        body = action if truncated else action[:-1]
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        reasoning = ""
        think = re.match(r"\s*<think>(.*?)</think>\s*", text, re.S)
        if think:
            reasoning, text = think.group(1).strip(), text[think.end() :]
        harmony = "<|channel|>" in text and self._tool_format in (None, "harmony")
        if with_tools or harmony:  # Harmony's channels carry the answer apart from the reasoning, calls or not
            parsed = parse_tool_calls(text, "harmony" if harmony else self.tool_format)
            reasoning = reasoning or parsed.reasoning
            if not with_tools:  # an env without tools answers no calls
                parsed = ParsedTurn(parsed.content, reasoning=parsed.reasoning)
        else:
            parsed = ParsedTurn(text.strip())
        parsed.content = _without(self._specials, parsed.content).strip()  # a stray end-of-text in the answer
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ]
        return AssistantTurn(text, parsed, truncated, reasoning, message)


def _without(tokens: list[str], text: str) -> str:
    """`text` with every one of `tokens` gone, until none is left: dropping one may join another
    (`<|im_<|im_end|>start|>`)."""
    while True:
        before = text
        for tok in tokens:
            text = text.replace(tok, "")
        if text == before:
            return text
