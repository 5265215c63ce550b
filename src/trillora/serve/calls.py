"""What every face hands the resident service and what it refuses: a sample call (an OpenAI
completion's prompt or a Tinker `asample`), its checks (`check_sample`) and the cut at a stop
string, and `BadRequest`, the HTTP status and a message naming the culprit. Neither face's own
types: each translates its requests into these."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import TrilloraError
from ..rollout.types import SamplingParams


class BadRequest(TrilloraError):
    """A request the service refuses: the HTTP status and a message naming the culprit."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # the status travels too (a pipeline's last stage sends outcomes to the others)
        return BadRequest, (str(self), self.status)


@dataclass
class SampleCall:
    sampler_id: str
    prompt: list[int]
    n: int
    params: dict
    prompt_logprobs: bool = False
    options: dict = field(default_factory=dict)
    """Scores beyond the sampled tokens (`tinker.checks.sample_options`, `policy.logprobs.score_prompt`)."""


def check_sample(
    c: SampleCall, vocab: int, eos: int | None, cfg, positions: int
) -> tuple[SamplingParams, tuple[str, ...]]:
    """The engine's sampling settings for a sample call, and its stop strings; the prompt and
    max_tokens within the model's `positions`, n × both within `cfg.max_call_tokens` (`cfg`: the
    server's `ServeConfig`)."""
    if not c.prompt or any(type(t) is not int for t in c.prompt) or min(c.prompt) < 0 or max(c.prompt) >= vocab:
        raise BadRequest(f"prompt token ids must be a non-empty list of integers in 0..{vocab - 1}")
    if not isinstance(c.n, int) or not 1 <= c.n <= cfg.max_samples:
        raise BadRequest(f"num_samples={c.n!r}; allowed: 1..{cfg.max_samples}")
    stop_ids, stop_strings = _stops(c.params.get("stop"), vocab, eos)
    max_tokens = c.params.get("max_tokens") or 64
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= cfg.max_tokens_limit:
        raise BadRequest(f"sampling_params.max_tokens={max_tokens!r}; allowed: 1..{cfg.max_tokens_limit}")
    if len(c.prompt) + max_tokens > positions:
        raise BadRequest(
            f"a prompt of {len(c.prompt)} tokens and max_tokens={max_tokens} need {len(c.prompt) + max_tokens} "
            f"positions; the model has {positions}"
        )
    if c.n * (len(c.prompt) + max_tokens) > cfg.max_call_tokens:
        raise BadRequest(
            f"num_samples={c.n} × ({len(c.prompt)} prompt tokens + max_tokens={max_tokens}) is over "
            f"{cfg.max_call_tokens} tokens a call (--max-call-tokens)"
        )
    seed = c.params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise BadRequest(f"sampling_params.seed={seed!r}; allowed: an integer in 0..2**63-1")
    try:
        sp = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(c.params.get("temperature", 1.0)),
            top_p=float(c.params.get("top_p", 1.0)),
            top_k=max(0, int(c.params.get("top_k", -1))),
            stop_token_ids=stop_ids,
            seed=seed,
        )
    except (TypeError, ValueError, OverflowError) as e:
        raise BadRequest(f"sampling_params: {e}") from None
    return sp, stop_strings


def _stops(stop, vocab: int, eos: int | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if stop is None:
        return ((eos,) if eos is not None else ()), ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, (str, int)) for s in stop):
        raise BadRequest("sampling_params.stop must be a string, a list of strings or a list of token ids")
    if len(stop) > MAX_STOPS or any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"sampling_params.stop: at most {MAX_STOPS} entries of at most {MAX_STOP_CHARS} characters")
    if any(isinstance(s, str) and "\ufffd" in s for s in stop):  # a half-decoded character's stand-in, not text
        raise BadRequest("sampling_params.stop: a stop string may not hold U+FFFD")
    ids = tuple(s for s in stop if isinstance(s, int))
    if any(not 0 <= i < vocab for i in ids):
        raise BadRequest(f"sampling_params.stop token ids must be in 0..{vocab - 1}")
    return ids, tuple(s for s in stop if isinstance(s, str) and s)


MAX_STOPS, MAX_STOP_CHARS = 64, 256
"""Every stop string is looked for in the worker that serves everyone: 20,000 of them held it 285 s."""


def cut_at_stop(c, stop_strings: tuple[str, ...], tokenizer) -> tuple[list[int], list[float], str]:
    """The completion up to and including the token that completes a stop string: the shortest prefix
    whose text holds one, found by bisection. A longer prefix's text holds what a shorter one's does:
    decoded as it is (no clean-up of spaces), and with no U+FFFD in a stop string (a partial
    character's stand-in, gone once the character is whole)."""
    tokens, logprobs, reason = c.token_ids, c.logprobs, c.finish_reason

    def stops(k: int) -> bool:
        text = tokenizer.decode(tokens[:k], clean_up_tokenization_spaces=False)
        return any(s in text for s in stop_strings)

    if not stop_strings or not stops(len(tokens)):
        return tokens, logprobs, reason
    lo, hi = 1, len(tokens)  # stops(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stops(mid) else (mid + 1, hi)
    return tokens[:hi], logprobs[:hi], "stop"
