"""The policy update of one RL step: logprob passes, minibatches, micro-batches, AdamW steps.

    old logprobs   (adapter on, no grad)  only when the policy moves within the batch
    ref logprobs   (adapter off, no grad) only with a KL term
    for each epoch, for each minibatch:    one AdamW step per minibatch (PPO / GRPO:
        forward + backward per micro-batch  verl's ppo_mini_batch_size, TRL's steps_per_generation),
        clip, step                         gradients accumulated over its micro-batches

Minibatches are cut from the whole batch (the same rows at any data-parallel size) and then
split over the data-parallel ranks; each minibatch's loss is normalised by its own global token
and row counts, so the ranks' gradients add up to the one-process gradient of that minibatch.
The math is `trillora.rl`; this module decides what runs over which rows.
Shape legend: B rows of the batch, b of this rank, T tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .. import lora, rl
from ..errors import ConfigError
from ..policy import optimizer_step
from ..policy.logprobs import shared_prompt_logprobs, token_logprobs
from .batch import TokenBatch, completion_spans
from .router_replay import RouterReplay
from .world import World


@dataclass
class Fixed:
    """What the passes before the minibatches computed for this rank's rows; fixed for the batch."""

    old: torch.Tensor | None = None  # [b, T-1] proximal policy's logprobs (None: on-policy, one step)
    ref: torch.Tensor | None = None  # [b, T-1] adapter-off logprobs (None: no KL term)
    is_weights: torch.Tensor | None = None  # [b, T-1] mismatch correction of old vs the engine
    mismatch: dict[str, float] = field(default_factory=dict)


@dataclass
class Minibatch:
    """One optimizer step's rows: their positions in this rank's batch and the global normalisers."""

    rows: torch.Tensor  # [b_m] indices into this rank's batch
    tokens: float  # completion tokens of the whole minibatch (every rank's rows)
    seqs: float  # rows of the whole minibatch


class PolicyUpdate:
    def __init__(self, model, optimizer: torch.optim.Optimizer, world: World, cfg):
        self.model, self.opt, self.world = model, optimizer, world
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.algorithm, self.optim = cfg.algorithm, cfg.optim
        r, p = cfg.rollout, cfg.parallel
        self.temperature, self.norm_len = r.temperature, float(r.max_new_tokens)
        self.micro_batch_rows = p.micro_batch_rows or (1 if p.auto else 0)
        dims = world.dims
        whole_rows = (dims.pp, dims.cp, dims.sp) == (1, 1, False)  # each rank's forward sees whole rows
        self.share_prompts = p.share_prompts and r.group_size > 1 and whole_rows
        if (cfg.algorithm.router_replay != "off" or cfg.algorithm.routing_metrics) and not whole_rows:
            raise ConfigError(
                "algorithm.router_replay runs whole rows on each rank; it does not combine with "
                "parallel.pp, parallel.cp or parallel.sp yet"
            )
        if world.size > 1 and (r.prompts_per_step * r.group_size) % (self.algorithm.minibatches * dims.dp):
            raise ConfigError(
                f"rollout.prompts_per_step × group_size = {r.prompts_per_step * r.group_size} rows do not "
                f"split into algorithm.minibatches={self.algorithm.minibatches} × dp={dims.dp} equal parts"
            )
        self.skipped_updates = 0  # optimizer steps skipped for a non-finite loss or gradient (whole run)
        self.nonfinite_in_a_row = 0

    @property
    def pipeline(self):
        return self.world.par.pipeline

    @property
    def proximal_pass(self) -> bool:
        """The policy moves within the batch, so the one before the first step is the proximal policy."""
        return self.algorithm.epochs * self.algorithm.minibatches > 1

    @property
    def reference_pass(self) -> bool:
        return self.algorithm.kl_coef > 0

    def diverged(self) -> bool:
        k = self.optim.max_nonfinite_in_a_row
        return k > 0 and self.nonfinite_in_a_row >= k

    # --- which rows ----------------------------------------------------------------------
    def split(self, batch: TokenBatch) -> tuple[TokenBatch, list[Minibatch], bool]:
        """This rank's batch, its minibatches, and whether every minibatch share holds whole groups
        (what sharing each group's prompt needs)."""
        a, g = self.algorithm, batch.group_size or 1
        shares, minibatches, start = [], [], 0
        for rows in torch.arange(batch.num_rows).chunk(a.minibatches):  # global rows of each minibatch
            mine = rows[self.world.rows(len(rows))]
            shares.append(mine)
            minibatches.append(
                Minibatch(
                    torch.arange(start, start + len(mine), device=batch.input_ids.device),
                    float(batch.completion_mask[rows.to(batch.completion_mask.device)].sum()),
                    float(len(rows)),
                )
            )
            start += len(mine)
        whole_groups = all(len(s) % g == 0 and int(s[0]) % g == 0 for s in shares if len(s))
        return batch.select(torch.cat(shares)), minibatches, whole_groups

    # --- the update ----------------------------------------------------------------------
    def __call__(self, batch: TokenBatch) -> dict[str, float]:
        """Train on a batch (with advantages set); the step's metrics, combined over ranks."""
        a = self.algorithm
        local, minibatches, whole_groups = self.split(batch)
        replay = RouterReplay(a.router_replay, local.routes, local.routes_valid) if local.routes is not None else None
        fixed = self._fixed_passes(local, whole_groups, replay)
        parts: list[dict[str, float]] = []  # metrics of each loss evaluation (micro-batch or pipeline microbatch)
        losses, steps = [], []
        for epoch in range(a.epochs):
            for mb in minibatches:
                losses.append(self._minibatch(local, whole_groups, fixed, mb, replay, parts, measure=epoch == 0))
                steps.append(self._optimizer_step())
        if self.pipeline is not None:
            parts = self.pipeline.share_from_last(parts)
        per_token, tokens = token_weighted_mean(parts)
        averaged = combine_steps(steps)
        averaged.update(replay.metrics() if replay is not None else {})  # this rank's rows (rank 0 logs)
        return self.world.reduce_metrics(per_token, tokens, {"loss": sum(losses) / len(losses)}, averaged)

    def _fixed_passes(self, local: TokenBatch, whole_groups: bool, replay: RouterReplay | None) -> Fixed:
        fixed = Fixed()
        everything = torch.arange(local.num_rows, device=local.input_ids.device)
        if self.proximal_pass:
            with _replaying(replay, self.model, everything, "old") as whole:
                fixed.old = self._logprobs(local, whole_groups, whole)
            fixed.is_weights, fixed.mismatch = self._mismatch(fixed.old, local)
        if self.reference_pass:
            with lora.disable_adapter(self.model), _replaying(replay, self.model, everything, "reference") as whole:
                fixed.ref = self._logprobs(local, whole_groups, whole)
        return fixed

    def _minibatch(
        self,
        local: TokenBatch,
        whole_groups: bool,
        fixed: Fixed,
        mb: Minibatch,
        replay: RouterReplay | None,
        parts: list,
        measure: bool,
    ) -> float:
        """Forward + backward of one minibatch's rows (gradients accumulated); its loss."""
        if self.pipeline is None:
            loss = 0.0
            for micro in mb.rows.split(self.micro_batch_rows or len(mb.rows)):
                # the replay context spans backward too: checkpointed layers replay again there
                with _replaying(replay, self.model, micro, "policy", measure) as whole:
                    logp, entropy = self._rows_logprobs(local, whole_groups, micro, True, whole)
                    part, metrics = self._loss(local, fixed, mb, logp, entropy, micro)
                    part.backward()
                parts.append(metrics)
                loss = loss + part.detach()
            return float(loss)

        def loss_on_last_stage(logp, entropy, r):  # the pipeline's microbatch r of the minibatch
            part, metrics = self._loss(local, fixed, mb, logp, entropy, mb.rows[r])
            parts.append(metrics)
            return part

        return float(self.pipeline.train_step(local.input_ids[mb.rows], loss_on_last_stage, self.temperature))

    def _loss(
        self,
        local: TokenBatch,
        fixed: Fixed,
        mb: Minibatch,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Some rows' share of their minibatch's loss (normalised by the whole minibatch)."""
        a = self.algorithm
        mask = local.completion_mask[rows]
        if fixed.old is not None:
            old, weights, mismatch = fixed.old[rows], fixed.is_weights[rows], fixed.mismatch
        else:  # one step on fresh samples: the proximal policy is the current one
            old = logp.detach()
            weights, mismatch = self._mismatch(old, local, rows)
        loss, metrics = rl.policy_loss(
            logp,
            old,
            local.advantages[rows].to(logp.device),
            mask,
            global_tokens=mb.tokens,
            global_seqs=mb.seqs,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            aggregation=a.aggregation,
            norm_len=self.norm_len,
            is_weights_BT=weights,
            ref_logp_BT=fixed.ref[rows] if fixed.ref is not None else None,
            kl_coef=a.kl_coef,
            kl_kind=a.kl_estimator,
            entropy_BT=entropy,
            entropy_coef=a.entropy_coef,
        )
        return loss, {**mismatch, **metrics, "tokens": float(mask.sum())}

    # --- passes --------------------------------------------------------------------------
    @torch.no_grad()
    def _logprobs(self, local: TokenBatch, whole_groups: bool, whole_rows: bool) -> torch.Tensor:
        """Per-token logprobs [b, T-1] under the current adapter state, without autograd state,
        through the same layout as training (the pipeline's stages under pp)."""
        if self.pipeline is not None:
            return self.pipeline.logprobs(local.input_ids, self.temperature)[0]
        everything = torch.arange(local.num_rows, device=local.input_ids.device)
        return self._rows_logprobs(local, whole_groups, everything, False, whole_rows)[0]

    def _rows_logprobs(
        self, local: TokenBatch, whole_groups: bool, rows: torch.Tensor, with_entropy: bool, whole_rows: bool
    ):
        """Logprobs (and entropies) [b, T-1] of some rows; each group's prompt runs once when the rows
        are whole groups (`parallel.share_prompts`)."""
        g, ids = local.group_size, local.input_ids
        if (
            self.share_prompts
            and g
            and whole_groups
            and not whole_rows
            and local.prompt_lengths is not None
            and len(rows) % g == 0
            and int(rows[0]) % g == 0
        ):
            return shared_prompt_logprobs(
                self.model,
                ids[rows],
                local.prompt_lengths[rows],
                completion_spans(local, rows),
                g,
                self.temperature,
                with_entropy,
            )
        return token_logprobs(self.model, ids[rows], self.temperature, with_entropy=with_entropy)

    def _mismatch(self, trainer_logp: torch.Tensor, local: TokenBatch, rows: torch.Tensor | None = None):
        a = self.algorithm
        lp, mask = local.rollout_logprobs, local.completion_mask
        if rows is not None:
            lp, mask = lp[rows], mask[rows]
        return rl.mismatch_weights(trainer_logp, lp, mask, a.mismatch, a.mismatch_cap, tuple(a.mismatch_band))

    # --- the optimizer -------------------------------------------------------------------
    def _optimizer_step(self) -> dict[str, float]:
        """Sync, clip and apply the accumulated gradient; a non-finite one is dropped, so a NaN never
        reaches the adapter, the engine or a saved file."""
        # adapter gradients only, summed over data (and expert-data) ranks; the global norm, equal on every rank
        sync = self.world.par.grad_sync if self.world.size > 1 else None
        out = optimizer_step(self.opt, self.params, sync, self.optim.grad_clip)
        traffic = self.world.par.traffic(out.sent_bytes) if sync is not None else {}
        if out.stepped:
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_updates += 1
            self.nonfinite_in_a_row += 1
        return {"grad_norm": out.norm if out.stepped else float("nan"), "skipped": float(not out.stepped), **traffic}


@contextlib.contextmanager
def _replaying(replay: RouterReplay | None, model, rows: torch.Tensor, kind: str, measure: bool = False):
    """Router replay / routing measurement around one pass when the batch carries routing;
    yields whether the pass must run whole rows."""
    if replay is None:
        yield False
        return
    with replay.pass_over(model, rows, kind, measure) as whole:
        yield whole


def combine_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """The optimizer steps of one RL step as one row of metrics: the mean gradient norm of the steps
    taken, how many were taken (`optimizer_steps`) and skipped, the collective bytes added up."""
    norms = [s["grad_norm"] for s in steps if not s["skipped"]]
    out = {"grad_norm": sum(norms) / len(norms) if norms else float("nan")}
    skipped = sum(s["skipped"] for s in steps)
    if skipped:
        out["skipped_update"] = skipped
    out["optimizer_steps"] = float(len(norms))
    for key in sorted({k for s in steps for k in s} - {"grad_norm", "skipped"}):
        out[key] = sum(s.get(key, 0.0) for s in steps)
    return out


def token_weighted_mean(parts: list[dict[str, float]]) -> tuple[dict[str, float], float]:
    """Metrics of several loss evaluations combined, each weighted by its completion tokens;
    and the summed weight (so data-parallel ranks combine the same way)."""
    total = sum(p["tokens"] for p in parts)
    keys = sorted({k for p in parts for k in p} - {"tokens"})
    return {k: sum(p[k] * p["tokens"] for p in parts if k in p) / max(total, 1.0) for k in keys}, total
