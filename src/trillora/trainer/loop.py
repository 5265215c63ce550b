"""The RL loop, the same on every rank: sample → advantages → update → engine sync → log, checkpoint.

    for step:  rollout = world.share(sampler.sample(step))    rank 0 samples, every rank gets it
               advantages = rl.group_advantages(rewards)      once, for every rank
               metrics = update(batch)                        minibatches: `policy.forward_backward`,
                                                              `optim_step` (`update`)
               policy.publish(engine)                         every rank joins the adapter gather
               log, evaluate (rank 0); checkpoint (all ranks)

Under torchrun the local engine is the sharded policy itself: while rank 0 samples or evaluates,
the other ranks decode their parts with it (`Policy.sample`, `policy.decoding`).

The math lives in `trillora.rl`; the parts of a step in the modules named after them.
Shape legend: P prompts per step, G group size, B = P·G rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch.profiler import record_function

from .. import lora, rl
from ..checkpoint import check_tokenizer_fits, load_model, load_tokenizer
from ..checkpoint.atomic import FolderLock
from ..config import TrainConfig, to_toml
from ..envs.env_dataset import load_env_dataset
from ..errors import ConfigError, TrainingDiverged
from ..policy import adamw
from ..policy.decoding import LockstepEngine
from ..policy.policy import Policy
from ..policy.world import World, launched, pick_device
from ..tasks import make_task
from ..tasks.guard import GuardedReward
from ..tasks.prompts import encode_problem
from .checkpoints import RunCheckpoints
from .engine import check_engine, make_engine
from .evaluate import evaluate, evaluate_envs, retention_task
from .flops import ModelFlops
from .outputs import export, export_dir, write_summary
from .report import RunReport, console_line
from .sampler import Sampler
from .signals import StopSignal
from .tracking import Trackers
from .update import PolicyUpdate, check_rows


def fit_context(cfg: TrainConfig, positions: int) -> TrainConfig:
    """`rollout.max_model_len` resolved against the model: 0 takes its positions; more is refused
    (vLLM would refuse to start, the local engine would run past what the model was trained on)."""
    r = cfg.rollout
    if r.max_model_len > positions:
        raise ConfigError(
            f"rollout.max_model_len={r.max_model_len} is over the model's {positions} positions "
            f"({cfg.model.path}: max_position_embeddings); set it to at most {positions}, or 0 for all"
        )
    if r.max_model_len == 0:
        return dataclasses.replace(cfg, rollout=dataclasses.replace(r, max_model_len=positions))
    return cfg


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.console = Console(stderr=True, soft_wrap=True)  # paths stay on one line
        torch.manual_seed(cfg.seed)
        if cfg.deterministic:  # before any kernel runs; cuBLAS needs its workspace fixed for this
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        check_engine(cfg)
        self.device = pick_device(cfg.device)
        self.tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.model = load_model(cfg.model.path, dtype=dtype, device=self.device)
        check_tokenizer_fits(self.tokenizer, self.model.args.vocab_size, cfg.model.path)
        self.cfg = cfg = fit_context(cfg, self.model.args.max_position_embeddings)
        if cfg.finetune == "full" and launched():
            raise ConfigError("finetune='full' runs in one process: torchrun's layouts shard and sync adapters only")
        if cfg.finetune == "lora":
            lora.apply_lora(self.model, cfg.lora)
        self.flops = ModelFlops.of(self.model)  # counted unsharded, before any parallel plan applies
        self.flops_total = 0.0  # the run's so far, on every rank (all of them decide alike when the budget is spent)
        self.world = World.start(self.model, cfg.parallel, self.device, plan=self._planned, auto=cfg.parallel.auto)
        # `full`: the unsharded adapter the export and an external engine read: the model itself in one
        # process; under torchrun rank 0's skeleton of it, the base on the meta device (no copy)
        self.full = (
            self.model
            if not launched()
            else lora.adapter_skeleton(self.model, self.device)
            if self.world.main and cfg.finetune == "lora"
            else None
        )
        self.world.unsharded(self.model, self.full)  # the initial adapter in the skeleton
        o = cfg.optim
        named = dict(lora.trained_parameters(self.model))
        opt = adamw(named.values(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        self.policy = Policy(self.model, self.world, named, opt, self.full)
        self.update = PolicyUpdate(self.policy, cfg)
        check_rows(cfg, self.world)
        t, r = cfg.task, cfg.rollout
        # a task (single-turn, built in or JSONL) or user envs (`task.name = "env"`), both sampled as envs
        self.envs = (
            load_env_dataset(
                t.options,
                tokenizer=self.tokenizer,
                batch_size=r.prompts_per_step,
                group_size=r.group_size,
                eval_size=t.eval_problems,
                seed=cfg.seed,
            )
            if t.name == "env"
            else None
        )
        self.task = make_task(t.name, **t.options) if self.envs is None else None
        retention = retention_task(cfg)
        self.retention = make_task(retention) if retention else None
        self._check_dataset()
        # rewards are user code: time-limited, failures counted (an env's own steps are guarded as episodes run)
        self.reward = GuardedReward(self.task, t.reward_timeout, t.on_reward_error) if self.task is not None else None
        self.retention_reward = (
            GuardedReward(self.retention, t.reward_timeout, t.on_reward_error) if self.retention else None
        )
        self.eval_problems = self.task.problems("eval", t.eval_problems, seed=cfg.seed) if self.task is not None else []
        self.retention_problems = (
            self.retention.problems("eval", t.eval_problems, seed=cfg.seed) if self.retention else []
        )
        routing = cfg.algorithm.router_replay != "off" or cfg.algorithm.routing_metrics
        pad = self.tokenizer.pad_token_id or 0
        if launched() and cfg.rollout.engine == "local":  # every rank decodes its shard
            if routing and self.world.dims.pp > 1:
                raise ConfigError(
                    "algorithm.router_replay / routing_metrics with parallel.pp > 1 and the local engine: "
                    "each pipeline rank sees its own layers' routing; serve vLLM and use "
                    "rollout.engine='openai', or pp=1"
                )
            self.engine = LockstepEngine(self.model, self.world, pad)
        else:
            self.engine = make_engine(cfg, self.full, self.device, pad, routing) if self.world.main else None
        self.sampler = Sampler(
            cfg, self.engine, self.tokenizer, self.task, self.reward, self.device, routing, self.envs, self.flops
        )

    @property
    def reward_failures(self) -> int:
        """Reward calls scored 0 for an error so far (`task.on_reward_error="zero"`)."""
        return self.reward.failures if self.reward is not None else 0

    def _check_dataset(self) -> None:
        """Dataset prompts must leave room for the completion in the engine's context."""
        if not hasattr(self.task, "limit_prompt_tokens"):
            return
        r = self.cfg.rollout
        self.task.limit_prompt_tokens(
            lambda problem: len(encode_problem(self.tokenizer, problem)),
            r.max_model_len - r.max_new_tokens,
            f"rollout.max_model_len={r.max_model_len} - rollout.max_new_tokens={r.max_new_tokens}",
        )
        if self.task.skipped and self.world.main:
            self.console.print(
                f'[yellow]{len(self.task.skipped)} dataset rows skipped[/] (bad_rows="skip"); '
                f"first: {self.task.skipped[0]}"
            )

    def _planned(self, world: int):
        """`parallel.auto`: the planner's layout for `world` ranks."""
        from ..plan.planner import auto_dims

        c, r = self.cfg, self.cfg.rollout
        rows = r.prompts_per_step * r.group_size
        return auto_dims(self.model.args, c.lora, world, r.max_model_len, rows, c.algorithm.minibatches, self.device)[0]

    def sync_engine(self) -> dict[str, float]:
        """Bring the engine up to date (every rank joins the adapter gather; rank 0 syncs)."""
        return self.policy.publish(self.engine)

    def _set_lr(self, step: int) -> float:
        o = self.cfg.optim
        lr = o.lr * min(1.0, (step + 1) / max(1, o.warmup_steps))
        self.policy.set_lr(lr)
        return lr

    def evaluate(self, task, problems) -> float:
        params = dataclasses.replace(self.sampler.params, seed=4242)
        score = self.reward if task is self.task else self.retention_reward
        worker = self.sampler.worker
        with worker.lock if worker is not None else contextlib.nullcontext():  # the engine is shared
            return evaluate(
                self.engine, self.tokenizer, task, problems, params, n=self.cfg.task.eval_samples, score=score
            )

    def _evaluate_all(self) -> tuple[float, float | None]:
        if self.envs is not None:  # the mean return of the held-out groups' episodes
            params = dataclasses.replace(self.sampler.params, seed=4242)
            accuracy = evaluate_envs(self.engine, list(self.envs.eval_batch()), params, self.sampler.limits)
        else:
            accuracy = self.evaluate(self.task, self.eval_problems)
        return accuracy, self.evaluate(self.retention, self.retention_problems) if self.retention else None

    def step(self, step: int) -> dict[str, float]:
        """One RL step on every rank; rank 0's row of metrics (others get the update's)."""
        t0 = time.perf_counter()
        lr = self._set_lr(step)
        failures = self.reward_failures
        with record_function("trillora.rollout"):
            rollout = self.world.share(self.policy.sample(self.engine, lambda: self.sampler.sample(step)))
        t1 = time.perf_counter()
        with record_function("trillora.update"):
            a = self.cfg.algorithm
            advantages = rl.group_advantages(rollout.rewards, a.advantage, a.normalize_std).reshape(-1)  # [P·G]
            advantages = advantages[rollout.trajectory_of.to(advantages.device)]  # [B]: each row its trajectory's
            metrics = self.update(dataclasses.replace(rollout.tokens, advantages=advantages))
            metrics["flops_train"] = self.flops.train_step(
                rollout.row_lengths, a.epochs, self.update.proximal_pass, self.update.reference_pass
            )
            self.flops_total += rollout.stats.get("flops_rollout", 0.0) + metrics["flops_train"]
            metrics["flops_total"] = self.flops_total
        t2 = time.perf_counter()
        with record_function("trillora.sync"):
            worker = self.sampler.worker
            metrics.update(worker.synced(self.sync_engine) if worker is not None else self.sync_engine())
        row = {
            "step": step + 1,
            "lr": lr,
            **rollout.stats,
            "rollout_seconds": t1 - t0,
            "update_seconds": t2 - t1,
            **metrics,
        }
        if self.reward_failures > failures:  # rewards scored 0 for an error (task.on_reward_error="zero")
            row["reward_failures"] = self.reward_failures - failures
        row["step_seconds"] = time.perf_counter() - t0
        return row

    # --- the run -------------------------------------------------------------------------
    def run(self, close_engine: bool = True) -> dict:
        """Train `cfg.steps` steps; `close_engine=False` leaves the rollout engine up for inspection."""
        cfg, world, main = self.cfg, self.world, self.world.main
        metrics_file = cfg.run_dir / "metrics.jsonl"
        if main:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            (cfg.run_dir / "config.toml").write_text(to_toml(cfg))
        checkpoints, stop = RunCheckpoints(self), StopSignal(world, self.console)
        start = time.perf_counter()
        resumed = checkpoints.start()
        first = resumed.step if resumed is not None else 0
        # the trackers before the first evaluation: a missing package fails fast
        self.trackers = Trackers(cfg, first) if main else None
        self.report = RunReport(cfg, self.console, self.trackers, metrics_file) if main else None
        if main:
            r = cfg.rollout
            self.console.print(
                f"trillora train: {cfg.model.path} on {cfg.task.name}, {cfg.steps} steps of "
                f"{r.prompts_per_step} prompts × {r.group_size} samples; writing {cfg.run_dir}"
                + (f", from step {first}" if first else "")
            )
        state = {}  # the accuracies so far, kept in checkpoints (rank 0)
        if resumed is not None and resumed.state is not None:  # the metrics so far come back with the checkpoint
            state = {k: resumed.state[k] for k in ("eval_before", "retention_before", "accuracy", "retention_after")}
            self.flops_total = resumed.state.get("flops_total", 0.0)
            if main:
                metrics_file.write_text(checkpoints.metrics_of(resumed))
        elif (evaluated := self.policy.sample(self.engine, self._evaluate_all)) is not None:
            before, retention = evaluated
            state = dict(eval_before=before, retention_before=retention, accuracy=before, retention_after=retention)
            initial = {"step": first, "eval_accuracy": before}
            if self.retention:
                initial["retention_accuracy"] = retention
            metrics_file.write_text(json.dumps(initial) + "\n")  # the start of the accuracy curves
            self.trackers.log(initial, first)
            self.console.print(console_line(initial, before))
        columns = [
            TextColumn("[bold]RL[/]"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
        ]
        worker = self.sampler.start_worker(first, cfg.steps) if cfg.rollout.asynchronous else None
        with (
            Progress(*columns, disable=not main) as bar,
            stop.installed(),
            contextlib.closing(worker) if worker is not None else contextlib.nullcontext(),
            self._shared_cores(),
            contextlib.closing(self.trackers) if self.trackers is not None else contextlib.nullcontext(),
        ):
            job = bar.add_task("rl", total=cfg.steps, completed=first, info="")
            state["steps_done"] = first
            for step in range(first, cfg.steps):
                row = self.step(step)
                if step == first and resumed is not None:  # the plots mark where a run was resumed
                    row["resumed_from"] = first
                spent = cfg.flops_budget > 0 and self.flops_total >= cfg.flops_budget  # the last step of the run
                state["steps_done"] = step + 1
                evaluated = (
                    self.policy.sample(self.engine, self._evaluate_all_timed) if self._evaluating(step, spent) else None
                )
                if main:
                    self._log(row, step, state, bar, job, evaluated)
                stopping, diverged = stop.now(), self.update.diverged()
                if checkpoints.due(step + 1, stopping or diverged or spent):
                    checkpoints.save(step + 1, state, metrics_file if main else None)
                if diverged:
                    world.close()
                    raise self._diverged(step + 1)
                if stopping:
                    self.policy.unsharded()  # every rank joins the adapter gather
                    if main:  # the adapter so far is usable (eval, generate, serve) without unpacking a checkpoint
                        export(self)
                        self.report.replot(due=0)
                        self.console.print(
                            f"stopped at step {step + 1} of {cfg.steps}: weights so far in "
                            f"{export_dir(self.cfg)}; continue with --resume (resume=true)"
                        )
                    world.close()
                    return {"stopped_at": step + 1, "exit_code": stop.exit_code}
                if spent:
                    break
        self.policy.unsharded()
        summary = write_summary(self, state, start) if main else {}
        if close_engine and self.engine is not None:
            self.engine.close()
        world.close()
        return summary

    def _evaluating(self, step: int, last: bool) -> bool:
        """Evaluation is due after `step` (and at the `last` step of a spent FLOP budget)."""
        return (step + 1) % self.cfg.eval_every == 0 or step + 1 == self.cfg.steps or last

    def _evaluate_all_timed(self):
        t3 = time.perf_counter()
        return *self._evaluate_all(), time.perf_counter() - t3

    def _log(self, row: dict, step: int, state: dict, bar, job, evaluated) -> None:
        """Rank 0: the evaluation's results if one ran, then the step reported (`report.RunReport`)."""
        if evaluated is not None:
            state["accuracy"], retention, seconds = evaluated
            row["eval_accuracy"] = state["accuracy"]
            if self.retention:
                state["retention_after"] = row["retention_accuracy"] = retention
            row["eval_seconds"] = seconds
            row["step_seconds"] += row["eval_seconds"]
        self.report.step(row, state["accuracy"], bar, job)

    def _diverged(self, step: int) -> TrainingDiverged:
        u = self.update
        return TrainingDiverged(
            f"the last {u.nonfinite_in_a_row} updates (to step {step}) had a non-finite loss or gradient and were "
            f"skipped (optim.max_nonfinite_in_a_row={self.cfg.optim.max_nonfinite_in_a_row}); the adapter is unchanged "
            f"since step {step - u.nonfinite_in_a_row} and saved in {self.cfg.run_dir / 'checkpoints'}. "
            f"Lower optim.lr, check the rewards, or resume with resume=true"
        )

    @contextlib.contextmanager
    def _shared_cores(self):
        """With a rollout thread on the CPU, sampling and training share the cores: each gets half
        the intra-op threads (both at full count oversubscribe: 2.2x slower per sample, measured)."""
        before = torch.get_num_threads()
        if self.cfg.rollout.asynchronous and self.cfg.rollout.max_staleness > 0 and self.device.type == "cpu":
            torch.set_num_threads(max(1, before // 2))  # max_staleness 0: no overlap
        try:
            yield
        finally:
            torch.set_num_threads(before)


def train(cfg: TrainConfig) -> dict:
    # one writer per run folder: a second run on it (the same name and out_dir) is refused, naming the
    # first, rather than interleaving its metrics and checkpoints; under torchrun rank 0 holds it
    writer = int(os.environ.get("RANK", "0")) == 0
    hint = "; or give this run another name= or out_dir="
    with FolderLock(cfg.run_dir, hint=hint) if writer else contextlib.nullcontext():
        if cfg.task.name == "traces":  # recorded traffic, not rollouts: the learner's rounds, offline
            if launched():
                raise ConfigError('task.name="traces" trains in one process (not under torchrun) for now')
            from .offline import train_on_traces

            return train_on_traces(cfg)
        return Trainer(cfg).run()
