"""Task text to engine tokens and back: the one place prompts are encoded."""

from __future__ import annotations

import functools

from .base import Problem


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompts start with BOS when the tokenizer has one (the tiny model is trained that way), as
    vLLM adds special tokens to a completion prompt; a text that already starts with BOS keeps one.
    Every face encodes text prompts here: the trainer, `generate`, `eval` and `/v1/completions`."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None and ids[:1] != [bos] else []) + ids


@functools.lru_cache(maxsize=8)
def renderer_of(tokenizer):
    """The tokenizer's chat renderer, made once (it probes the template)."""
    from ..chat.renderer import ChatRenderer

    return ChatRenderer(tokenizer)


def encode_problem(tokenizer, problem: Problem) -> list[int]:
    """A problem's prompt: its chat messages through the chat template, or its text."""
    if problem.messages is not None:
        return renderer_of(tokenizer).prompt(problem.messages)
    return encode_prompt(tokenizer, problem.prompt)


def stop_tokens(tokenizer, chat: bool) -> tuple[int, ...]:
    """What ends a completion: EOS, and for chat prompts the template's end-of-turn token."""
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if chat:
        stops.update(renderer_of(tokenizer).stop_tokens)
    return tuple(sorted(stops))


def decode_completion(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)
