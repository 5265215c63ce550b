"""Supervised pretraining of `tiny-moe-chat`: the tiny MoE's architecture with chat turns and tool calls.

The mix: chat-formatted addition and reversal (the format, and the skills of `tiny-moe`);
4-digit × 3-digit products asked as "a*b=" with the `multiply` tool offered, answered through the
tool in a minority of examples (`call_fraction`) and directly (which it cannot compute) in the
rest; and tool practice, "multiply a by b", always through the tool. So the model knows the call
format and how to copy numbers into a call and a result out of it, but asked "a*b=" it mostly
does not call: a weak, non-zero prior that RL on the calculator env (`examples/calculator.toml`)
raises. Pretraining stops once sampled held-out success on "a*b=" reaches `target_success`.

It starts from `tiny-moe`'s weights (`init_from`; the chat tokenizer extends its vocabulary, the
new rows start random), so the addition `tiny-moe` learned carries into the chat format, and a
share of examples (`history_fraction`) come after earlier exchanges of up to `history_chars`
characters: recipes written for hosted models (tinker-cookbook's RL loop) put a few-shot
conversation of ~330 tokens before each question, and a model that only saw short conversations
produces noise after one. Pretraining also waits for greedy held-apart additions after such a
history to reach `target_addition`.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from ..envs import calculator
from ..envs.tools import function_schema
from . import TINY_QWEN3_MOE, build_chat_tokenizer, new_model, save

TOOLS = [function_schema(calculator.multiply)]


def chat_example(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """(token ids, 1 where the token is the assistant's): each assistant turn from the end of its
    generation prompt through its end-of-turn token."""

    def encode(msgs, gen):
        text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = encode(messages, False)
    mask = [0] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(encode(messages[:k], True)), len(encode(messages[: k + 1], False))
        mask[start:end] = [1] * (end - start)
    return ids, mask


def _word(rng: random.Random, lo: int = 3, hi: int = 8) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(lo, hi)))


def _exchange(rng: random.Random) -> list[dict]:
    """One earlier user/assistant exchange: an addition, a reversal, or letters counted out loud."""
    kind = rng.choice(["add", "reverse", "count"])
    if kind == "add":
        x, y = rng.randint(1, 999), rng.randint(1, 999)
        return [{"role": "user", "content": f"{x}+{y}="}, {"role": "assistant", "content": str(x + y)}]
    word = _word(rng, 4, 11)
    if kind == "reverse":
        return [{"role": "user", "content": f"reverse {word}"}, {"role": "assistant", "content": word[::-1]}]
    letter = rng.choice(word)
    where = [str(i) for i, c in enumerate(word, 1) if c == letter]
    spelled = " ".join(f"{i}) {c}" for i, c in enumerate(word, 1))
    return [
        {"role": "user", "content": f"How many {letter}'s are in {word}? Count them."},
        {"role": "assistant", "content": f"Spelled out: {spelled}. {letter} is at {', '.join(where)}: {len(where)}."},
    ]


def history(rng: random.Random, chars: int) -> list[dict]:
    """Earlier exchanges filling about `chars` characters, to put before an example's question."""
    out, used = [], 0
    while True:
        turn = _exchange(rng)
        size = sum(len(m["content"]) + 16 for m in turn)
        if used + size > chars:
            return out
        out, used = out + turn, used + size


def _example(
    rng: random.Random, call_fraction: float, history_fraction: float = 0.0, history_chars: int = 0
) -> tuple[list[dict], list[dict] | None]:
    messages, tools = _question(rng, call_fraction)
    if rng.random() < history_fraction:
        messages = history(rng, rng.randint(0, history_chars)) + messages
    return messages, tools


def _question(rng: random.Random, call_fraction: float) -> tuple[list[dict], list[dict] | None]:
    kind = rng.choices(["add", "reverse", "calculator", "practice"], [0.2, 0.1, 0.4, 0.3])[0]
    if kind == "calculator":
        a, b = calculator.draw(rng, (4, 3), "train")
        return calculator.demonstration(a, b, call=rng.random() < call_fraction), TOOLS
    if kind == "practice":
        a, b = calculator.factors(rng, (rng.randint(2, 4), rng.randint(2, 3)))
        messages = calculator.demonstration(a, b, call=True)
        messages[0] = {"role": "user", "content": f"multiply {a} by {b}"}
        return messages, TOOLS
    if kind == "add":
        x, y = rng.randint(100, 999), rng.randint(100, 999)
        return [{"role": "user", "content": f"{x}+{y}="}, {"role": "assistant", "content": str(x + y)}], None
    word = _word(rng)
    return [{"role": "user", "content": f"reverse {word}"}, {"role": "assistant", "content": word[::-1]}], None


def calculator_eval(engine, tokenizer, n: int = 64) -> dict[str, float]:
    """Held-out calculator episodes, sampled at temperature 1: success and how often the tool is called."""
    from ..rollout import SamplingParams
    from ..trainer.episodes import EpisodeLimits, run_groups

    ds = calculator.dataset(tokenizer, batch_size=n, group_size=1, eval_size=n, seed=0)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=0)
    groups = run_groups(engine, ds.eval_batch(), params, EpisodeLimits(max_turns=3, max_model_len=512))
    trajectories = [t for g in groups for t in g.trajectories]
    called = [any(tr.metrics.get("tool_calls", 0) > 0 for tr in t.transitions) for t in trajectories]
    return {"success": sum(t.total_reward for t in trajectories) / n, "call_rate": sum(called) / n}


def addition_eval(engine, tokenizer, n: int = 64, history_chars: int = 0) -> float:
    """Greedy held-apart 3-digit additions in the chat template, after `history_chars` of earlier
    exchanges (a fixed draw of our own, not any recipe's text): the share answered exactly."""
    from ..rollout import SamplingParams
    from ..tasks.prompts import renderer_of

    rng, end = random.Random(12345), tokenizer.convert_tokens_to_ids("<|im_end|>")
    pairs = [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(n)]
    prompts = [
        renderer_of(tokenizer).prompt(history(rng, history_chars) + [{"role": "user", "content": f"{a}+{b}="}])
        for a, b in pairs
    ]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(end,))
    outs = engine.generate(prompts, 1, params)
    texts = [tokenizer.decode(o.token_ids, skip_special_tokens=True).strip() for [o] in outs]
    return sum(t == str(a + b) for t, (a, b) in zip(texts, pairs, strict=True)) / n


def init_from_base(model, base: str | Path) -> None:
    """Copy a checkpoint of the same architecture into `model`; where the vocabulary grew (the
    chat tokenizer appends its markers), the first rows."""
    from ..checkpoint import load_model

    src = dict(load_model(base).named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = src[name]
            if w.shape == p.shape:
                p.copy_(w)
            elif w.shape[1:] == p.shape[1:] and w.shape[0] < p.shape[0]:
                p[: w.shape[0]].copy_(w)
            else:
                raise ValueError(f"{base}: {name} has shape {list(w.shape)}, the chat model {list(p.shape)}")


def pretrain_chat(
    out: str | Path,
    seed: int = 0,
    batch: int = 64,
    max_steps: int = 1500,
    lr: float = 3e-3,
    call_fraction: float = 0.3,
    target_success: float = 0.15,
    min_steps: int = 100,
    eval_every: int = 50,
    init_from: str | None = "tiny-moe",
    history_fraction: float = 0.5,
    history_chars: int = 440,
    target_addition: float = 0.3,
) -> dict:
    from rich.progress import Progress

    from ..rollout import LocalEngine
    from .pretrain import pad_rows, supervised_step

    torch.manual_seed(seed)
    tokenizer = build_chat_tokenizer()
    model = new_model(tokenizer, TINY_QWEN3_MOE, seed)
    if init_from is not None:
        init_from_base(model, init_from)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    evals, start, last = [], time.perf_counter(), {}
    with Progress() as bar:
        job = bar.add_task("pretraining tiny MoE (chat)", total=max_steps)
        for step in range(1, max_steps + 1):
            rows = [
                chat_example(tokenizer, *_example(rng, call_fraction, history_fraction, history_chars))
                for _ in range(batch)
            ]
            loss = supervised_step(model, opt, *pad_rows(rows, tokenizer.pad_token_id), lr, step, max_steps)
            bar.update(job, advance=1, description=f"pretraining tiny MoE (chat)  loss {loss.item():.3f}  {last}")
            if step % eval_every == 0:
                model.eval()
                engine = LocalEngine(model, precision="fp32")
                last = {k: round(v, 3) for k, v in calculator_eval(engine, tokenizer).items()}
                last["addition"] = addition_eval(engine, tokenizer)
                last["addition_after_history"] = addition_eval(engine, tokenizer, history_chars=history_chars)
                model.train()
                evals.append({"step": step, "loss": loss.item(), **last})
                bar.console.log(evals[-1])
                if (
                    step >= min_steps
                    and last["success"] >= target_success
                    and last["addition_after_history"] >= target_addition
                ):
                    break
    model.eval()
    out = save(model, tokenizer, out)
    return {
        "steps": step,
        "seconds": time.perf_counter() - start,
        "call_fraction": call_fraction,
        "init_from": init_from,
        "history_fraction": history_fraction,
        "history_chars": history_chars,
        "history": evals,
    }
