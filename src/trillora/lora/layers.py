"""LoRA as a transform of existing modules: the module keeps its name, class behaviour and
frozen weights; its class is swapped for a subclass that adds the low-rank update.

Three kinds of base: `nn.Linear` (attention, dense MLP, shared experts, lm_head), the
stacked `GroupedExperts` (routed experts) and the routers (their logits). Keeping the
module in place means base checkpoint names, parallel plans over module names and
router recording all work unchanged with adapters on.

Shape legend: R routed rows (sorted by expert), E experts, C hidden, I expert hidden,
r rank, O/N out/in features.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.moe import GroupedExperts, SigmoidRouter, SoftmaxRouter, TopKSoftmaxRouter, compute_dtype, grouped_linear
from .multi import RowAdapters


class LoraMixin:
    """State every adapted module carries: scaling, dropout, enabled/merged flags."""

    lora_rank: int
    lora_scaling: float
    lora_enabled: bool
    lora_merged: bool

    lora_multi: tuple[RowAdapters, dict[str, torch.Tensor]] | None = None
    """Several adapters at once (`lora.multi`): the rows' adapters and this module's stacked tensors."""

    def _init_lora(self, rank: int, scaling: float, dropout: float) -> None:
        self.lora_rank, self.lora_scaling = rank, scaling
        self.lora_enabled, self.lora_merged = True, False
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def lora_active(self) -> bool:
        return self.lora_enabled and not self.lora_merged

    def lora_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.named_parameters(recurse=False) if n.startswith("lora_"))


def _new(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, device=like.device, dtype=dtype))


def init_a(a: torch.Tensor, how: str, generator: torch.Generator | None) -> None:
    """A [..., r, N]: kaiming-uniform over the fan-in N (PEFT's default) or gaussian(0, 1/r)."""
    with torch.no_grad():
        if a.is_meta:
            return
        if how == "kaiming":
            bound = 1.0 / math.sqrt(a.shape[-1])  # kaiming_uniform with a = sqrt(5)
            a.uniform_(-bound, bound, generator=generator)
        else:
            a.normal_(0.0, 1.0 / a.shape[-2], generator=generator)


class LoraMatrixMixin(LoraMixin):
    """An adapter on a 2-D weight [O, N]: A [r, N], B [O, r], update scaling · B A x."""

    def add_lora(self, rank: int, scaling: float, dropout: float, dtype: torch.dtype) -> None:
        self._init_lora(rank, scaling, dropout)
        out_features, in_features = self.weight.shape
        self.lora_A = _new((rank, in_features), self.weight, dtype)
        self.lora_B = _new((out_features, rank), self.weight, dtype)

    def lora_update(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.lora_multi is not None:
            rows, w = self.lora_multi
            return rows.linear(x, w["lora_A"], w["lora_B"], like)
        h = self.lora_dropout(x).to(self.lora_A.dtype)
        return (F.linear(F.linear(h, self.lora_A), self.lora_B) * self.lora_scaling).to(like.dtype)

    def delta(self) -> dict[str, torch.Tensor]:
        return {"weight": self.lora_scaling * self.lora_B @ self.lora_A}


class LoraLinear(LoraMatrixMixin, nn.Linear):
    """y = W x + b + scaling · B A dropout(x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + self.lora_update(x, y) if self.lora_active else y


class LoraRouterMixin(LoraMatrixMixin):
    """Router logits + scaling · B A x (A [r, C], B [E, r]): the choice of experts sees the update."""

    def logits(self, x_TC: torch.Tensor) -> torch.Tensor:
        logits_TE = super().logits(x_TC)
        return logits_TE + self.lora_update(x_TC, logits_TE) if self.lora_active else logits_TE


class LoraSoftmaxRouter(LoraRouterMixin, SoftmaxRouter):
    pass


class LoraSigmoidRouter(LoraRouterMixin, SigmoidRouter):
    pass


class LoraTopKSoftmaxRouter(LoraRouterMixin, TopKSoftmaxRouter):
    pass


class LoraGroupedExperts(LoraMixin, GroupedExperts):
    """Stacked per-expert adapters for gate, up and down, computed as grouped GEMMs on the
    same expert-sorted rows as the base experts: never a Python loop over experts (unless
    the loop reference is selected) and never a materialised B·A per expert.

    lora_gate_A, lora_up_A [E, r, C];  lora_gate_B, lora_up_B [E, I, r];
    lora_down_A [E, r, I];  lora_down_B [E, C, r].
    """

    def add_lora(self, rank: int, scaling: float, dropout: float, dtype: torch.dtype) -> None:
        self._init_lora(rank, scaling, dropout)
        e, c, i, w = self.num_experts, self.down_proj.shape[1], self.hidden, self.down_proj
        self.lora_gate_A, self.lora_up_A = _new((e, rank, c), w, dtype), _new((e, rank, c), w, dtype)
        self.lora_gate_B, self.lora_up_B = _new((e, i, rank), w, dtype), _new((e, i, rank), w, dtype)
        self.lora_down_A, self.lora_down_B = _new((e, rank, i), w, dtype), _new((e, c, rank), w, dtype)

    def project(
        self,
        x_R: torch.Tensor,
        name: str,
        counts: torch.Tensor,
        token_R: torch.Tensor | None = None,
        adapter_R: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y = super().project(x_R, name, counts)
        if not self.lora_active:
            return y
        if self.lora_multi is not None:
            return y + self._multi_update(x_R, name, counts, token_R, adapter_R, y)
        dt = compute_dtype(x_R, self.lora_down_A)
        h = self.lora_dropout(x_R).to(dt)
        r = self.lora_rank
        if name == "gate_up_proj":
            a = torch.cat([self.lora_gate_A, self.lora_up_A], dim=1).to(dt)  # [E, 2r, C]: one GEMM for both
            h_R2r = grouped_linear(h, a, counts, self.grouped)
            gate = grouped_linear(h_R2r[:, :r].contiguous(), self.lora_gate_B.to(dt), counts, self.grouped)
            up = grouped_linear(h_R2r[:, r:].contiguous(), self.lora_up_B.to(dt), counts, self.grouped)
            delta = torch.cat([gate, up], dim=-1)  # [R, 2I]
        else:
            h_Rr = grouped_linear(h, self.lora_down_A.to(dt), counts, self.grouped)
            delta = grouped_linear(h_Rr, self.lora_down_B.to(dt), counts, self.grouped)
        return y + (delta * self.lora_scaling).to(y.dtype)

    def _multi_update(self, x_R, name, counts, token_R, adapter_R, y) -> torch.Tensor:
        """Rows of several adapters: grouped per (expert, adapter); w holds [E, K, ...] stacks."""
        rows, w = self.lora_multi
        groups, adapter_R, order = rows.expert_groups(counts, token_R, adapter_R)
        if order is not None:  # rows of several ranks: grouped for the GEMMs, put back after
            x_R = x_R[order]
        if name == "down_proj":
            d = rows.experts(x_R, w["lora_down_A"], w["lora_down_B"], groups, adapter_R, y)
        else:
            r = w["lora_gate_A"].shape[2]
            a = torch.cat([w["lora_gate_A"], w["lora_up_A"]], dim=2)  # [E, K, 2r, C]
            dt = compute_dtype(x_R, a)
            h_R2r = grouped_linear(x_R.to(dt), a.flatten(0, 1).to(dt), groups)
            gate = rows.experts_second(h_R2r[:, :r].contiguous(), w["lora_gate_B"], groups, adapter_R, y)
            up = rows.experts_second(h_R2r[:, r:].contiguous(), w["lora_up_B"], groups, adapter_R, y)
            d = torch.cat([gate, up], dim=-1)  # [R, 2I]
        return d if order is None else d[torch.argsort(order)]

    def delta(self) -> dict[str, torch.Tensor]:
        s = self.lora_scaling
        gate = torch.bmm(self.lora_gate_B, self.lora_gate_A)  # [E, I, C]
        up = torch.bmm(self.lora_up_B, self.lora_up_A)
        return {
            "gate_up_proj": s * torch.cat([gate, up], dim=1),
            "down_proj": s * torch.bmm(self.lora_down_B, self.lora_down_A),
        }


LORA_CLASSES: dict[type, type] = {
    nn.Linear: LoraLinear,
    GroupedExperts: LoraGroupedExperts,
    SoftmaxRouter: LoraSoftmaxRouter,
    SigmoidRouter: LoraSigmoidRouter,
    TopKSoftmaxRouter: LoraTopKSoftmaxRouter,
}


def add_adapter(
    module: nn.Module,
    rank: int,
    scaling: float,
    dropout: float,
    dtype: torch.dtype,
    init: str,
    generator: torch.Generator | None = None,
) -> LoraMixin:
    """Turn `module` (in place) into its LoRA subclass with fresh A (random) and B (zero)."""
    cls = LORA_CLASSES.get(type(module))
    if cls is None:
        raise TypeError(
            f"cannot add LoRA to {type(module).__name__}; supported: {', '.join(c.__name__ for c in LORA_CLASSES)}"
        )
    module.__class__ = cls
    module.add_lora(rank, scaling, dropout, dtype)
    for name in module.lora_names():
        if name.endswith("_A"):
            init_a(getattr(module, name), init, generator)
    return module


@torch.no_grad()
def merge_module(module: LoraMixin, sign: float = 1.0) -> None:
    """W += sign · scaling · B A on every adapted base tensor of `module`."""
    for name, d in module.delta().items():
        w = getattr(module, name)
        w.add_(d.to(w.dtype), alpha=sign)
