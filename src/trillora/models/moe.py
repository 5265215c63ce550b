"""Mixture of experts: routers, stacked experts computed with grouped GEMM, the MoE block.

Shape legend: T tokens (batch and sequence flattened), C hidden channels, E experts,
K experts per token (top-k), R routed rows (T·K, sorted by expert), I expert hidden size.

Experts are stored stacked, fused the way transformers 5 keeps them in memory:
`gate_up_proj [E, 2I, C]` (gate rows first, then up rows) and `down_proj [E, C, I]`.
Tokens are sorted by expert once per layer; every expert matmul (and, later, every
expert LoRA matmul) then runs as one grouped GEMM over the sorted rows.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .layers import SwiGLU


@dataclass(frozen=True, slots=True)
class ExpertSort:
    """Where each routed row comes from, after sorting the T·K (token, slot) pairs by expert."""

    order: torch.Tensor  # [R] index into the flattened [T*K] choices
    token: torch.Tensor  # [R] source token of each sorted row
    counts: torch.Tensor  # [E] rows per expert (int64, on the same device)

    @staticmethod
    def build(indices_TK: torch.Tensor, num_experts: int) -> ExpertSort:
        flat = indices_TK.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        return ExpertSort(order=order, token=order // indices_TK.shape[-1], counts=counts)


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm's backward on CPU rejects expanded (stride-0) gradients.
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """grouped GEMM needs 16-byte aligned rows on both operands, and a kernel for the dtype there."""
    return _aligned(x, w) and x.dtype == w.dtype and _grouped_kernel_takes(x.device.type, x.dtype)


def _aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[-2] % align == 0


@functools.cache
def _say_unaligned(inner: int, outer: int, dtype: torch.dtype) -> None:
    """Once per shape: the fallback is correct but a loop over experts, so a user should know."""
    per_row = 16 // torch.tensor([], dtype=dtype).element_size()
    warnings.warn(
        f"grouped GEMM needs 16-byte rows: a {inner}-wide input or {outer}-wide output in {dtype} is not, so "
        f"these expert products run as a loop over experts (slower, same result); LoRA ranks and widths that "
        f"are multiples of {per_row} avoid it",
        stacklevel=3,
    )


@functools.cache
def _grouped_kernel_takes(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm has a kernel for `dtype` on this kind of device (on CUDA it
    depends on the chip and the torch build): asked once with a tiny product."""
    try:
        x = torch.ones(4, 8, device=device_type, dtype=dtype)
        w = torch.ones(2, 8, 8, device=device_type, dtype=dtype)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([2, 4], dtype=torch.int32, device=device_type))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype an adapter's grouped GEMMs run in. torch's grouped GEMM has fast kernels, forward
    and backward, for bf16 on CUDA; in fp32 its backward is one matmul per group (measured on an
    H200: 62k matmuls, 1.5 s of launches in one forward_backward of 8 adapters on four Qwen3-30B-A3B
    layers). So with bf16 activations on CUDA they run in bf16, as autocast would; the adapter's
    weights, gradients and optimizer stay fp32. Elsewhere (CPU, fp32 runs) the adapter's dtype."""
    if x.device.type == "cuda" and x.dtype == torch.bfloat16 and _grouped_kernel_takes("cuda", x.dtype):
        return x.dtype
    return w.dtype


MAX_GROUPS = 512
"""Groups per grouped GEMM call: torch's CUDA kernel refuses more than 1024 (seen on an H200 with
8 adapters x 128 experts), so longer group lists go through in slices of whole groups."""


def grouped_linear(
    x_RI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor, grouped: bool = True
) -> torch.Tensor:
    """Rows of x sorted by expert times each expert's weight transposed: [R, I] x [E, O, I] -> [R, O].

    `grouped=False` is the exact per-expert loop, kept as the reference and as
    the fallback for shapes the grouped kernel does not accept.
    """
    if x_RI.shape[0] == 0:  # an empty product, still in the graph: under expert parallelism a rank that
        # received no rows must still run the backward all-to-all its peers wait for
        return x_RI @ w_EOI[0].transpose(0, 1)
    if grouped and not _aligned(x_RI, w_EOI):
        _say_unaligned(x_RI.shape[-1], w_EOI.shape[-2], x_RI.dtype)
    if grouped and grouped_mm_ok(x_RI, w_EOI):
        if counts_E.shape[0] > MAX_GROUPS:  # e.g. 128 experts x 8 adapters: in slices of whole groups
            sizes = [int(c.sum()) for c in counts_E.split(MAX_GROUPS)]
            return torch.cat(
                [
                    grouped_linear(x, w, c)
                    for x, w, c in zip(
                        x_RI.split(sizes), w_EOI.split(MAX_GROUPS), counts_E.split(MAX_GROUPS), strict=True
                    )
                ]
            )
        offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
        return _contiguous_grad(torch._grouped_mm(x_RI.contiguous(), w_EOI.transpose(-2, -1), offs=offs))
    chunks = torch.split(x_RI, counts_E.tolist())
    return torch.cat([chunk @ w_EOI[e].T for e, chunk in enumerate(chunks)])


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU on rows already sorted by expert: `forward(x_RC, counts_E)`.

    Sorting and combining live in `dispatch_combine`, outside this module, so expert
    parallelism can wrap this module's call (send rows to the ranks owning their experts,
    bring results back) without the module knowing. `num_experts` stays the global count.
    """

    def __init__(
        self, num_experts: int, dim: int, hidden: int, bias: bool = False, limit: float = 0.0, alpha: float = 1.702
    ):
        super().__init__()
        self.num_experts, self.hidden = num_experts, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        if bias:  # gpt-oss; gate entries first, then up, like the rows of gate_up_proj
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))
        self.limit, self.alpha = limit, alpha
        self.grouped = True  # False: per-expert loop (reference)

    def forward(
        self,
        x_RC: torch.Tensor,
        counts_E: torch.Tensor,
        token_R: torch.Tensor | None = None,
        adapter_R: torch.Tensor | None = None,
    ) -> torch.Tensor:
        gate_up_R2I = self._biased(
            self.project(x_RC, "gate_up_proj", counts_E, token_R, adapter_R), "gate_up_proj_bias", counts_E
        )
        gate, up = gate_up_R2I.chunk(2, dim=-1)
        if self.limit:  # gpt-oss: clamped, with a sharper sigmoid and up shifted by one
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            h = (up + 1) * gate * torch.sigmoid(self.alpha * gate)
        else:
            h = F.silu(gate) * up
        return self._biased(
            self.project(h, "down_proj", counts_E, token_R, adapter_R), "down_proj_bias", counts_E
        )  # [R, C]

    def _biased(self, y_RO: torch.Tensor, name: str, counts_E: torch.Tensor) -> torch.Tensor:
        """Add each row's expert's bias (rows are sorted by expert, `counts_E` per expert)."""
        bias = getattr(self, name, None)
        if bias is None:
            return y_RO
        return y_RO + bias.to(y_RO.dtype).repeat_interleave(counts_E, dim=0, output_size=y_RO.shape[0])

    def project(
        self,
        x_R: torch.Tensor,
        name: str,
        counts_E: torch.Tensor,
        token_R: torch.Tensor | None = None,
        adapter_R: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One stacked projection over expert-sorted rows; the hook point for expert LoRA
        (`token_R`, each row's source token, tells per-row adapters which rows are whose; rows
        that expert parallelism brought from other ranks carry their adapter, `adapter_R`)."""
        return grouped_linear(x_R, getattr(self, name), counts_E, self.grouped)


def dispatch_combine(
    experts: nn.Module, x_TC: torch.Tensor, indices_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """Sort the T·K (token, expert) pairs by expert, run the experts, weight and sum back per token."""
    sort = ExpertSort.build(indices_TK, experts.num_experts)
    y_RC = experts(
        x_TC.index_select(0, sort.token), sort.counts, token_R=sort.token
    )  # backward: index_add, not a sorted index_put
    y_RC = y_RC * weights_TK.reshape(-1)[sort.order, None].to(y_RC.dtype)
    return torch.zeros_like(x_TC).index_add_(0, sort.token, y_RC.to(x_TC.dtype))


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE: softmax over experts, top-k, optionally renormalised over the chosen k."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.top_k, args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))

    def logits(self, x_TC: torch.Tensor) -> torch.Tensor:
        return F.linear(x_TC, self.weight)  # [T, E]

    def forward(self, x_TC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_TE = self.logits(x_TC)
        probs_TE = logits_TE.float().softmax(dim=-1)
        weights_TK, indices_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK.to(logits_TE.dtype), indices_TK

    def weights_for(self, x_TC: torch.Tensor, indices_TK: torch.Tensor) -> torch.Tensor:
        """Gate weights this router gives to already-chosen experts (router replay)."""
        probs_TE = self.logits(x_TC).float().softmax(dim=-1)
        weights_TK = probs_TE.gather(1, indices_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK.to(x_TC.dtype)


class TopKSoftmaxRouter(nn.Module):
    """gpt-oss: biased logits, top-k, then a softmax over the k chosen logits only."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.top_k
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.bias = nn.Parameter(torch.empty(args.num_experts))

    def logits(self, x_TC: torch.Tensor) -> torch.Tensor:
        return F.linear(x_TC, self.weight, self.bias)  # [T, E]

    def forward(self, x_TC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top_TK, indices_TK = self.logits(x_TC).topk(self.top_k, dim=-1)
        return top_TK.softmax(dim=-1), indices_TK

    def weights_for(self, x_TC: torch.Tensor, indices_TK: torch.Tensor) -> torch.Tensor:
        return self.logits(x_TC).gather(1, indices_TK).softmax(dim=-1)


class SigmoidRouter(nn.Module):
    """DeepSeek-V3 / Kimi K2 (`noaux_tc`): sigmoid scores, a bias that steers only the choice,
    group-limited top-k (pick `topk_group` of `n_group` groups by their top-2 sum), and
    `routed_scaling_factor` on the (renormalised) weights."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.top_k, args.norm_topk_prob
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.scaling = args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(args.num_experts, dtype=torch.float32))

    def logits(self, x_TC: torch.Tensor) -> torch.Tensor:
        return F.linear(x_TC.float(), self.weight.float())  # [T, E], in fp32 as the reference does

    def scores(self, x_TC: torch.Tensor) -> torch.Tensor:
        return self.logits(x_TC).sigmoid()

    def forward(self, x_TC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores_TE = self.scores(x_TC)
        choice_TE = scores_TE + self.e_score_correction_bias
        if self.n_group > 1:
            t, e = choice_TE.shape
            grouped = choice_TE.view(t, self.n_group, e // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            keep = group_score.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice_TE = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(t, e)
        indices_TK = choice_TE.topk(self.top_k, dim=-1).indices
        return self._weights(scores_TE, indices_TK), indices_TK

    def _weights(self, scores_TE: torch.Tensor, indices_TK: torch.Tensor) -> torch.Tensor:
        weights_TK = scores_TE.gather(1, indices_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_TK * self.scaling

    def weights_for(self, x_TC: torch.Tensor, indices_TK: torch.Tensor) -> torch.Tensor:
        return self._weights(self.scores(x_TC), indices_TK)


ROUTERS: dict[str, type[nn.Module]] = {
    "softmax": SoftmaxRouter,
    "sigmoid": SigmoidRouter,
    "topk_softmax": TopKSoftmaxRouter,
}


class MoE(nn.Module):
    """Router + routed experts (+ shared experts). The router is its own module (`gate`), called
    once per forward on the flattened tokens, so its choice can be observed or replaced from
    outside with a forward hook (`trillora.rollout.routing`, `trillora.trainer.router_replay`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = ROUTERS[args.router](args)
        self.experts = GroupedExperts(
            args.num_experts,
            args.hidden_size,
            args.moe_intermediate_size,
            bias=args.expert_bias,
            limit=args.swiglu_limit,
            alpha=args.swiglu_alpha,
        )
        if args.n_shared_experts:
            self.shared_experts = SwiGLU(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TC = x.reshape(-1, shape[-1])
        weights_TK, indices_TK = self.gate(x_TC)
        out = dispatch_combine(self.experts, x_TC, indices_TK, weights_TK).view(shape)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


def set_grouped_gemm(model: nn.Module, enabled: bool) -> None:
    """Switch every expert block between grouped GEMM and the exact per-expert loop."""
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.grouped = enabled


def shard_experts(module: GroupedExperts, ep_rank: int, ep_size: int) -> None:
    """Keep this rank's slice of every stacked tensor [E, ...] (base and LoRA); a tensor that
    already holds E/ep rows is taken to be this rank's (a base loaded as `load_model(experts=...)`)."""
    local = module.num_experts // ep_size
    keep = slice(ep_rank * local, (ep_rank + 1) * local)
    for name, p in list(module.named_parameters(recurse=False)):
        if ep_size > 1 and p.shape[0] == local:
            continue
        if p.shape[0] != module.num_experts:
            raise ValueError(f"{name} has {p.shape[0]} rows, expected one per expert ({module.num_experts})")
        module.register_parameter(name, nn.Parameter(p.detach()[keep].clone(), requires_grad=p.requires_grad))
