"""What a parallel layout costs: memory per device, bytes per collective and step time.

The parameter side is not a formula: the model is built on the meta device with its LoRA
adapters, and each parameter is placed by the same rules `parallelize` uses (the tensor-
parallel plan of `tensor_parallel.tp_plan`, experts split over ep, FSDP over dp × cp, layers
cut into pipeline stages by `pipeline.split_layers`). So the weight, gradient and optimizer
bytes a rank holds are counted, not estimated. Activations follow what our modules save for
backward, term by term (`activation_elements`; checked against `trillora.plan.memory_probe` measurements
within 25% in the tests). Communication is the bytes each rank puts on the wire per step for
every collective the engine issues; time is compute at an achievable fraction of peak plus
communication without overlap (an upper bound), times the pipeline bubble.

Shape legend in comments: m rows per microbatch, T tokens per row, t = T / cp.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from ..models.args import ModelArgs
from ..parallel.dims import ParallelDims
from .clusters import Cluster
from .flops import training_flops


def short(layout: ParallelDims) -> str:
    """pp2×dp16×cp2×ep16 +fsdp+ac: the degrees above 1 and the switches that are on."""
    parts = [
        f"{k}{v}"
        for k, v in (("pp", layout.pp), ("dp", layout.dp), ("cp", layout.cp), ("tp", layout.tp), ("ep", layout.ep))
        if v > 1
    ]
    flags = [
        f
        for f, on in (
            ("fsdp", layout.fsdp and layout.dp * layout.cp > 1),
            ("sp", layout.sp),
            ("vocab", layout.vocab_parallel),
            ("ac", layout.activation_checkpoint_every),
        )
        if on
    ]
    return "×".join(parts or ["1"]) + (" +" + "+".join(flags) if flags else "")


@dataclass(frozen=True)
class Workload:
    seq_len: int = 32768
    rollouts_per_step: int = 512  # prompts × group size: rows trained per optimizer step
    micro_batch_rows: int = 1
    passes: int = 1  # epochs × minibatches; > 1 needs an old-logprob pass first
    kl: bool = False  # a reference-logprob pass (LoRA: adapter off; full: a frozen copy of the base)


@dataclass(frozen=True)
class Training:
    """LoRA (rank, targets, expert rank) or full-parameter training; base weight precision."""

    lora_rank: int = 128
    expert_rank: int = 0  # 0: the same as lora_rank
    targets: tuple[str, ...] = ("attention", "mlp", "shared_experts", "experts")
    full: bool = False
    base_bytes: int = 2  # bf16 (1 = fp8 base for LoRA)


VOCAB = "vocab"  # a Footprint bucket's split: the head's vocabulary rows, over tp only when vocab_parallel
ADAPTER_STATE_BYTES = 16  # fp32 weight + fp32 gradient + AdamW m and v
FULL_STATE_BYTES = 18  # bf16 weight + fp32 gradient + fp32 master weight + AdamW m and v


class Footprint:
    """A model's parameters with their placement kinds, counted once on the meta device."""

    def __init__(self, args: ModelArgs, training: Training):
        from .. import lora
        from ..models import build_model
        from ..models.moe import GroupedExperts
        from ..parallel.tensor_parallel import tp_plan

        self.args, self.training = args, training
        model = build_model(args, device="meta")
        if not training.full:
            lora.apply_lora(
                model,
                lora.LoraConfig(
                    rank=training.lora_rank, targets=training.targets, expert_rank=training.expert_rank or None
                ),
            )
        plan = tp_plan(model)
        experts = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        # (place, tp_split, expert, trainable) -> numel; place: layer index, "embed" or "head"
        self.buckets: dict[tuple, int] = {}
        for name, p in model.named_parameters():
            module, _, leaf = name.rpartition(".")
            if name.startswith("model.layers."):
                place = int(name.split(".")[2])
            else:
                place = "embed" if name.startswith("model.embed_tokens") else "head"
            style = type(plan.get(module)).__name__
            split = (style == "LoraColwiseParallel" and leaf in ("weight", "bias", "lora_B")) or (
                style == "LoraRowwiseParallel" and leaf in ("weight", "lora_A")
            )
            if module == "lm_head" and leaf in ("weight", "lora_B"):
                split = VOCAB  # split over tp only with a vocabulary-parallel head
            trainable = training.full or leaf.startswith("lora_")
            key = (place, split, id(p) in experts, trainable)
            self.buckets[key] = self.buckets.get(key, 0) + p.numel()

    @cached_property
    def trainable(self) -> int:
        return sum(n for (_, _, _, t), n in self.buckets.items() if t)

    @cached_property
    def total(self) -> int:
        return sum(self.buckets.values())

    def stage_places(self, layout: ParallelDims) -> list[set]:
        from ..parallel.pipeline import split_layers

        ranges = split_layers(self.args.num_layers, layout.pp)
        stages = [set(r) for r in ranges]
        stages[0].add("embed")
        stages[-1].add("head")
        return stages

    def rank_numel(self, layout: ParallelDims, places: set, trainable: bool, experts: bool | None = None) -> float:
        """Elements of (trainable or frozen) parameters one rank of a stage holding `places` keeps
        (`experts`: only routed-expert tensors, only the others, or both when None)."""
        total = 0.0
        for (place, split, expert, train), n in self.buckets.items():
            if place not in places or train != trainable or experts not in (None, expert):
                continue
            share = n / (layout.tp if split is True or (split == VOCAB and layout.vocab_parallel) else 1)
            if expert:
                share /= layout.ep
            total += share / (shard_group(layout, expert) if layout.fsdp else 1)
        return total

    def unit_numel(self, places: set, layout: ParallelDims, experts: bool | None = None) -> tuple[float, float]:
        """(frozen, trainable) elements of a stage's FSDP units before sharding (what all-gathers rebuild)."""
        flat = replace(layout, fsdp=False)
        return self.rank_numel(flat, places, False, experts), self.rank_numel(flat, places, True, experts)


def shard_group(layout: ParallelDims, expert: bool) -> int:
    """Ranks a parameter is sharded over by FSDP (replicas of it): dp × cp, or for an expert
    shard its replicas edp × cp (1: a single owner, left out of FSDP)."""
    return (layout.dp // layout.ep) * layout.cp if expert else layout.dp * layout.cp


def activation_elements(args: ModelArgs, training: Training, tp: int = 1) -> dict[str, float]:
    """Elements our modules save for backward, per token: "attention" and "mlp" / "moe" per
    decoder layer, "head" once (fp32 log-softmax, last stage). Read off the autograd graph of
    our modules term by term (e.g. flash attention keeps q, k, v, its output and log-sum-exp; a
    LoRA layer keeps its input and A·x; a frozen linear keeps nothing). Heads split over tp;
    routed experts see every token of the tp group."""
    c, h = args.hidden_size, args.num_heads / tp
    on = set() if training.full else set(training.targets)
    r = training.lora_rank
    attention = 2 * c + 2  # input and post-attention RMSNorm: x and 1/rms
    if args.kv_lora_rank:  # MLA: latent norms; flash over per-head K and V padded to the q/k head size
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        latents = (args.q_lora_rank or 0) + args.kv_lora_rank
        attention += latents + 2 + h * (2 * qk + 2 * max(args.v_head_dim, qk) + 1)
        if "attention" in on:
            attention += c + latents + h * args.v_head_dim + 5 * r
    else:  # GQA: q/k norms, then q, k, v, output and log-sum-exp of flash attention
        d, kv = args.head_dim, args.num_kv_heads / tp
        attention += (h + kv) * (d + 1) + 2 * h * d + 2 * kv * d + h
        if "attention" in on:
            attention += c + 4 * r
    k, i = args.top_k, args.moe_intermediate_size

    def swiglu(width: float, role: str) -> float:  # gate and up outputs, SiLU; LoRA: input, down input, A·x
        return 3 * width + ((c + width + 3 * r) if role in on else 0)

    out = {"attention": attention, "mlp": swiglu(args.intermediate_size / tp, "mlp"), "head": float(args.vocab_size)}
    if args.num_experts:  # router probabilities and choices, gate/up outputs and SiLU, weighted rows
        moe = args.num_experts + 3 * k + 3 * k * i + k * c
        if "experts" in on:  # dispatched rows and down inputs kept for the adapters, A·x of gate, up, down
            moe += 2 * k * c + 3 * k * i + 3 * k * r
        if args.n_shared_experts:
            moe += swiglu(i * args.n_shared_experts / tp, "shared_experts")
        out["moe"] = moe
    if training.full:  # every frozen linear's input is now kept for its weight gradient
        out["attention"] += 2 * c
        out["mlp"] += c + args.intermediate_size / tp
        if args.num_experts:
            out["moe"] += 2 * k * c + k * i
    return out


def _trains_attention(training: Training) -> bool:
    return training.full or "attention" in training.targets


def first_trained_layer(args: ModelArgs, training: Training) -> int:
    """The first decoder layer with a trainable weight (activations before it need no gradient)."""
    if _trains_attention(training):
        return 0
    for i in range(args.num_layers):
        roles = {"experts", "shared_experts"} if i in args.moe_layers else {"mlp"}
        if roles & set(training.targets):
            return i
    return args.num_layers


@dataclass
class Estimate:
    layout: ParallelDims
    memory: dict[str, float] = field(default_factory=dict)  # bytes per device by part
    comm: dict[str, float] = field(default_factory=dict)  # bytes per device per step by collective
    compute_s: float = 0.0
    comm_s: float = 0.0
    bubble: float = 0.0

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.comm_s) * (1 + self.bubble)


def estimate(
    fp: Footprint, layout: ParallelDims, work: Workload, cluster: Cluster, fullest: str = "parameters"
) -> Estimate:
    """Memory, traffic and time of one optimizer step under `layout`, on its fullest pipeline stage:
    the one holding the most `parameters`, or needing the most `memory` (the head's logits count on
    the last stage; the service planner asks for this one).
    Activation checkpointing is counted as every layer's (any `activation_checkpoint_every` > 0)."""
    stages = fp.stage_places(layout)

    def held(stage: int) -> Estimate:
        est = Estimate(layout)
        _memory(
            est, fp, layout, work, cluster, stages[stage], sorted(p for p in stages[stage] if isinstance(p, int)), stage
        )
        return est

    if fullest == "memory":
        per_stage = [held(s) for s in range(layout.pp)]
        worst = max(range(layout.pp), key=lambda s: per_stage[s].memory_total)
    else:
        worst = max(range(layout.pp), key=lambda s: sum(fp.rank_numel(layout, stages[s], t) for t in (False, True)))
        per_stage = {worst: held(worst)}
    est, places = per_stage[worst], stages[worst]
    layers_here = sorted(p for p in places if isinstance(p, int))
    _traffic(est, fp, layout, work, cluster, places, layers_here, worst)
    _time(est, fp, layout, work, cluster)
    return est


def _forward_passes(layout: ParallelDims, work: Workload) -> int:
    """Forward passes over the training tokens: old and reference logprobs, recompute, training."""
    return 1 + (work.passes > 1) + work.kl + bool(layout.activation_checkpoint_every)


def _kv_width(args: ModelArgs, tp: int) -> float:
    """K and V elements per token that context parallelism gathers (MLA: expanded per head)."""
    if args.kv_lora_rank:
        return args.num_heads / tp * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
    return 2 * args.num_kv_heads / tp * args.head_dim


def _memory(est, fp, layout, work, cluster, places, layers_here, worst) -> None:
    args, training = fp.args, fp.training
    frozen, trainable = fp.rank_numel(layout, places, False), fp.rank_numel(layout, places, True)
    if training.full:
        est.memory["weights + grads + optimizer"] = trainable * FULL_STATE_BYTES
        if work.kl:
            est.memory["reference copy"] = trainable * 2
    else:
        est.memory["base weights"] = frozen * training.base_bytes
        est.memory["adapter + grads + optimizer"] = trainable * ADAPTER_STATE_BYTES
    # activations of one microbatch on this rank: m rows × t tokens
    tokens = work.micro_batch_rows * work.seq_len / layout.cp
    per = activation_elements(args, training, layout.tp)
    first = first_trained_layer(args, training)  # autograd saves nothing upstream of the first trained weight
    kinds = [
        (per["attention"] if i > first or (i == first and _trains_attention(training)) else 0.0)
        + (per["moe"] if i in args.moe_layers else per["mlp"]) * (i >= first)
        for i in layers_here
    ]
    if layout.sp:  # norms and the residual on a tp-th of the tokens
        kinds = [x - (1 - 1 / layout.tp) * 2 * args.hidden_size for x in kinds]
    gathered_kv = (layout.cp - 1) / layout.cp * work.seq_len * work.micro_batch_rows * _kv_width(args, layout.tp)
    microbatches = max(1, work.rollouts_per_step // (layout.dp * work.micro_batch_rows))
    in_flight = 1  # microbatches whose activations a stage holds at once: 1F1B fills the pipeline, GPipe all
    if layout.pp > 1:
        in_flight = microbatches if layout.pp_schedule == "gpipe" else min(layout.pp - worst, microbatches)
    if layout.activation_checkpoint_every:  # layer inputs kept, one layer recomputed at a time
        saved = in_flight * len(kinds) * tokens * args.hidden_size + tokens * max(kinds, default=0.0) + gathered_kv
    else:
        saved = in_flight * (tokens * sum(kinds) + len(kinds) * gathered_kv)
    head = tokens * per["head"] * ("head" in places) / (layout.tp if layout.vocab_parallel else 1)
    est.memory["activations"] = saved * cluster.act_bytes + head * 4 * in_flight
    # backward's largest short-lived buffers: the logits' gradient next to the log-softmax, or a
    # few hidden-size gradients on a stage without the head
    est.memory["transient"] = max(2 * head * 4, 4 * tokens * args.hidden_size * cluster.act_bytes)
    if layout.fsdp and layout.dp * layout.cp > 1:  # FSDP keeps a gathered layer in use and the next one prefetched
        weight = 2 if training.full else 4  # bytes of a trainable parameter as gathered

        def gathered(i: int) -> float:
            parts = [fp.unit_numel({i}, layout, e) for e in (False, True) if shard_group(layout, e) > 1]
            return sum(f * training.base_bytes + t * weight for f, t in parts)

        est.memory["fsdp gathered layers"] = 2 * max((gathered(i) for i in layers_here), default=0.0)


def _traffic(est, fp, layout, work, cluster, places, layers_here, worst) -> None:
    """Bytes this rank puts on the wire per step, per collective, and the time they take."""
    args, training = fp.args, fp.training
    rows = work.rollouts_per_step / layout.dp  # rows this data-parallel rank trains
    tokens = rows * work.seq_len / layout.cp  # tokens through this rank per pass
    calls = _forward_passes(layout, work) + work.passes  # forward passes and backward passes
    act, c = cluster.act_bytes, args.hidden_size
    if layout.tp > 1:  # two all-reduces (or all-gather + reduce-scatter) per layer and pass
        est.comm["tp"] = 2 * (layout.tp - 1) / layout.tp * len(layers_here) * tokens * c * act * 2 * calls
    if layout.ep > 1:  # dispatch and combine of every routed copy of a token
        moe_here = len([i for i in layers_here if i in args.moe_layers])
        est.comm["ep all-to-all"] = (layout.ep - 1) / layout.ep * moe_here * tokens * args.top_k * c * act * 2 * calls
    if layout.cp > 1:
        est.comm["cp K/V"] = (
            (layout.cp - 1)
            / layout.cp
            * len(layers_here)
            * rows
            * work.seq_len
            * _kv_width(args, layout.tp)
            * act
            * calls
        )
    if layout.pp > 1:  # activations forward, their gradients backward (a middle stage sends both ways)
        est.comm["pp p2p"] = tokens * c * act * calls * (1 if worst in (0, layout.pp - 1) else 2)
    layers, root = {p for p in places if isinstance(p, int)}, {p for p in places if not isinstance(p, int)}
    weight = 2 if training.full else 4  # bytes of a trainable parameter as gathered
    for expert in (False, True):  # dense tensors over dp × cp, expert shards over their edp × cp replicas
        g = shard_group(layout, expert)
        if g == 1:
            continue
        frozen, train = fp.unit_numel(places, layout, expert)
        grad_bytes = train * 4 * work.passes  # gradients are reduced in fp32, once per backward
        if layout.fsdp:  # layers gathered for every forward and backward; the root (embeddings, head)
            # stays gathered from its forward through its backward
            lf, lt = fp.unit_numel(layers, layout, expert)
            rf, rt = fp.unit_numel(root, layout, expert)
            gathered = (lf * training.base_bytes + lt * weight) * calls + (
                rf * training.base_bytes + rt * weight
            ) * _forward_passes(layout, work)
            _add(est.comm, "fsdp all-gather", (g - 1) / g * gathered)
            _add(est.comm, "fsdp reduce-scatter", (g - 1) / g * grad_bytes)
        else:
            _add(est.comm, "dp all-reduce", 2 * (g - 1) / g * grad_bytes)
    est.comm_s = sum(nbytes / (_bandwidth(name, layout, cluster) * 1e9) for name, nbytes in est.comm.items())


def _time(est, fp, layout, work, cluster) -> None:
    """Compute at `cluster.mfu` of peak (`training_flops`), and the pipeline bubble."""
    flops = training_flops(fp, work.seq_len)
    per_token = flops["forward"] * _forward_passes(layout, work) + flops["backward"] * work.passes
    total = per_token * work.rollouts_per_step * work.seq_len
    est.compute_s = total / (layout.world_size * cluster.peak_tflops * 1e12 * cluster.mfu)
    microbatches = max(1, work.rollouts_per_step // (layout.dp * work.micro_batch_rows))
    est.bubble = (layout.pp - 1) / microbatches if layout.pp > 1 else 0.0
    if layout.pp_schedule in ("interleaved_zero_bubble", "zbv"):  # weight gradients fill most of the bubble
        est.bubble /= 4
    elif layout.pp_schedule == "interleaved_1f1b":  # two stages per rank halve it
        est.bubble /= 2


def _add(d: dict[str, float], key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


def _bandwidth(collective: str, layout: ParallelDims, cluster: Cluster) -> float:
    """GB/s of the group a collective runs on: intra-node when its ranks fit in one node
    (ranks are laid out pp, dp, cp, tp with tp fastest; ep is the fastest part of dp)."""
    stride_size = {
        "tp": (1, layout.tp),
        "cp K/V": (layout.tp, layout.cp),
        "ep all-to-all": (layout.tp * layout.cp, layout.ep),
        "pp p2p": (layout.tp * layout.cp * layout.dp, 2),
    }
    stride, size = stride_size.get(collective, (layout.tp, layout.dp * layout.cp))
    return cluster.intra_node_gbps if stride * size <= cluster.gpus_per_node else cluster.inter_node_gbps
