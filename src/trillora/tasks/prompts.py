"""Task text to engine tokens and back: the one place prompts are encoded."""

from __future__ import annotations


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompts start with BOS when the tokenizer has one (the tiny model is trained that way)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def decode_completion(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)
