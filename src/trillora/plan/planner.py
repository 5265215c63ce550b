"""Layouts as a schedulable resource: every valid (pp, dp, cp, tp, ep) for a world size, costed by
`cost.estimate`, the fastest that fits chosen; the smallest cluster a setup fits on at all;
and the rollout engine's own layout (inference wants tensor and data parallelism, not EP+PP).

    trillora plan --model kimi-k2 --gpus 64 --gpu h800 --seq-len 32768 --lora-rank 128
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..models.args import ModelArgs
from ..parallel.dims import ParallelDims, ParallelError
from .clusters import CLUSTERS, Cluster
from .cost import ADAPTER_STATE_BYTES, Estimate, Footprint, Training, Workload, estimate, short


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_layouts(args: ModelArgs, world: int, cluster: Cluster, work: Workload) -> list[ParallelDims]:
    """Every layout the engine can run on `world` ranks: tp within a node and dividing the heads
    (and kv heads for GQA), ep dividing dp and the experts, pp no more than the layers, cp a power
    of two, dp splitting the rows; FSDP on, with and without sequence
    parallelism and activation checkpointing."""
    out = []
    for tp in divisors(world):
        if tp > cluster.gpus_per_node or args.num_heads % tp or (not args.kv_lora_rank and args.num_kv_heads % tp):
            continue
        for pp in divisors(world // tp):
            if pp > args.num_layers:
                continue
            for cp in divisors(world // (tp * pp)):
                if cp & (cp - 1):  # rows are padded to a multiple of 2·cp, so any length splits
                    continue
                dp = world // (tp * pp * cp)
                if work.rollouts_per_step % dp:
                    continue
                for ep in divisors(dp):
                    if args.num_experts % ep if args.num_experts else ep > 1:
                        continue
                    for sp in (False, True) if tp > 1 and pp == 1 else (False,):
                        for ac in (False, True):
                            out.append(
                                ParallelDims(
                                    dp=dp, tp=tp, ep=ep, pp=pp, cp=cp, sp=sp, activation_checkpoint_every=int(ac)
                                )
                            )
    return out


def fits(est: Estimate, cluster: Cluster) -> bool:
    return est.memory_total <= cluster.memory_gib * 2**30 * (1 - cluster.reserve)


@dataclass
class Plan:
    world: int
    best: list[Estimate]  # fitting layouts, fastest first
    smallest: Estimate  # the layout that needs the least memory per device (fitting or not)

    @property
    def fits(self) -> bool:
        return bool(self.best)


def plan(fp: Footprint, world: int, cluster: Cluster, work: Workload, top: int = 5) -> Plan:
    estimates = [estimate(fp, layout, work, cluster) for layout in valid_layouts(fp.args, world, cluster, work)]
    if not estimates:
        raise ValueError(
            f"no layout of {world} ranks divides this model and workload "
            f"(heads {fp.args.num_heads}, experts {fp.args.num_experts}, rows {work.rollouts_per_step})"
        )
    ok = sorted((e for e in estimates if fits(e, cluster)), key=lambda e: (e.step_s, e.memory_total))
    return Plan(world, ok[:top], min(estimates, key=lambda e: e.memory_total))


def smallest_cluster(fp: Footprint, cluster: Cluster, work: Workload, max_nodes: int = 1024) -> Plan | None:
    """The fewest whole nodes on which some layout fits (None past `max_nodes`). Nodes are
    tried in doubling steps, then the gap is searched node by node."""
    lo, hi = 0, 1
    while hi <= max_nodes and not plan(fp, hi * cluster.gpus_per_node, cluster, work, top=1).fits:
        lo, hi = hi, hi * 2
    if hi > max_nodes:
        return None
    while hi - lo > 1:  # more nodes never hurt: the smallest fitting count is a threshold
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if plan(fp, mid * cluster.gpus_per_node, cluster, work, top=1).fits else (mid, hi)
    return plan(fp, hi * cluster.gpus_per_node, cluster, work)


@dataclass(frozen=True)
class RolloutLayout:
    tp: int
    pp: int
    replicas: int
    weights_gib: float  # per GPU
    kv_cache_gib: float  # per GPU, what is left for the KV cache


def rollout_layout(args: ModelArgs, gpus: int, cluster: Cluster, weight_bytes: int = 2) -> RolloutLayout | None:
    """The inference engine's layout: the smallest tensor-parallel group (within a node, then
    pipeline across nodes) whose weight shard leaves at least a quarter of the memory for the KV
    cache; the rest of the GPUs are data-parallel replicas (more concurrent rollouts)."""
    from ..models.params import count_params

    total = count_params(args).total * weight_bytes
    budget = cluster.memory_gib * 2**30 * (1 - cluster.reserve)
    for pp in divisors(gpus):
        for tp in (t for t in divisors(cluster.gpus_per_node) if args.num_heads % t == 0):
            if gpus % (tp * pp):
                continue
            per = total / (tp * pp)
            if per <= 0.75 * budget:
                return RolloutLayout(tp, pp, gpus // (tp * pp), per / 2**30, (budget - per) / 2**30)
    return None


def lora_vs_full(args: ModelArgs, training: Training, cluster: Cluster, work: Workload) -> dict:
    """The smallest cluster for LoRA and for full-parameter training of the same setup."""
    lora_plan = smallest_cluster(Footprint(args, training), cluster, work)
    full_plan = smallest_cluster(Footprint(args, replace(training, full=True, base_bytes=2)), cluster, work)
    out = {
        "lora_min_gpus": lora_plan.world if lora_plan else None,
        "full_min_gpus": full_plan.world if full_plan else None,
    }
    if lora_plan and full_plan:
        out["ratio"] = lora_plan.world / full_plan.world
    return out


def auto_dims(args: ModelArgs, lora_cfg, world: int, seq_len: int, rows: int, minibatches: int, device):
    """`parallel = "auto"`: the fastest layout the planner finds for this world size that the
    trainer can run (model sizes divisible, rows splitting over dp and pipeline microbatches)."""
    import torch

    if device.type == "cuda":  # the device's own memory; link figures of an H100 node
        cluster = replace(CLUSTERS["h100"], memory_gib=torch.cuda.get_device_properties(device).total_memory / 2**30)
    else:
        cluster = CLUSTERS["cpu"]
    training = Training(
        lora_rank=lora_cfg.rank,
        expert_rank=lora_cfg.rank_for_experts(args.top_k),
        targets=tuple(lora_cfg.targets),
        base_bytes=4 if device.type == "cpu" else 2,
    )
    result = plan(
        Footprint(args, training), world, cluster, Workload(seq_len=seq_len, rollouts_per_step=rows), top=10**6
    )
    for est in result.best:
        lay = est.layout
        per_rank = rows // (lay.dp * minibatches)  # rows one pipeline call trains: 1-row microbatches
        dims = replace(lay, pp_microbatches=per_rank if lay.pp > 1 else 0)
        try:
            dims.check_model(args)
        except ParallelError:
            continue
        if rows % (lay.dp * minibatches) == 0 and per_rank >= dims.num_stages:
            return dims, est
    least = result.smallest
    raise ParallelError(
        f"parallel='auto': no layout of {world} ranks fits {cluster.memory_gib:.0f} GiB per device; "
        f"the leanest ({short(least.layout)}) needs {least.memory_total / 2**30:.1f} GiB"
    )


SERVICE_TARGETS = ("attention", "mlp", "shared_experts", "experts", "lm_head")  # what a Tinker client may train
REVISION_BYTES = 4  # a sampler revision: an fp32 copy of the adapter


@dataclass
class ServiceLayout:
    """One layout of the Tinker service (`trillora serve --tinker`): `estimate` holds one call's
    memory per GPU with `clients` adapters resident; `max_clients` is how many fit beside the
    base and that call's pass."""

    layout: ParallelDims
    estimate: Estimate
    clients: int
    per_client_bytes: float
    max_clients: int

    @property
    def fits(self) -> bool:
        return self.max_clients >= self.clients


def plan_service(
    args: ModelArgs,
    world: int,
    cluster: Cluster,
    clients: int,
    lora_rank: int,
    seq_len: int,
    rows: int,
    base_bytes: int = 2,
    expert_rank: int = 0,
) -> list[ServiceLayout]:
    """The service's layouts on `world` ranks, fastest first (the cost model's time for one call):
    pp stages of whole layers, tp within a node and dividing the heads (with or without sequence
    parallelism, without pp; the head whole or split over the vocabulary), cp (powers of two,
    within a node), ep dividing dp and the experts, the base whole or sharded over dp × cp (FSDP),
    with and without activation checkpointing (every layer).

    Each call's `rows` datums of `seq_len` tokens are split over dp; under pp they go through the
    stages one datum per chunk (`--pp-microbatches`, GPipe: the bubble is (pp - 1) / chunks, and
    one datum per rank leaves the stages working in turn). Each client's adapter, AdamW state and
    one sampler revision are held at rank `lora_rank` on every role (`expert_rank` on routed
    experts: 0, the same), split with their layers; the stage that needs the most memory counts."""
    fp = Footprint(
        args, Training(lora_rank=lora_rank, expert_rank=expert_rank, targets=SERVICE_TARGETS, base_bytes=base_bytes)
    )
    budget = cluster.memory_gib * 2**30 * (1 - cluster.reserve)
    out = []
    for tp in divisors(world):
        if tp > cluster.gpus_per_node or args.num_heads % tp or (not args.kv_lora_rank and args.num_kv_heads % tp):
            continue
        for pp, cp in ((p, c) for p in divisors(world // tp) for c in divisors(world // (tp * p))):
            if pp > args.num_layers or cp > 1 and (cp & (cp - 1) or cp > cluster.gpus_per_node // tp):
                continue  # cp: powers of two within a node with its tp group (K/V all-gathers every layer)
            dp = world // (tp * pp * cp)
            split, shard = (False, True) if tp > 1 else (False,), (False, True) if dp * cp > 1 else (False,)
            for ep, sp, vocab, fsdp, ac in (
                (e, s, v, f, a)
                for e in divisors(dp)
                for s in (split if pp == 1 else (False,))
                for v in split
                for f in shard
                for a in (0, 1)
            ):
                if (args.num_experts % ep) if args.num_experts else ep > 1:
                    continue
                layout = ParallelDims(
                    dp=dp,
                    tp=tp,
                    ep=ep,
                    pp=pp,
                    cp=cp,
                    fsdp=fsdp,
                    sp=sp,
                    vocab_parallel=vocab,
                    activation_checkpoint_every=ac,
                    pp_schedule="gpipe",
                    pp_microbatches=-(-rows // dp) if pp > 1 else 1,
                )  # a row per chunk: the least bubble
                try:
                    layout.check_model(args)
                except ParallelError:
                    continue
                out.append(_service_layout(fp, layout, cluster, clients, seq_len, rows, budget))
    return sorted(out, key=lambda x: (x.estimate.step_s, x.estimate.memory_total))


def _service_layout(
    fp: Footprint, layout: ParallelDims, cluster: Cluster, clients: int, seq_len: int, rows: int, budget: float
) -> ServiceLayout:
    here = -(-rows // layout.dp)  # a call's rows on one dp rank, in pp_microbatches chunks (GPipe: all held at once)
    work = Workload(seq_len=seq_len, rollouts_per_step=rows, micro_batch_rows=-(-here // layout.pp_microbatches))
    est = estimate(fp, layout, work, cluster, fullest="memory")
    one = est.memory.pop("adapter + grads + optimizer")
    if layout.fsdp:  # the clients' adapters stay whole under FSDP (only the base is sharded): counted as without it
        one = estimate(fp, replace(layout, fsdp=False), work, cluster, fullest="memory").memory[
            "adapter + grads + optimizer"
        ]
    per_client = one / ADAPTER_STATE_BYTES * (ADAPTER_STATE_BYTES + REVISION_BYTES)
    room = budget - est.memory_total
    est.memory["clients: adapter + grads + AdamW + revision"] = per_client * clients
    return ServiceLayout(layout, est, clients, per_client, max(0, int(room // per_client)))
