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

from .. import rl
from ..errors import ConfigError
from ..policy.policy import Policy, Rows
from .batch import TokenBatch, completion_spans
from .router_replay import RouterReplay


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
    """The GRPO update, a client of `Policy`: which rows each pass and step runs, with which loss."""

    def __init__(self, policy: Policy, cfg):
        self.policy, self.world, self.model = policy, policy.world, policy.model
        world = self.world
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
        self.uneven = False
        """Batches need not split evenly (a learner's rounds): minibatches differ by at most a row and
        the data-parallel ranks' shares too; else a share that does not divide is refused."""
        self.skipped_updates = 0  # optimizer steps skipped for a non-finite loss or gradient (whole run)
        self.nonfinite_in_a_row = 0

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
        everything = torch.arange(batch.num_rows)
        cut = everything.tensor_split(a.minibatches) if self.uneven else everything.chunk(a.minibatches)
        for rows in cut:  # global rows of each minibatch
            mine = rows[slice(*self.world.block(len(rows))) if self.uneven else self.world.rows(len(rows))]
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
        parts = self.policy.from_last(parts)  # the losses ran on the last pipeline stage
        per_token, tokens = token_weighted_mean(parts)
        averaged = combine_steps(steps)
        averaged.update(replay.metrics() if replay is not None else {})  # this rank's rows (rank 0 logs)
        return self.world.reduce_metrics(per_token, tokens, {"loss": sum(losses) / len(losses)}, averaged)

    def _fixed_passes(self, local: TokenBatch, whole_groups: bool, replay: RouterReplay | None) -> Fixed:
        fixed = Fixed()
        everything = torch.arange(local.num_rows, device=local.input_ids.device)
        rows = self._rows(local, whole_groups)
        if self.proximal_pass:
            with _replaying(replay, self.model, everything, "old") as whole:
                fixed.old = self.policy.forward(rows, self.temperature, whole_rows=whole)
            fixed.is_weights, fixed.mismatch = self._mismatch(fixed.old, local)
        if self.reference_pass:
            with _replaying(replay, self.model, everything, "reference") as whole:
                fixed.ref = self.policy.forward(rows, self.temperature, adapter=False, whole_rows=whole)
        return fixed

    def _rows(self, local: TokenBatch, whole_groups: bool, idx: torch.Tensor | None = None) -> Rows:
        """Rows `idx` of this rank's batch (None: all) for the policy's passes; with their groups'
        prompt lengths when each group's prompt may run once (`parallel.share_prompts`)."""
        idx = torch.arange(local.num_rows, device=local.input_ids.device) if idx is None else idx
        g = local.group_size
        if not (self.share_prompts and g and whole_groups and local.prompt_lengths is not None):
            return Rows(local.input_ids[idx])
        return Rows(local.input_ids[idx], g, local.prompt_lengths[idx], completion_spans(local, idx))

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

        def loss(logp, entropy, r):  # rows r of the minibatch (a micro-batch, or a pipeline microbatch)
            part, metrics = self._loss(local, fixed, mb, logp, entropy, mb.rows[r])
            parts.append(metrics)
            return part

        def around(r):  # the replay context spans backward too: checkpointed layers replay again there
            return _replaying(replay, self.model, mb.rows[r], "policy", measure)

        rows = self._rows(local, whole_groups, mb.rows)
        return self.policy.forward_backward(rows, loss, self.temperature, self.micro_batch_rows, around)

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

    def _mismatch(self, trainer_logp: torch.Tensor, local: TokenBatch, rows: torch.Tensor | None = None):
        a = self.algorithm
        lp, mask = local.rollout_logprobs, local.completion_mask
        if rows is not None:
            lp, mask = lp[rows], mask[rows]
        return rl.mismatch_weights(trainer_logp, lp, mask, a.mismatch, a.mismatch_cap, tuple(a.mismatch_band))

    # --- the optimizer -------------------------------------------------------------------
    def _optimizer_step(self) -> dict[str, float]:
        """One optimizer step of the policy; a non-finite gradient is dropped and counted."""
        out, traffic = self.policy.optim_step(self.optim.grad_clip)
        if out.stepped:
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_updates += 1
            self.nonfinite_in_a_row += 1
        return {"grad_norm": out.norm if out.stepped else float("nan"), "skipped": float(not out.stepped), **traffic}


def check_rows(cfg, world) -> None:
    """A run's batch splits into its minibatches over the data-parallel ranks in equal parts."""
    rows, dp, m = cfg.rollout.prompts_per_step * cfg.rollout.group_size, world.dims.dp, cfg.algorithm.minibatches
    if world.size > 1 and rows % (m * dp):
        raise ConfigError(
            f"rollout.prompts_per_step × group_size = {rows} rows do not split into "
            f"algorithm.minibatches={m} × dp={dp} equal parts"
        )


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
