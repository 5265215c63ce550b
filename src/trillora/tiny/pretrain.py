"""Supervised pretraining of the shipped tiny MoE on generated arithmetic, countdown and reversal.

Pretraining stops once greedy accuracy on held-out 3-digit addition reaches a target well
below mastery, so the model is *partly* competent at the RL task, while string reversal
(the "general" skill RL must not erase) is trained to near mastery.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from . import build_tokenizer, new_model, save, tiny_config


def _examples(tasks, weights, rng: random.Random, n: int, seed: int):
    from ..tasks.base import in_eval_split

    out = []
    while len(out) < n:
        task = rng.choices(tasks, weights)[0]
        p = task.sample(rng)
        if not in_eval_split(p.prompt, task.eval_fraction):  # never train on held-out problems
            out.append((p.prompt, p.answer))
    return out


def supervised_step(
    model, opt, ids: torch.Tensor, target: torch.Tensor, lr: float, step: int, max_steps: int
) -> torch.Tensor:
    """One AdamW step on next-token cross-entropy where `target` is not -100 (200 warmup steps, then
    cosine); the loss."""
    for g in opt.param_groups:
        g["lr"] = lr * min(1.0, step / 200) * 0.5 * (1 + math.cos(math.pi * step / max_steps))
    logits = model(ids)  # [B, T, V]
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def pad_rows(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], target [B, T]): right-padded rows and the next token where the policy wrote it."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad)
    target = torch.full((len(rows), width), -100)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        target[i, : len(row) - 1] = torch.tensor([t if m else -100 for t, m in zip(row[1:], mask[1:], strict=True)])
    return ids, target


def pretrain(
    out: str | Path,
    seed: int = 0,
    batch: int = 128,
    max_steps: int = 6000,
    lr: float = 3e-3,
    target_accuracy: float = 0.4,
    eval_every: int = 50,
    width: int = 128,
    tokens: int = 0,
) -> dict:
    """Supervised pretraining on generated arithmetic, countdown and reversal (loss on answers only).

    `tokens` = 0 (the shipped model): stop at the target accuracy. `tokens` > 0 (a family of
    widths, `tiny_config`): train for the steps that budget buys (rows of the mix have a fixed mean
    length) with no early stop; every size reads the same stream of rows, each as far as its budget."""
    from rich.progress import Progress

    from ..rollout import LocalEngine, SamplingParams
    from ..tasks import ArithmeticTask, CountdownTask, ReversalTask
    from ..tasks.prompts import encode_prompt
    from ..trainer.evaluate import evaluate

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = new_model(tokenizer, tiny_config(width), seed)
    addition, reversal = ArithmeticTask(digits=3), ReversalTask()
    tasks, weights = [addition, reversal, CountdownTask()], [0.6, 0.25, 0.15]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    held_add = addition.problems("eval", 256, seed=12345)
    held_rev = reversal.problems("eval", 256, seed=12345)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    history, start, acc, seen = [], time.perf_counter(), 0.0, 0
    if tokens:  # the budget sets the schedule's length: about this many steps of `batch` rows
        max_steps = max(1, math.ceil(tokens / (batch * _mean_row_tokens(tasks, weights, tokenizer))))
    with Progress() as bar:
        job = bar.add_task("pretraining tiny MoE", total=max_steps)
        for step in range(1, max_steps + 1):
            pairs = _examples(tasks, weights, rng, batch, seed)
            seqs = [
                (
                    encode_prompt(tokenizer, p),
                    tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                )
                for p, a in pairs
            ]
            rows = [(p + a, [0] * len(p) + [1] * len(a)) for p, a in seqs]  # the answer trained
            loss = supervised_step(model, opt, *pad_rows(rows, tokenizer.pad_token_id), lr, step, max_steps)
            seen += sum(len(p) + len(a) for p, a in seqs)
            bar.update(job, advance=1, description=f"pretraining tiny MoE  loss {loss.item():.3f}  add acc {acc:.2f}")
            if step % eval_every == 0 or step == max_steps:
                model.eval()
                engine = LocalEngine(model, precision="fp32")
                acc = evaluate(engine, tokenizer, addition, held_add, greedy)
                rev = evaluate(engine, tokenizer, reversal, held_rev, greedy)
                model.train()
                history.append({"step": step, "loss": loss.item(), "addition_greedy": acc, "reversal_greedy": rev})
                if not tokens and acc >= target_accuracy and rev >= 0.9:
                    sampled = SamplingParams(
                        max_new_tokens=8, temperature=1.0, seed=0, stop_token_ids=greedy.stop_token_ids
                    )
                    history[-1]["addition_sampled_t1"] = evaluate(engine, tokenizer, addition, held_add, sampled)
                    break
    model.eval()
    out = save(model, tokenizer, out)
    return {"steps": step, "tokens": seen, "width": width, "seconds": time.perf_counter() - start, "history": history}


def _mean_row_tokens(tasks, weights, tokenizer, n: int = 2000) -> float:
    """Mean tokens of a training row (prompt, answer, stop), from a fixed sample of the mix."""
    from ..tasks.prompts import encode_prompt

    rng = random.Random(0)
    rows = [rng.choices(tasks, weights)[0].sample(rng) for _ in range(n)]
    return (
        sum(
            len(encode_prompt(tokenizer, p.prompt))
            + len(tokenizer(p.answer, add_special_tokens=False)["input_ids"])
            + 1
            for p in rows
        )
        / n
    )
