"""The synchronous GRPO loop: rollout -> rewards -> advantages -> LoRA update -> engine sync.

The math lives in `trillora.rl`; this file only wires components and records what happened.
Shape legend: P prompts per step, G group size, B = P·G rows, T tokens.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from . import lora, rl
from .checkpoint import load_model, load_tokenizer
from .config import ConfigError, TrainConfig, to_toml
from .distributed import Distributed, launched, load_adapter_tensors
from .evaluate import decode_completion, encode_prompt, evaluate
from .policy import build_batch, shared_prompt_logprobs, token_logprobs
from .replay import RouterReplay
from .resume import RunCheckpoints, StopSignal, TrainingDiverged, console
from .rollout import LocalEngine, OpenAIEngine, SamplingParams
from .rollout.async_worker import RolloutWorker
from .tasks import make_task
from .tasks.guard import GuardedReward


def resolve_model_path(path: str) -> Path:
    if path == "tiny-moe":
        from .tiny import shipped_path

        return shipped_path()
    return Path(path)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but no CUDA device is available")
    return torch.device(name)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        if cfg.deterministic:  # before any kernel runs; cuBLAS needs its workspace fixed for this
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.device = pick_device(cfg.device)
        if launched() and self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        path = resolve_model_path(cfg.model.path)
        self.tokenizer = load_tokenizer(path)
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.model = load_model(path, dtype=dtype, device=self.device)
        lora.apply_lora(self.model, cfg.lora)
        self.full, self.dist = self.model, None  # `full`: the unsharded model the engine and the export read
        p = cfg.parallel
        if launched() and cfg.rollout.engine == "vllm":
            raise ConfigError("rollout.engine='vllm' runs vLLM inside this process, which torchrun already made a "
                              "distributed rank; under torchrun serve vLLM and use rollout.engine='openai'")
        if launched():
            self.full = copy.deepcopy(self.model)
            self.dist = Distributed.start(self.model, cfg, self.device)
            if not self.dist.main:
                self.full = None
        elif p.auto:
            pass  # one process: nothing to lay out
        elif (p.tp, p.ep, p.pp, p.cp, max(p.dp, 1)) != (1, 1, 1, 1, 1):
            raise ConfigError(f"parallel.dp={p.dp} tp={p.tp} ep={p.ep} pp={p.pp} cp={p.cp} needs a distributed launch: "
                              f"torchrun --nproc-per-node N -m trillora train ...")
        elif p.activation_checkpoint_every:
            from .parallel.checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(self.model, p.activation_checkpoint_every)
        self.params = [p for _, p in lora.lora_parameters(self.model)]
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        self.engine = self._make_engine() if self.main else None
        self.task = make_task(cfg.task.name, **cfg.task.options)
        self.retention = make_task(cfg.task.retention) if cfg.task.retention else None
        self._check_dataset()
        t = cfg.task
        self.reward = GuardedReward(self.task, t.reward_timeout, t.on_reward_error)  # user code: time-limited
        self.retention_reward = GuardedReward(self.retention, t.reward_timeout, t.on_reward_error) if self.retention else None
        self.eval_problems = self.task.problems("eval", cfg.task.eval_problems, seed=cfg.seed)
        self.retention_problems = self.retention.problems("eval", cfg.task.eval_problems, seed=cfg.seed) if self.retention else []
        r = cfg.rollout
        stop = (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        self.worker: RolloutWorker | None = None  # the rollout thread, while `run` runs with rollout.asynchronous
        if r.asynchronous and (launched() or cfg.algorithm.dynamic_sampling or r.max_staleness < 0):
            raise ConfigError("rollout.asynchronous needs one process (not torchrun), no algorithm.dynamic_sampling, "
                              f"and rollout.max_staleness >= 0 (got {r.max_staleness})")
        self.routing = cfg.algorithm.router_replay != "off" or cfg.algorithm.routing_metrics
        if self.routing:
            self._check_routing()
        self.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                       top_k=r.top_k, stop_token_ids=stop)
        self.skipped_updates = 0
        self.nonfinite_in_a_row = 0
        self.micro_batch_rows = p.micro_batch_rows or (1 if p.auto else 0)
        dims = self.dist.par.dims if self.dist is not None else None
        self.share_prompts = p.share_prompts and r.group_size > 1 and (dims is None or (dims.pp, dims.cp, dims.sp) == (1, 1, False))

    def _check_routing(self) -> None:
        if self.cfg.rollout.engine == "openai":
            raise ConfigError("algorithm.router_replay / routing_metrics need the experts the engine chose per token; "
                              "rollout.engine='openai' does not return them: use rollout.engine='local' (or 'vllm' on a GPU)")
        if self.dist is not None and (self.dist.par.dims.pp, self.dist.par.dims.cp, self.dist.par.dims.sp) != (1, 1, False):
            raise ConfigError("algorithm.router_replay runs whole rows on each rank; it does not combine with "
                              "parallel.pp, parallel.cp or parallel.sp yet")

    def _check_dataset(self) -> None:
        """Dataset prompts must leave room for the completion in the engine's context."""
        if not hasattr(self.task, "limit_prompt_tokens"):
            return
        r = self.cfg.rollout
        self.task.limit_prompt_tokens(lambda text: len(encode_prompt(self.tokenizer, text)), r.max_model_len - r.max_new_tokens,
                                      f"rollout.max_model_len={r.max_model_len} - rollout.max_new_tokens={r.max_new_tokens}")
        if self.task.skipped and self.main:
            console.print(f"[yellow]{len(self.task.skipped)} dataset rows skipped[/] (bad_rows=\"skip\"); "
                          f"first: {self.task.skipped[0]}")

    @property
    def main(self) -> bool:
        """The rank that samples, evaluates and writes (the only one without torchrun)."""
        return self.dist is None or self.dist.main

    def _make_engine(self):
        r = self.cfg.rollout
        sync_dir = r.sync_dir or self.cfg.run_dir / "sync"
        if r.engine == "openai":
            return OpenAIEngine(list(r.urls), model=r.server_model or self.cfg.model.path, api_key=r.api_key or None,
                                sync_dir=sync_dir, sync="adapter" if r.sync == "auto" else r.sync)
        if r.engine == "vllm":
            from .rollout.vllm import VLLMEngine

            dtype = {"auto": None, "fp32": "float32", "bf16": "bfloat16"}[r.precision]
            return VLLMEngine(resolve_model_path(self.cfg.model.path), self.full, sync=r.sync, sync_dir=sync_dir,
                              dtype=dtype, max_model_len=r.max_model_len, seed=self.cfg.seed)
        return LocalEngine(self.full, precision=r.precision, device=self.device, pad_id=self.tokenizer.pad_token_id or 0)

    def sync_engine(self) -> dict[str, float]:
        """Bring the engine up to date; under torchrun every rank joins the adapter gather first."""
        if self.dist is None:
            return self.engine.sync(self.model)
        tensors = self.dist.gather_adapter(self.model)
        if not self.dist.main:
            return {}
        load_adapter_tensors(self.full, tensors)
        return self.engine.sync(self.full)

    # --- one step ------------------------------------------------------------------------
    def _request(self, step: int, k: int = 0):
        """Problems, prompt tokens, n and sampling parameters of sampling round k of a step."""
        r = self.cfg.rollout
        seed = self.cfg.seed * 1_000_003 + step if k == 0 else -((self.cfg.seed * 1_000_003 + step) * 16 + k)
        problems = self.task.problems("train", r.prompts_per_step, seed=seed)
        params = SamplingParams(**{**self.sampling.__dict__, "seed": seed, "return_routing": self.routing})
        return problems, [encode_prompt(self.tokenizer, p.prompt) for p in problems], r.group_size, params

    def rollout(self, step: int):
        if not self.main:
            return self.dist.share(None)
        r, a = self.cfg.rollout, self.cfg.algorithm
        rounds = []  # (problems, groups, rewards [P, G]) of each sampling round
        staleness = None
        for k in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
            if self.worker is not None:  # sampled ahead by the rollout thread
                sampled = self.worker.take(step)
                problems, groups, staleness = sampled.request, sampled.groups, step - sampled.revision
            else:
                problems, prompts, n, params = self._request(step, k)
                groups = self.engine.generate(prompts, n, params)
            rewards = torch.tensor([[self.reward(p, decode_completion(self.tokenizer, c.token_ids)) for c in g]
                                    for p, g in zip(problems, groups)])  # [P, G]
            rounds.append((problems, groups, rewards))
            if sum(int(rl.informative_groups(x[2]).sum()) for x in rounds) >= r.prompts_per_step:
                break
        sampled = torch.cat([x[2] for x in rounds])
        self.rollout_stats = {"reward_mean": float(sampled.mean()),
                              "groups_all_equal": float((~rl.informative_groups(sampled)).float().mean())}
        if staleness is not None:  # every sample of the batch came from the same adapter revision
            self.rollout_stats["staleness"] = float(staleness)
        if a.dynamic_sampling:  # the batch: informative groups first in sampling order, padded if short
            chosen, padded = rl.fill_batch([x[2] for x in rounds], r.prompts_per_step)
            groups = [rounds[k][1][i] for k, i in chosen]
            rewards = torch.stack([rounds[k][2][i] for k, i in chosen])
            uninformative = int((~rl.informative_groups(sampled)).sum())
            self.rollout_stats.update(sampling_rounds=float(len(rounds)), groups_dropped=float(uninformative - padded),
                                      groups_padded=float(padded))
        flat = [c for g in groups for c in g]
        batch = build_batch([c.prompt_ids for c in flat], [c.token_ids for c in flat], [c.logprobs for c in flat],
                            pad_id=self.tokenizer.pad_token_id or 0, device=self.device,
                            routes=[c.routed_experts for c in flat] if self.routing else None)
        return self.dist.share((batch, rewards, flat)) if self.dist else (batch, rewards, flat)

    def update(self, batch, advantages_B: torch.Tensor) -> dict[str, float]:
        a, model, temp = self.cfg.algorithm, self.model, self.cfg.rollout.temperature
        global_tokens, global_seqs = float(batch.num_tokens), float(batch.input_ids.shape[0])
        if self.dist is not None:  # this data-parallel rank's rows; losses stay normalised by the whole batch
            rows = self.dist.rows(batch.input_ids.shape[0])
            share = (rows.stop - rows.start) % self.cfg.rollout.group_size == 0  # whole groups on this rank
            batch = dataclasses.replace(batch, input_ids=batch.input_ids[rows], completion_mask=batch.completion_mask[rows],
                                        rollout_logprobs=batch.rollout_logprobs[rows],
                                        prompt_lengths=batch.prompt_lengths[rows] if share else None,
                                        routes=batch.routes[rows] if batch.routes is not None else None,
                                        routes_valid=batch.routes_valid[rows] if batch.routes is not None else None)
            advantages_B = advantages_B[rows]
        ids, mask, plen = batch.input_ids, batch.completion_mask, batch.prompt_lengths
        clen = mask.sum(-1).long()  # [b] completion tokens per row
        routing = RouterReplay(a.router_replay, batch.routes, batch.routes_valid) if batch.routes is not None else None
        pipeline = self.dist.par.pipeline if self.dist is not None else None
        passes = a.epochs * a.minibatches
        everything = torch.arange(ids.shape[0], device=ids.device)
        old = None
        if passes > 1:  # proximal policy for several passes: the policy before this update
            with self._routing(routing, everything, "old") as whole:
                old = self._logprobs(ids, plen, clen, temp, whole)
        ref = None
        if a.kl_coef > 0:
            with lora.disable_adapter(model), self._routing(routing, everything, "reference") as whole:
                ref = self._logprobs(ids, plen, clen, temp, whole)
        weights, mismatch = self._mismatch(old, batch) if old is not None else (None, {})
        parts: list[dict[str, float]] = []  # metrics of each loss evaluation (minibatch or microbatch)

        def loss_of(logp, entropy, rows):
            """One slice of rows' share of the loss; `rows` index this rank's batch."""
            w, m = (weights[rows], mismatch) if old is not None else self._mismatch(logp.detach(), batch, rows)
            loss, lm = rl.policy_loss(
                logp, (old[rows] if old is not None else logp.detach()), advantages_B[rows].to(logp.device),
                mask[rows], global_tokens=global_tokens, global_seqs=global_seqs,
                clip_low=a.clip_low, clip_high=a.clip_high, aggregation=a.aggregation,
                norm_len=float(self.cfg.rollout.max_new_tokens), is_weights_BT=w,
                ref_logp_BT=ref[rows] if ref is not None else None, kl_coef=a.kl_coef, kl_kind=a.kl_estimator,
                entropy_BT=entropy, entropy_coef=a.entropy_coef,
            )
            parts.append({**m, **lm, "tokens": float(mask[rows].sum())})
            return loss

        loss_sum, step_metrics = 0.0, {}
        chunks = torch.arange(ids.shape[0], device=ids.device).chunk(a.minibatches)
        for epoch in range(a.epochs):
            for rows in chunks:
                if pipeline is None:  # micro-batches accumulate gradients (losses share one normaliser)
                    loss = 0.0
                    for micro in rows.split(self.micro_batch_rows or len(rows)):
                        # the routing context spans backward too: checkpointed layers replay again there
                        with self._routing(routing, micro, "policy", measure=epoch == 0) as whole:
                            logp, entropy = self._rows_logprobs(ids, plen, clen, micro, temp, True, whole)
                            part = loss_of(logp, entropy, micro)
                            part.backward()
                        loss = loss + part.detach()
                else:  # forward and backward of the microbatches; the loss is computed on the last stage
                    loss = pipeline.train_step(ids[rows], lambda lp, ent, r, rows=rows: loss_of(lp, ent, rows[r]), temp)
                loss_sum += float(loss)  # a share of the loss normalised by the whole batch
            step_metrics = self._optimizer_step()
        if pipeline is not None:
            parts = pipeline.share_from_last(parts)
        per_token, tokens = token_weighted_mean(parts)
        step_metrics.update(routing.metrics() if routing is not None else {})  # this rank's rows (rank 0 logs)
        if self.dist is not None:
            return self.dist.reduce_metrics(per_token, tokens, {"loss": loss_sum}, step_metrics)
        return {**per_token, "loss": loss_sum, **step_metrics}

    @contextlib.contextmanager
    def _shared_cores(self):
        """With a rollout thread on the CPU, sampling and training share the cores: each gets half
        the intra-op threads (both at full count oversubscribe: 2.2x slower per sample, measured)."""
        before = torch.get_num_threads()
        if self.worker is not None and self.worker.staleness > 0 and self.device.type == "cpu":  # 0: no overlap
            torch.set_num_threads(max(1, before // 2))
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @contextlib.contextmanager
    def _routing(self, routing: RouterReplay | None, rows: torch.Tensor, kind: str, measure: bool = False):
        """Around one pass over `rows`: router replay / routing measurement when on; yields whether
        the pass must run whole rows (one forward call the recorded routing lines up with)."""
        if routing is None or not routing.active(kind, measure):
            yield False
            return
        with routing.around(self.model, rows, kind, measure):
            yield True

    @torch.no_grad()
    def _logprobs(self, ids: torch.Tensor, plen: torch.Tensor | None, clen: torch.Tensor, temperature: float,
                  whole_rows: bool = False) -> torch.Tensor:
        """Per-token logprobs [b, T-1] under the current adapter state, without autograd state,
        through the same layout as training (the pipeline's stages under pp)."""
        pipeline = self.dist.par.pipeline if self.dist is not None else None
        if pipeline is not None:
            return pipeline.logprobs(ids, temperature)[0]
        return self._rows_logprobs(ids, plen, clen, torch.arange(ids.shape[0], device=ids.device), temperature,
                                   whole_rows=whole_rows)[0]

    def _rows_logprobs(self, ids, plen, clen, rows: torch.Tensor, temperature: float, with_entropy: bool = False,
                       whole_rows: bool = False):
        """Logprobs (and entropies) [b, T-1] of some rows of this rank's batch; each group's prompt
        runs once when the rows are whole groups (`parallel.share_prompts`)."""
        g = self.cfg.rollout.group_size
        if self.share_prompts and not whole_rows and plen is not None and len(rows) % g == 0 and int(rows[0]) % g == 0:
            return shared_prompt_logprobs(self.model, ids[rows], plen[rows], clen[rows], g, temperature, with_entropy)
        return token_logprobs(self.model, ids[rows], temperature, with_entropy=with_entropy)

    def _mismatch(self, trainer_logp, batch, rows=None):
        a = self.cfg.algorithm
        lp, mask = batch.rollout_logprobs, batch.completion_mask
        if rows is not None:
            lp, mask = lp[rows], mask[rows]
        return rl.mismatch_weights(trainer_logp, lp, mask, a.mismatch, a.mismatch_cap, tuple(a.mismatch_band))

    def _optimizer_step(self) -> dict[str, float]:
        o = self.cfg.optim
        traffic = {}
        if self.dist is not None:
            sent = self.dist.par.grad_sync()  # adapter gradients only, over data (and expert-data) parallel ranks
            traffic = self.dist.par.traffic(sent)  # what this rank's collectives moved this step
            norm = self.dist.clip_(self.model, o.grad_clip)  # the global norm, the same on every rank
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, o.grad_clip if o.grad_clip > 0 else float("inf"))
        if not torch.isfinite(norm):  # a NaN never reaches the adapter or the engine
            self.skipped_updates += 1
            self.nonfinite_in_a_row += 1
            self.opt.zero_grad(set_to_none=True)
            return {"grad_norm": float("nan"), "skipped_update": 1.0, **traffic}
        self.nonfinite_in_a_row = 0
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), **traffic}

    def _diverged(self) -> bool:
        k = self.cfg.optim.max_nonfinite_in_a_row
        return k > 0 and self.nonfinite_in_a_row >= k

    def _raise_diverged(self, step: int) -> None:
        if self.dist:
            self.dist.close()
        raise TrainingDiverged(
            f"the last {self.nonfinite_in_a_row} updates (to step {step}) had a non-finite loss or gradient and were "
            f"skipped (optim.max_nonfinite_in_a_row={self.cfg.optim.max_nonfinite_in_a_row}); the adapter is unchanged "
            f"since step {step - self.nonfinite_in_a_row} and saved in {self.cfg.run_dir / 'checkpoints'}. "
            f"Lower optim.lr, check the rewards, or resume with resume=true")

    def _set_lr(self, step: int) -> float:
        o = self.cfg.optim
        lr = o.lr * min(1.0, (step + 1) / max(1, o.warmup_steps))
        for g in self.opt.param_groups:
            g["lr"] = lr
        return lr

    def evaluate(self, task, problems) -> float:
        params = SamplingParams(**{**self.sampling.__dict__, "seed": 4242})
        score = self.reward if task is self.task else self.retention_reward
        with self.worker.lock if self.worker is not None else contextlib.nullcontext():  # the engine is shared
            return evaluate(self.engine, self.tokenizer, task, problems, params, n=self.cfg.task.eval_samples, score=score)

    # --- the run -------------------------------------------------------------------------
    def run(self, close_engine: bool = True) -> dict:
        """Train `cfg.steps` steps; `close_engine=False` leaves the rollout engine up for inspection."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        if not self.main:
            return self._follow()
        cfg, run_dir = self.cfg, self.cfg.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        metrics_file = run_dir / "metrics.jsonl"
        checkpoints, stop = RunCheckpoints(self), StopSignal(self.dist is not None, self.device)
        start = time.perf_counter()
        resumed = checkpoints.start()
        if resumed is not None:  # the metrics so far come back with the checkpoint
            metrics_file.write_text(checkpoints.metrics_of(resumed))
            eval_before, retention_before = resumed.state["eval_before"], resumed.state["retention_before"]
            accuracy, retention = resumed.state["accuracy"], resumed.state["retention_after"]
        else:
            metrics_file.write_text("")
            eval_before = self.evaluate(self.task, self.eval_problems)
            retention_before = self.evaluate(self.retention, self.retention_problems) if self.retention else None
            accuracy, retention = eval_before, retention_before
            with open(metrics_file, "a") as log:  # step 0: the starting point of the accuracy curves
                log.write(json.dumps({"step": 0, "eval_accuracy": eval_before,
                                      **({"retention_accuracy": retention_before} if self.retention else {})}) + "\n")
        first = resumed.step if resumed is not None else 0
        columns = [TextColumn("[bold]RL[/]"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn()]
        closing = contextlib.nullcontext()
        if cfg.rollout.asynchronous:
            if hasattr(self.engine, "keep_revisions"):  # a server engine: revisions a stale batch may still use
                self.engine.keep_revisions = cfg.rollout.max_staleness + 1
            self.worker = RolloutWorker(self.engine, self._request, first, cfg.steps, cfg.rollout.max_staleness)
            closing = contextlib.closing(self.worker)
        with Progress(*columns) as bar, stop.installed(), closing, self._shared_cores():
            job = bar.add_task("rl", total=cfg.steps, completed=first, info="")
            for step in range(first, cfg.steps):
                t0 = time.perf_counter()
                lr = self._set_lr(step)
                failures = self.reward.failures
                with record_function("trillora.rollout"):
                    batch, rewards, flat = self.rollout(step)
                t1 = time.perf_counter()
                with record_function("trillora.update"):
                    advantages = rl.group_advantages(rewards, cfg.algorithm.advantage, cfg.algorithm.normalize_std).reshape(-1)
                    metrics = self.update(batch, advantages)
                t2 = time.perf_counter()
                with record_function("trillora.sync"):
                    metrics.update(self.worker.synced(self.sync_engine) if self.worker else self.sync_engine())
                row = {"step": step + 1, "lr": lr, **self.rollout_stats,
                       "completion_len_mean": sum(len(c.token_ids) for c in flat) / len(flat),
                       "rollout_seconds": t1 - t0, "update_seconds": t2 - t1, **metrics}
                if self.reward.failures > failures:  # rewards scored 0 for an error (task.on_reward_error="zero")
                    row["reward_failures"] = self.reward.failures - failures
                if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                    t3 = time.perf_counter()
                    accuracy = self.evaluate(self.task, self.eval_problems)
                    row["eval_accuracy"] = accuracy
                    if self.retention:
                        retention = row["retention_accuracy"] = self.evaluate(self.retention, self.retention_problems)
                    row["eval_seconds"] = time.perf_counter() - t3  # inside step_seconds
                row["step_seconds"] = time.perf_counter() - t0
                with open(metrics_file, "a") as log:
                    log.write(json.dumps(row) + "\n")
                bar.update(job, advance=1, info=f"reward {row['reward_mean']:.2f}  held-out acc {accuracy:.3f}  "
                                                f"{row['step_seconds']:.2f}s/step")
                stopping = stop.now()
                diverged = self._diverged()
                if checkpoints.due(step + 1, stopping or diverged):
                    checkpoints.save(step + 1, {"eval_before": eval_before, "retention_before": retention_before,
                                                "accuracy": accuracy, "retention_after": retention},
                                     metrics_file)
                if diverged:
                    self._raise_diverged(step + 1)
                if stopping:
                    console.print(f"stopped at step {step + 1} of {cfg.steps}: resume with resume=true")
                    if self.dist:
                        self.dist.close()
                    return {"stopped_at": step + 1}
        eval_after, retention_after = accuracy, retention
        lora.save_adapter(self.full, run_dir / "adapter" / "per_expert", expert_layout="per_expert",
                          base_model=str(resolve_model_path(cfg.model.path)))
        lora.save_adapter(self.full, run_dir / "adapter" / "fused", expert_layout="fused",
                          base_model=str(resolve_model_path(cfg.model.path)))
        from .plots import plot_run

        plot_run(run_dir)
        summary = {
            "eval_before": eval_before, "eval_after": eval_after,
            "retention_before": retention_before, "retention_after": retention_after,
            "steps": cfg.steps, "seconds": time.perf_counter() - start,
            "skipped_updates": self.skipped_updates,
            "reward_failures": self.reward.failures,
            "dataset_rows_skipped": len(getattr(self.task, "skipped", [])),
            "adapter": lora.adapter_stats(self.full),
            **({"parallel": dataclasses.asdict(self.dist.par.dims), "parallel_auto": cfg.parallel.auto,
                "dp_grad_bytes_per_step": self.dist.par.grad_sync.bytes_per_step}
               if self.dist else {}),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if close_engine:
            self.engine.close()
        if self.dist:
            self.dist.close()
        return summary

    def _follow(self) -> dict:
        """A rank other than 0: the same collectives as rank 0's loop (checkpoints included), no files
        but its own checkpoint tensors."""
        checkpoints, stop = RunCheckpoints(self), StopSignal(True, self.device)
        resumed = checkpoints.start()
        with stop.installed():
            for step in range(resumed.step if resumed is not None else 0, self.cfg.steps):
                self._set_lr(step)
                batch, rewards, _ = self.rollout(step)
                advantages = rl.group_advantages(rewards, self.cfg.algorithm.advantage, self.cfg.algorithm.normalize_std).reshape(-1)
                self.update(batch, advantages)
                self.sync_engine()
                stopping = stop.now()
                diverged = self._diverged()
                if checkpoints.due(step + 1, stopping or diverged):
                    checkpoints.save(step + 1, {}, None)
                if diverged:
                    self._raise_diverged(step + 1)
                if stopping:
                    break
        self.dist.close()
        return {}


def token_weighted_mean(parts: list[dict[str, float]]) -> tuple[dict[str, float], float]:
    """Metrics of several loss evaluations combined, each weighted by its completion tokens;
    and the summed weight (so data-parallel ranks combine the same way)."""
    total = sum(p["tokens"] for p in parts)
    keys = sorted({k for p in parts for k in p} - {"tokens"})
    return {k: sum(p[k] * p["tokens"] for p in parts if k in p) / max(total, 1.0) for k in keys}, total


def train(cfg: TrainConfig) -> dict:
    return Trainer(cfg).run()
