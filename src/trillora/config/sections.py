"""The run configuration's sections: typed dataclasses, each owned by the component it configures,
with `Literal` choices taken from the modules that define them, validated once at startup."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import ConfigError
from ..lora.config import LoraConfig
from ..parallel.dims import ParallelDims
from ..rl.advantages import AdvantageMode
from ..rl.aggregation import Aggregation
from ..rl.kl import KLEstimator
from ..rl.mismatch import MismatchMode
from ..rollout.types import EngineName, Precision, SyncMode
from ..tasks.guard import OnRewardError
from .checks import check_fields
from .learn import LearnSection

RouterReplayMode = Literal["off", "all", "old"]
"""Which training passes route tokens to the experts the rollout chose (`trillora.trainer.router_replay`)."""


FFN_TARGETS = ("mlp", "shared_experts", "experts")


def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is invalid; allowed: {', '.join(allowed)}")


@dataclass(kw_only=True, frozen=True)
class ModelSection:
    path: str = "tiny-moe"
    """A Hugging Face checkpoint folder, or `tiny-moe` for the model shipped with trillora."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer weights; the CPU computes in fp32 (bf16 matrix products are ~150x slower there)."""
    trust_remote_code: bool = False
    """Run a checkpoint's tokenizer code (`auto_map` in tokenizer_config.json, e.g. Kimi K2's
    tiktoken tokenizer). The model itself never runs remote code: trillora has its own."""


@dataclass(kw_only=True, frozen=True)
class TaskSection:
    name: str = "arithmetic"
    """A built-in task, "env" (user envs: `options.env`), or "traces" (what `serve --record` recorded:
    `options.store`; trained as `serve --learn` would, offline: `trainer.offline`)."""
    options: dict = field(default_factory=lambda: {"digits": 3})
    """Keyword arguments of the task (e.g. digits, ops; path and reward_fn for jsonl)."""
    retention: str = "auto"
    """A second task scored before and after to check RL did not erase it; "" for none. "auto":
    `reversal` when a shipped tiny model (pretrained on it) learns another built-in task, none
    otherwise (a user's dataset or envs, a model of one's own: nothing there is known to keep;
    `trainer.evaluate.retention_task`)."""
    eval_problems: int = 512
    """Held-out problems (or env groups) scored before training, every `eval_every` steps and at the end."""
    eval_samples: int = 2
    """Samples per held-out problem; the accuracy is their mean reward."""
    max_turns: int = 8
    """With `name = "env"`: turns an episode may take before it is cut (counted, `episodes_max_turns`)."""
    reward_timeout: float = 30.0
    """Seconds one reward call may take (0 = no limit); see `trillora.tasks.guard`."""
    on_reward_error: OnRewardError = "fail"
    """A reward that raises, hangs or returns a non-finite value: "fail" stops the run with the
    traceback (the last checkpoint stays), "zero" scores it 0 and counts it (`reward_failures`)."""

    def validate(self) -> None:
        from ..tasks import TASKS

        _check_choice("task.name", self.name, (*TASKS, "env", "traces"))
        check_fields(self, "task.", "max_turns eval_problems eval_samples", zero_ok="reward_timeout")
        if self.retention:
            _check_choice("task.retention", self.retention, ("auto", *TASKS))


@dataclass(kw_only=True, frozen=True)
class RolloutSection:
    engine: EngineName = "local"
    """`local`: the built-in engine in this process; `vllm`: vLLM's LLM in this process;
    `openai`: OpenAI-compatible servers at `urls` (vLLM, SGLang, `trillora serve`)."""
    sync: SyncMode = "auto"
    """Weight sync after each update. `adapter`: a new LoRA revision; `merged`: base + B·A of the
    tensors the adapter changes. auto: adapter, except merged for vLLM on MoE without GPU LoRA."""
    urls: tuple[str, ...] = ()
    server_model: str = ""
    """The base model's name on the servers; defaults to model.path."""
    api_key: str = ""
    sync_dir: str = ""
    """Where adapters are written for the servers to load; defaults to <run dir>/sync."""
    precision: Precision = "auto"
    """local engine weights: a merged copy of the policy, `auto` (bf16 on GPU, bf16-rounded fp32 on
    CPU), fp32, bf16_weights or bf16; or `policy`, the policy itself with its adapters unmerged (no
    copy; what `auto` means under torchrun, where every rank decodes its shard). vllm: auto (bf16 on
    GPU, fp32 on CPU), fp32, bf16."""
    max_model_len: int = 0
    """The longest prompt + completion (every engine; vllm plans its KV cache for it). 0: the
    model's own positions (`max_position_embeddings`); more than those is refused."""
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    asynchronous: bool = False
    """Sample the next steps' batches in a thread while the trainer learns (`rollout.async_worker`)."""
    max_staleness: int = 1
    """With `asynchronous`: a batch is sampled by a policy at most this many updates old."""

    def validate(self) -> None:
        if self.engine == "openai" and not self.urls:
            raise ConfigError("rollout.engine='openai' needs rollout.urls (e.g. [\"http://127.0.0.1:8000\"])")
        if self.engine == "local" and self.sync not in ("auto", "merged"):
            raise ConfigError(
                f"rollout.sync={self.sync!r} with rollout.engine='local': the local engine syncs merged weights"
            )
        if self.engine == "vllm" and self.precision in ("bf16_weights", "policy"):
            raise ConfigError(
                f"rollout.precision={self.precision!r} is for the local engine; vllm takes auto, fp32 or bf16"
            )
        check_fields(self, "rollout.", "prompts_per_step group_size max_new_tokens", "max_model_len max_staleness")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature} is invalid; RL samples need > 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} is invalid; must be in (0, 1]")


@dataclass(kw_only=True, frozen=True)
class AlgorithmSection:
    advantage: AdvantageMode = "grpo"
    normalize_std: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: Aggregation = "token_mean"
    epochs: int = 1
    """Passes over each batch; with epochs × minibatches > 1 the policy moves within the batch, so
    the logprobs before the first step are computed first (the proximal policy of the clip)."""
    minibatches: int = 1
    """Each pass over the batch is cut into this many minibatches with one AdamW step each (PPO's
    minibatches: verl's ppo_mini_batch_size, TRL's steps_per_generation); `parallel.micro_batch_rows`
    accumulates gradients within one."""
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    mismatch: MismatchMode = "token_tis"
    mismatch_cap: float = 2.0
    mismatch_band: tuple[float, float] = (0.5, 2.0)
    router_replay: RouterReplayMode = "off"
    """Route training tokens to the experts the rollout chose: "all" passes (R3), only the "old"
    logprob pass, or "off" (`trillora.trainer.router_replay`). Needs the engine's routing:
    rollout.engine="local" (or "vllm" on a GPU)."""
    routing_metrics: bool = False
    """Record the rollout's routing and log how often the trainer routes elsewhere, without replay
    (on whenever router_replay is)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and sample more prompts to fill the batch (DAPO)."""
    max_sampling_rounds: int = 3
    """With dynamic sampling: rounds of `prompts_per_step` prompts per step at most; a batch still
    short after them is filled with uninformative groups (zero advantage, no gradient)."""

    def validate(self) -> None:
        positive = "max_sampling_rounds epochs minibatches mismatch_cap"
        check_fields(self, "algorithm.", positive, zero_ok="clip_low clip_high kl_coef entropy_coef")
        low, high = self.mismatch_band
        if not 0 < low < 1 < high:
            raise ConfigError(f"algorithm.mismatch_band={list(self.mismatch_band)} is invalid; need 0 < low < 1 < high")


@dataclass(kw_only=True, frozen=True)
class OptimSection:
    lr: float = 1e-3
    """Why 1e-3 for the default job (and what 2e-3 costs): `benchmarks/default_job.py` and the README."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    """AdamW's denominator floor. Adam divides by sqrt(v), so for a gradient near 0 a tiny eps turns
    rounding (e.g. a different summation order across ranks) into a sizeable step; a larger one
    (the parallel tests use 1e-6) damps that, at the cost of smaller steps for small gradients."""
    grad_clip: float = 1.0
    warmup_steps: int = 5
    max_nonfinite_in_a_row: int = 5
    """An update whose loss or gradient is not finite is skipped (logged as `skipped_update`); after
    this many in a row the run saves a checkpoint and stops (0 = never stop)."""

    def validate(self) -> None:
        check_fields(self, "optim.", "lr eps", zero_ok="max_nonfinite_in_a_row grad_clip")


@dataclass(kw_only=True, frozen=True)
class ParallelSection(ParallelDims):
    """Layout under torchrun: the fields of `trillora.parallel.ParallelDims` (documented there; dp = 0,
    the default here, is whatever the world leaves after tp × pp × cp), and how the trainer uses it."""

    dp: int = 0
    auto: bool = False
    """Let the planner pick dp, tp, ep, pp, cp, sp and activation checkpointing for the world size
    (`parallel = "auto"` in TOML is the same); the other degrees are then ignored."""
    micro_batch_rows: int = 0
    """Rows per forward + backward on each data-parallel rank, gradients accumulated over a minibatch
    (0 = the whole minibatch at once; 1 under `auto`, as the planner assumes). Under pp the
    pipeline's own microbatches (`pp_microbatches`) play this part."""
    share_prompts: bool = True
    """Run each group's prompt once in the training passes, its G completions attending to its keys
    (`trillora.policy.logprobs.shared_prompt_logprobs`); used where a (micro)batch holds whole groups
    and there is no pp, cp or sp. Off: whole rows, every prompt G times."""

    def validate(self) -> None:
        check_fields(self, "parallel.", zero_ok="micro_batch_rows")  # the degrees: __post_init__


@dataclass(kw_only=True, frozen=True)
class CheckpointSection:
    """Training checkpoints under `runs/<name>/checkpoints/` (`trillora.checkpoint.train_state`)."""

    every: int = 25
    """Save every this many steps (0 = only at the end); always at the end and on SIGTERM / Ctrl-C."""
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted after a newer one is in place."""
    resume_from: str = ""
    """Start from a saved adapter state instead of step 0 (when this run has no checkpoint of its
    own to resume): a Tinker client's `save_state` (`<state_dir>/<model id, ":" as "_">/weights/<name>`
    of `trillora serve --tinker`), at the step its AdamW steps make (÷ minibatches × epochs), or a
    checkpoint folder of another one-process run, at its step. Its LoRA settings must be this run's."""

    def validate(self) -> None:
        check_fields(self, "checkpoint.", "keep", zero_ok="every")
        if not isinstance(self.resume_from, str):
            raise ConfigError(f"checkpoint.resume_from={self.resume_from!r}: a folder path, as a string")


TRACKERS = ("tensorboard", "wandb")


@dataclass(kw_only=True, frozen=True)
class LoggingSection:
    """Where each step's metrics go besides `runs/<name>/metrics.jsonl` (always written)."""

    backends: tuple[str, ...] = ()
    """Any of "tensorboard" (event files in `runs/<name>/tensorboard/`) and "wandb" (online when
    `WANDB_API_KEY` is set, otherwise offline under `runs/<name>/wandb/`); the `tracking` extra."""
    project: str = "trillora"
    """The W&B project."""
    every: int = 10
    """Print a line of the step's metrics to the console every this many steps (0: the progress bar only)."""
    plot_seconds: float = 60.0
    """Redraw the run's PNG plots after a step once this many seconds passed since the last drawing
    (0: after every step); they are drawn at the end of a run and when it stops in any case."""

    def validate(self) -> None:
        check_fields(self, "logging.", zero_ok="every plot_seconds")
        for b in self.backends:
            if b not in TRACKERS:
                raise ConfigError(
                    f"logging.backends: {b!r} is not a backend; allowed: {', '.join(TRACKERS)} "
                    "(metrics.jsonl is always written)"
                )


@dataclass(kw_only=True, frozen=True)
class MemorySection:
    """The context a multi-turn episode keeps when its whole history would not fit (`trillora.context`)."""

    policy: Literal["none", "truncate", "retrieval", "summary", "diffusion"] = "none"
    """"truncate": drop the oldest turns (the task, the first observation, stays); "retrieval":
    truncate, and answer a turn starting "recall:" with the dropped chunk that best matches it
    (BM25); "summary": the policy summarises the context after every turn; "diffusion": Memory Diffusion (mask ->
    allocate -> refill by the policy). Summaries and refills are trained with the episode's reward."""
    budget: int = 0
    """Tokens the policy may see at once, its next turn included; at most `rollout.max_model_len`."""
    span_tokens: int = 0
    """Chunk each turn into spans of this many tokens (0: whole turns)."""
    span_words: bool = True
    """Spans end between words where one fits (a fact like "c=4" stays whole); False: every `span_tokens`."""
    importance: Literal["policy", "attention", "surprise", "recency"] = "policy"
    """diffusion: how a chunk's importance is estimated (the policy's leave-one-out scoring, the attention
    the latest turn pays it, the surprise of its tokens, or recency)."""
    allocate: Literal["proportional", "top_k", "threshold"] = "proportional"
    """diffusion: how the budget is shared among the masked chunks by importance."""
    floor: float = 0.0
    """diffusion, allocate = "threshold": chunks less important than this are dropped."""
    keep_recent: int = 1
    """diffusion: the latest turns kept verbatim."""
    min_refill: int = 0
    """diffusion: no chunk is refilled in fewer tokens; one under it is dropped and the budget shared again."""
    refill_context: bool = False
    """diffusion: a refill's prompt also holds the context after its chunk (what later turns wrote), not
    only the task and the chunk, so it can tell what was superseded."""
    summary_tokens: int = 32
    """summary: the longest summary the policy may write."""

    def validate(self, max_new_tokens: int, max_model_len: int) -> None:
        if self.policy == "none":
            return
        check_fields(self, "memory.", "keep_recent summary_tokens", zero_ok="span_tokens min_refill")
        if not max_new_tokens < self.budget <= (max_model_len or self.budget):
            raise ConfigError(
                f"memory.budget={self.budget}: it must be over rollout.max_new_tokens ({max_new_tokens}) "
                f"and at most rollout.max_model_len ({max_model_len or 'the model positions'})"
            )


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    name: str = "default"
    out_dir: str = "runs"
    steps: int = 150
    seed: int = 0
    eval_every: int = 25
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: ModelSection = field(default_factory=ModelSection)
    flops_budget: float = 0.0
    """Stop after the step whose cumulative FLOPs (`flops_total`) reach this (0: run `steps` steps);
    that step is evaluated and the run finishes as usual: runs matched on compute, not steps."""
    finetune: Literal["lora", "full"] = "lora"
    """What the update trains: the adapters of `[lora]`, or every weight of the model ("full":
    full-parameter RL, the other arm of a compute-matched comparison; one process, the local
    engine, no KL term, and the run exports `model/` instead of `adapter/`)."""
    lora: LoraConfig = field(default_factory=lambda: LoraConfig(rank=8, alpha=16.0, targets=FFN_TARGETS))
    """The default job adapts the feed-forward side (dense MLPs, shared and routed experts); with
    attention adapters too it gained a little more on one seed at the same retention (README)."""
    task: TaskSection = field(default_factory=TaskSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    memory: MemorySection = field(default_factory=MemorySection)
    learn: LearnSection = field(default_factory=LearnSection)
    resume: bool = False
    """Continue from the newest complete checkpoint of this run (`--resume` on the command line);
    without it a run starts afresh and moves an earlier run's checkpoints to `checkpoints.previous`."""
    deterministic: bool = False
    """Deterministic kernels only (`torch.use_deterministic_algorithms`); with a fixed seed an
    interrupted and resumed run ends with the same adapter, bit for bit, as an uninterrupted one."""

    def validate(self) -> TrainConfig:
        check_fields(self, "", "steps eval_every", zero_ok="flops_budget")
        for name in ("task", "rollout", "algorithm", "optim", "parallel", "checkpoint", "logging", "learn"):
            getattr(self, name).validate()
        a, r = self.algorithm, self.rollout
        self.memory.validate(r.max_new_tokens, r.max_model_len)
        if self.finetune == "full" and (r.engine != "local" or a.kl_coef > 0):
            raise ConfigError(
                f"finetune='full' trains every weight: it needs rollout.engine='local' (got {r.engine!r}; "
                f"the others sync adapters) and algorithm.kl_coef=0 (got {a.kl_coef}; the reference "
                f"would be a second frozen copy of the model)"
            )
        if self.memory.policy != "none" and self.task.name != "env":
            raise ConfigError("memory.policy needs multi-turn episodes: task.name='env'")
        if (a.router_replay != "off" or a.routing_metrics) and r.engine == "openai":
            raise ConfigError(
                "algorithm.router_replay / routing_metrics need the experts the engine chose per token; "
                "rollout.engine='openai' does not return them: use rollout.engine='local' (or 'vllm' on a GPU)"
            )
        if self.task.name == "env" and (a.dynamic_sampling or a.router_replay != "off" or a.routing_metrics):
            raise ConfigError(
                "task.name='env' does not combine yet with algorithm.dynamic_sampling or router replay "
                "(they sample single-turn batches)"
            )
        if r.asynchronous and a.dynamic_sampling:
            raise ConfigError(
                "rollout.asynchronous samples each step's batch ahead, so it takes no "
                "algorithm.dynamic_sampling (which samples more when a batch falls short)"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name
