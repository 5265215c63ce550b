"""TRL's GRPOTrainer set up to do the work a trillora `TrainConfig` describes, for the side-by-side
benchmarks (`grpo_vs_trl.py`, `time_to_accuracy.py`). TRL is installed for them only
(`pip install -e '.[bench]'`).

Every setting both trainers have is taken from the trillora config, so "the same work" holds by
construction: prompts per step × group size as one generation batch and one optimizer step per
batch, completion length, sampling, learning rate and warm-up, AdamW, gradient clipping, the PPO
clip range (clip-higher), group-normalised advantages, the token-mean loss over the batch (TRL's
`dapo`), the KL coefficient, LoRA rank/alpha and targets (routed experts through PEFT's
`target_parameters` on transformers 5's stacked expert tensors). What differs by design: TRL's
rollouts come from the training model through transformers `generate` (no rollout/training mismatch
to correct); trillora samples with its own engine on bf16-rounded weights and applies token TIS.
PEFT gives gate and up one shared rank-r A over `gate_up_proj`; trillora keeps one each.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback

from trillora.checkpoint import resolve_model_path
from trillora.config import TrainConfig

warnings.filterwarnings("ignore", message="TRL currently supports vLLM")  # TRL uses no vLLM here

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


class StepClock(TrainerCallback):
    """Times each optimizer step; every `every` steps pauses the clock to evaluate the model."""

    def __init__(self, evaluate=None, every: int = 0):
        self.evaluate, self.every = evaluate, every
        self.step_seconds: list[float] = []
        self.points: list[tuple[int, float, float]] = []  # (step, training seconds, held-out accuracy)
        self.elapsed, self.last = 0.0, 0.0

    def on_train_begin(self, args, state, control, model=None, **kw):
        if self.evaluate is not None:
            self.points.append((0, 0.0, self.evaluate(model)))
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kw):
        now = time.perf_counter()
        self.step_seconds.append(now - self.last)
        self.elapsed += now - self.last
        if self.evaluate is not None and state.global_step % self.every == 0:
            self.points.append((state.global_step, self.elapsed, self.evaluate(model)))
        self.last = time.perf_counter()  # evaluation time is not training time


def peft_config(cfg: TrainConfig):
    from peft import LoraConfig

    roles = set(cfg.lora.targets)
    unknown = roles - {"attention", "experts", "mlp", "shared_experts"}
    if unknown or cfg.lora.patterns:
        raise ValueError(f"lora targets {sorted(unknown) or list(cfg.lora.patterns)} have no TRL mapping here")
    modules = ATTENTION if "attention" in roles else []
    params = EXPERTS if "experts" in roles else []
    return LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        use_rslora=cfg.lora.rslora,
        target_modules=modules,
        target_parameters=params,
    )


def grpo_config(cfg: TrainConfig, out_dir: Path, steps: int):
    from trl import GRPOConfig

    r, a, o = cfg.rollout, cfg.algorithm, cfg.optim
    if a.aggregation != "token_mean" or a.epochs != 1 or a.minibatches != 1 or a.advantage != "grpo":
        raise ValueError("the TRL side maps GRPO advantages, token-mean loss, one pass of one minibatch only")
    return GRPOConfig(
        output_dir=str(out_dir),
        max_steps=steps,
        seed=cfg.seed,
        use_cpu=cfg.device != "cuda",
        bf16=cfg.model.dtype == "bfloat16",
        per_device_train_batch_size=r.prompts_per_step * r.group_size,
        gradient_accumulation_steps=1,
        num_generations=r.group_size,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        learning_rate=o.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=o.warmup_steps,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        max_grad_norm=o.grad_clip,
        beta=a.kl_coef,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        loss_type="dapo",
        scale_rewards="group" if a.normalize_std else "none",
        num_iterations=1,
        router_aux_loss_coef=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )


def make_trainer(cfg: TrainConfig, rows: list[dict], reward, out_dir: Path, steps: int, callbacks=()):
    """`rows`: dataset rows with a `prompt` (text, BOS spelled out) and whatever `reward` reads."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    torch.manual_seed(cfg.seed)
    path = resolve_model_path(cfg.model.path)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=grpo_config(cfg, out_dir, steps),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config(cfg),
        callbacks=list(callbacks),
    )
    trainer.remove_callback(PrinterCallback)  # the log dict of every step; the benchmark prints a table
    return trainer


def exact_match_reward(prompts, completions, answer, **_):
    """TRL's reward signature around the same function the trillora side scores with."""
    from trillora.tasks.rewards import exact_match

    return [exact_match(c, {"answer": a}) for c, a in zip(completions, answer, strict=True)]


def completion_lengths(trainer) -> list[float]:
    """Mean completion tokens of each logged step."""
    return [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
