"""The embedded tiny MoE: a Qwen3-MoE-architecture model with its own character tokenizer,
pretrained here (supervised, on generated data), shipped inside the package.

    python -m trillora.tiny build [OUT]     # pretrain and write the shipped checkpoint
    python -m trillora.tiny random OUT      # random weights, same architecture (tests)

Pretraining stops once greedy accuracy on held-out 3-digit addition reaches a target well
below mastery, so the model is *partly* competent at the RL task, while string reversal
(the "general" skill RL must not erase) is trained to near mastery.
"""

from __future__ import annotations

import argparse
import math
import random
import string
import time
from importlib import resources
from pathlib import Path

import torch

from .checkpoint import save_model
from .models import build_model, from_hf_config

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

TINY_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
)


MOE_KEYS = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
            "moe_intermediate_size")
TINY_QWEN3 = {**{k: v for k, v in TINY_QWEN3_MOE.items() if k not in MOE_KEYS},
              "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
"""The same shapes without experts: vLLM on CPU applies LoRA to dense models only."""


def build_tokenizer():
    """One token per character: arithmetic and short words need nothing more, and it is exact."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def write_random_checkpoint(out: str | Path, seed: int = 0, std: float = 0.05, dense: bool = False) -> Path:
    tokenizer = build_tokenizer()
    config = dict(
        TINY_QWEN3 if dense else TINY_QWEN3_MOE,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = build_model(from_hf_config(config, where="tiny config"), device="cpu")
    model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    out = save_model(model, out)
    tokenizer.save_pretrained(out)
    return out


def shipped_path() -> Path:
    """The checkpoint folder shipped with trillora (the default model)."""
    return Path(str(resources.files("trillora").joinpath("assets/tiny-moe")))


def _examples(tasks, weights, rng: random.Random, n: int, seed: int):
    from .tasks.base import in_eval_split

    out = []
    while len(out) < n:
        task = rng.choices(tasks, weights)[0]
        p = task.sample(rng)
        if not in_eval_split(p.prompt, task.eval_fraction):  # never train on held-out problems
            out.append((p.prompt, p.answer))
    return out


def pretrain(
    out: str | Path,
    seed: int = 0,
    batch: int = 128,
    max_steps: int = 6000,
    lr: float = 3e-3,
    target_accuracy: float = 0.4,
    eval_every: int = 50,
) -> dict:
    """Supervised pretraining on generated arithmetic, countdown and reversal (loss on answers only)."""
    from rich.progress import Progress

    from .evaluate import encode_prompt, evaluate
    from .rollout import LocalEngine, SamplingParams
    from .tasks import ArithmeticTask, CountdownTask, ReversalTask

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = dict(TINY_QWEN3_MOE, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = build_model(from_hf_config(config, where="tiny config"), device="cpu")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(seed))
    addition, reversal = ArithmeticTask(digits=3), ReversalTask()
    tasks, weights = [addition, reversal, CountdownTask()], [0.6, 0.25, 0.15]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    held_add = addition.problems("eval", 256, seed=12345)
    held_rev = reversal.problems("eval", 256, seed=12345)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    history, start, acc = [], time.perf_counter(), 0.0
    with Progress() as bar:
        job = bar.add_task("pretraining tiny MoE", total=max_steps)
        for step in range(1, max_steps + 1):
            pairs = _examples(tasks, weights, rng, batch, seed)
            seqs = [(encode_prompt(tokenizer, p), tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
                    for p, a in pairs]
            width = max(len(p) + len(a) for p, a in seqs)
            ids = torch.full((batch, width), tokenizer.pad_token_id)
            target = torch.full((batch, width), -100)
            for i, (p, a) in enumerate(seqs):
                ids[i, : len(p) + len(a)] = torch.tensor(p + a)
                target[i, len(p) - 1 : len(p) + len(a) - 1] = torch.tensor(a)
            warm = min(1.0, step / 200)
            for g in opt.param_groups:
                g["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / max_steps))
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            bar.update(job, advance=1, description=f"pretraining tiny MoE  loss {loss.item():.3f}  add acc {acc:.2f}")
            if step % eval_every == 0:
                model.eval()
                engine = LocalEngine(model, precision="fp32")
                acc = evaluate(engine, tokenizer, addition, held_add, greedy)
                rev = evaluate(engine, tokenizer, reversal, held_rev, greedy)
                model.train()
                history.append({"step": step, "loss": loss.item(), "addition_greedy": acc, "reversal_greedy": rev})
                if acc >= target_accuracy and rev >= 0.9:
                    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0, stop_token_ids=greedy.stop_token_ids)
                    history[-1]["addition_sampled_t1"] = evaluate(engine, tokenizer, addition, held_add, sampled)
                    break
    model.eval()
    out = save_model(model, out)
    tokenizer.save_pretrained(out)
    return {"steps": step, "seconds": time.perf_counter() - start, "history": history}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trillora.tiny", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="pretrain the tiny MoE and write it (default: the shipped folder)")
    b.add_argument("out", type=Path, nargs="?", default=None)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--max-steps", type=int, default=6000)
    r = sub.add_parser("random", help="random weights, same architecture and tokenizer")
    r.add_argument("out", type=Path)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dense", action="store_true", help="no experts (a dense Qwen3 of the same shapes)")
    args = parser.parse_args(argv)
    if args.command == "random":
        print(write_random_checkpoint(args.out, seed=args.seed, dense=args.dense))
        return 0
    out = args.out or Path(__file__).parent / "assets" / "tiny-moe"
    report = pretrain(out, seed=args.seed, max_steps=args.max_steps)
    (Path(out) / "pretrain_report.json").write_text(__import__("json").dumps(report, indent=2))
    print(f"wrote {out}: {report['steps']} steps, {report['seconds']:.0f} s, last eval {report['history'][-1:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
