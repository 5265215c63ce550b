"""A tiny MoE that can read a ledger: tiny-moe fine-tuned on ledger transcripts, the starting point
for measuring memory under a budget (`trillora.envs.ledger`, `trillora.context`).

Neither shipped model can answer "c?" even with every fact in view (tiny-moe 1.6%, tiny-moe-chat
3% greedy on 4 facts), so any memory would score noise. This builds the skill in two phases:

1. Content induction (`induction_rows`): 24 distinct characters, then 12 of them again, each to be
   followed by the character that followed it. Trained on ledger transcripts alone, the model
   never learns to look a key up: 3000 steps ended at 43.8%, and on bare "c=4 ... c?" pairs it
   stayed at chance for the first question (it learned to answer the last one by elimination).
   This phase forms the lookup circuit (a sudden drop after about 500 steps); it stops once the
   check batch is answered.
2. Full transcripts in the env's own token layout (the policy answers "ok" to each fact, then the
   digit), 1-8 facts with 0-3 distractors, the asked fact anywhere; loss on the policy's tokens
   only. With them, `memory_rows` rows per batch teach the memory's own actions (`memory_rows.py`:
   refills that keep the facts, "recall:" when a fact has left the context). It stops when greedy
   success on the held-out ledgers (6 facts, 3 distractors, whole context) and the share of
   held-out refill and recall rows answered whole reach the target.

The checkpoint is written where asked, not into the package:

    python -m trillora.tiny build-memory runs/tiny-moe-memory
"""

from __future__ import annotations

import importlib
import random
import time
from pathlib import Path

import torch

from ..checkpoint import load_model, load_tokenizer
from . import save
from .pretrain import pad_rows, supervised_step


def transcript(
    tokenizer, rng: random.Random, more_questions: bool = True, env_name: str = "ledger"
) -> tuple[list[int], list[int]]:
    """One episode as the env shows it (then, with `more_questions`, every other fact asked too), and
    which tokens are the policy's (1). `env_name`: the ledger or the registers (`memory_rows.EPISODES`)."""
    from ..envs.ledger import KEYS
    from ..tasks.prompts import encode_prompt
    from .memory_rows import EPISODES

    def text(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    facts = rng.randint(1, 8)
    lines, key, value = EPISODES[env_name](rng, facts)
    ok = text("ok") + [tokenizer.eos_token_id]
    ids = encode_prompt(tokenizer, "remember:\n")
    mask = [0] * len(ids)
    for shown in [f"\n{line}\n" for line in lines] + [f"\n{key}?"]:
        ids, mask = ids + ok + text(shown), mask + [1] * len(ok) + [0] * len(text(shown))
    answer = text(str(value)) + [tokenizer.eos_token_id]
    ids, mask = ids + answer, mask + [1] * len(answer)
    if not more_questions:
        return ids, mask
    # After the env's question (where its episode ends), every other fact is asked too, in random
    # order: one answer digit per row teaches recall too slowly; the first answer is conditioned
    # on exactly what the env shows, so nothing after it changes what is learned for it.
    kept = dict(part.split("=") for line in lines for part in line.split() if part[0] in KEYS)  # last writes
    for other in rng.sample(sorted(set(kept) - {key}), len(kept) - 1):
        asked, answer = text(f"\n{other}?"), text(kept[other]) + [tokenizer.eos_token_id]
        ids, mask = ids + asked + answer, mask + [0] * len(asked) + [1] * len(answer)
    return ids, mask


INDUCTION_CHARS = range(4, 66)
"""The tiny tokenizer's digits and letters (after its 4 special tokens)."""


def induction_rows(
    g: torch.Generator, batch: int, seen: int = 24, asked: int = 12
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, seen + 2·asked], target [B, same]): `seen` distinct characters, then `asked` pairs of
    one of them (not the last) and its successor. The target at each asked character is its
    successor (-100 elsewhere): only a lookup by content answers it, never a fixed offset."""
    lo, n = INDUCTION_CHARS.start, len(INDUCTION_CHARS)
    first = torch.stack([torch.randperm(n, generator=g)[:seen] + lo for _ in range(batch)])  # [B, seen]
    pick = torch.randint(0, seen - 1, (batch, asked), generator=g)
    query, successor = first.gather(1, pick), first.gather(1, pick + 1)  # [B, asked]
    ids = torch.cat([first, torch.stack([query, successor], 2).reshape(batch, 2 * asked)], 1)
    target = torch.full_like(ids, -100)
    target[:, seen::2] = successor
    return ids, target


def teach_induction(
    model, g: torch.Generator, lr: float, max_steps: int, batch: int = 64, on_step=lambda step, accuracy: None
) -> dict:
    """Phase 1: AdamW on `induction_rows` until a fresh batch is answered (greedy accuracy ≥ 0.98,
    checked every 100 steps) or `max_steps`; the steps taken and the last accuracy."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    accuracy, step = 0.0, 0
    for step in range(1, max_steps + 1):
        supervised_step(model, opt, *induction_rows(g, batch), lr, step, max_steps)
        on_step(step, accuracy)
        if step % 100 == 0 or step == max_steps:
            ids, target = induction_rows(g, 256)
            with torch.no_grad():
                model.eval()
                hit = model(ids).argmax(-1)[target != -100] == target[target != -100]
                model.train()
            accuracy = hit.float().mean().item()
            if accuracy >= 0.98:
                break
    return {"steps": step, "accuracy": accuracy}


def env_success(model, tokenizer, env_name: str = "ledger", n: int = 64) -> float:
    """Greedy success on held-out episodes of the env's default size (the ledger: 6 facts, 3
    distractors; the registers: 8 turns of 3 writes to 5) with the whole context in view."""
    from ..rollout import LocalEngine, SamplingParams
    from ..trainer.episodes import EpisodeLimits, run_groups

    engine = LocalEngine(model, precision="fp32")
    episodes = importlib.import_module(f"trillora.envs.{env_name}").dataset(tokenizer, 1, 1, n, 0).eval_batch()
    groups = run_groups(
        engine,
        episodes,
        SamplingParams(max_new_tokens=3, temperature=0.0, seed=0, stop_token_ids=(tokenizer.eos_token_id,)),
        EpisodeLimits(
            max_turns=max(len(e.lines) for e in episodes) + 2, max_model_len=model.args.max_position_embeddings
        ),
    )
    rewards = [r for g in groups for r in g.total_rewards()]
    return sum(rewards) / len(rewards)


def memory_action_rows(
    tokenizer, rng: random.Random, n: int, env_name: str = "ledger", refill_context: bool = False
) -> dict[str, list]:
    """`n` refill rows and `n` recall rows (`memory_rows`), each drawn from its own episodes."""
    from .memory_rows import recall_rows, refill_rows

    out = {"refill": [], "recall": []}
    while len(out["refill"]) < n:
        out["refill"] += rng.sample(
            rows := refill_rows(tokenizer, rng, env_name=env_name, refill_context=refill_context), min(2, len(rows))
        )
    while len(out["recall"]) < n:
        out["recall"] += recall_rows(tokenizer, rng, env_name=env_name)
    return {k: v[:n] for k, v in out.items()}


def rows_answered(model, rows: list, pad: int) -> float:
    """The share of rows whose every policy token is the greedy next token (teacher-forced)."""
    ids, target = pad_rows(rows, pad)
    with torch.no_grad():
        hit = (model(ids).argmax(-1) == target) | (target == -100)  # [B, T]
    return hit.all(-1).float().mean().item()


def pretrain_memory(
    out: str | Path,
    seed: int = 0,
    batch: int = 64,
    max_steps: int = 2000,
    lr: float = 3e-3,
    target_success: float = 0.8,
    eval_every: int = 100,
    init_from: str = "tiny-moe",
    induction_steps: int = 1500,
    memory_rows: int = 24,
    env_name: str = "ledger",
    refill_context: bool = False,
) -> dict:
    from rich.progress import Progress

    torch.manual_seed(seed)
    tokenizer, model = load_tokenizer(init_from), load_model(init_from)
    model.train()
    start = time.perf_counter()
    rng = random.Random(seed)
    history, last = [], 0.0
    with Progress() as bar:
        lookup = bar.add_task("teaching tiny MoE to look up", total=induction_steps)
        induction = teach_induction(
            model,
            torch.Generator().manual_seed(seed),
            lr,
            induction_steps,
            on_step=lambda step, accuracy: bar.update(
                lookup, completed=step, description=f"teaching tiny MoE to look up  accuracy {accuracy:.2f}"
            ),
        )
        induction["seconds"] = time.perf_counter() - start
        bar.console.print(f"lookup: {induction['accuracy']:.3f} after {induction['steps']} steps")
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
        job = bar.add_task(f"teaching tiny MoE the {env_name}", total=max_steps)
        held_out = (
            memory_action_rows(tokenizer, random.Random(f"held-out:{seed}"), 128, env_name, refill_context)
            if memory_rows
            else {}
        )
        for step in range(1, max_steps + 1):
            rows = [transcript(tokenizer, rng, env_name=env_name) for _ in range(batch - memory_rows)]
            if memory_rows:
                taught = memory_action_rows(tokenizer, rng, memory_rows // 2, env_name, refill_context)
                rows += taught["refill"] + taught["recall"]
            loss = supervised_step(model, opt, *pad_rows(rows, tokenizer.pad_token_id), lr, step, max_steps)
            bar.update(
                job,
                advance=1,
                description=f"teaching tiny MoE the {env_name}  loss {loss.item():.3f}  success {last:.2f}",
            )
            if step % eval_every == 0 or step == max_steps:
                model.eval()
                last = env_success(model, tokenizer, env_name)
                actions = {
                    f"{name}_accuracy": rows_answered(model, r, tokenizer.pad_token_id) for name, r in held_out.items()
                }
                model.train()
                history.append({"step": step, "loss": loss.item(), f"{env_name}_success": last, **actions})
                bar.console.print(
                    f"step {step}: loss {loss.item():.3f}, held-out {env_name} success {last:.3f}, {actions}"
                )
                if last >= target_success and all(a >= target_success for a in actions.values()):
                    break
    model.eval()
    out = save(model, tokenizer, out)
    return {
        "steps": step,
        "seconds": time.perf_counter() - start,
        "init_from": init_from,
        "env": env_name,
        "refill_context": refill_context,
        "induction": induction,
        "history": history,
    }
