"""Several adapters in one pass through one base: each batch row with its own adapter.

A service holding one base for many clients (`policy.adapters`) would otherwise run one pass
per client. Here rows of K adapters share the pass: the base matmuls see every row at once and
each LoRA update runs as a grouped GEMM over the rows grouped per adapter (S-LoRA / Punica's
idea), and, in routed-expert layers, per (expert, adapter): the rows are already sorted by
expert, and within an expert by source token, so when each adapter's rows are consecutive in
the batch the rows of one (expert, adapter) pair are consecutive too. Adapters of different
ranks are zero-padded to the largest rank, which changes no product; an adapter that does not
train a module contributes zero there.

Shape legend: K adapters, B batch rows, T tokens per row, N in / O out features, r the
largest rank, E experts, R routed rows (sorted by expert), C hidden, I expert hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..models.moe import compute_dtype, grouped_linear


def local_part(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a tensor-parallel DTensor, to compute on local parts. A replicated tensor's
    gradient there is partial (this rank sees only its part of the layer's output or input): summed
    when the gradient crosses back (`to_local`'s grad placements)."""
    if not isinstance(t, DTensor):
        return t
    replicated = all(isinstance(p, Replicate) for p in t.placements)
    return t.to_local(grad_placements=[Partial()] * len(t.placements) if replicated else None)


class RowAdapters:
    """Which of K adapters each row of the next forward uses, and the K adapters' scalings.

    `rows[k]` consecutive batch rows use adapter k (0 rows: an adapter other ranks' rows use, kept
    so that every rank of an expert-parallel group numbers the adapters alike). A model call may
    also carry each row repeated n times in place (a sampler's n samples per prompt after one
    prefill): `begin` takes the call's [B, T] input and spreads the adapters over it.
    """

    def __init__(self, rows: list[int], scaling: list[float], device: torch.device):
        if len(rows) != len(scaling) or min(rows, default=0) < 0 or sum(rows) < 1:
            raise ValueError(
                f"one row count >= 0 per adapter, some rows, one scaling per adapter; got rows={rows}, "
                f"scaling={scaling}"
            )
        self.rows = torch.tensor(rows, device=device)
        self.scaling = torch.tensor(scaling, dtype=torch.float32, device=device)  # [K]
        self.k = len(rows)
        self.token_adapter: torch.Tensor | None = None  # [B*T]
        self.counts: torch.Tensor | None = None  # [K] tokens per adapter

    def begin(self, input_ids_BT: torch.Tensor, tokens: int | None = None) -> None:
        """`tokens`: per row as the layers see them, when not T (a context-parallel rank's share)."""
        b, t = input_ids_BT.shape
        t = tokens or t
        total = int(self.rows.sum())
        if b % total:
            raise ValueError(f"a batch of {b} rows cannot hold the {total} rows of the {self.k} adapters")
        self.batch, self.whole, self.tokens = b, b, t
        self.counts, self.token_adapter = self._spread(t)

    def select_rows(self, lo: int, hi: int) -> None:
        """The next layers run rows [lo, hi) of the batch `begin` saw (a pipeline microbatch, in its
        forward and again in its backward's recompute); (0, whole) restores the whole batch."""
        row_adapter = torch.repeat_interleave(
            torch.arange(self.k, device=self.rows.device), self.rows * (self.whole // int(self.rows.sum()))
        )[lo:hi]  # [hi - lo]
        self.batch = hi - lo
        self.counts = torch.bincount(row_adapter, minlength=self.k) * self.tokens  # rows stay grouped per adapter
        self.token_adapter = torch.repeat_interleave(row_adapter, self.tokens)

    def _spread(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens per adapter [K] and each token's adapter [B*t] when every row has t tokens."""
        counts = self.rows * (self.batch // int(self.rows.sum())) * t
        return counts, torch.repeat_interleave(torch.arange(self.k, device=self.rows.device), counts)

    def linear(self, x: torch.Tensor, a_KrN: torch.Tensor, b_KOr: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Each token's own adapter: scaling_k · B_k A_k x, as two grouped GEMMs over adapter groups.

        In a tensor-parallel layer x and the layer's output `like` are DTensors and the stacks hold
        this rank's parts: column-parallel, x whole and B's output rows, so the update is this
        rank's output columns; row-parallel, x's and A's input columns, so the update is a partial
        sum. The update is computed on local tensors and placed as `like` is."""
        if isinstance(x, DTensor):
            d = self.linear(local_part(x), a_KrN, b_KOr, like.to_local())
            return DTensor.from_local(d, like.device_mesh, like.placements, run_check=False)
        dt = compute_dtype(x, a_KrN)
        x_TN = x.reshape(-1, x.shape[-1]).to(dt)
        counts, token_adapter = self.counts, self.token_adapter
        if x.dim() == 3 and x.shape[0] == self.batch and x_TN.shape[0] != counts.sum():
            counts, token_adapter = self._spread(x.shape[1])  # the head of the last positions only (`logits_to_keep`)
        if x_TN.shape[0] != counts.sum():
            raise ValueError(f"{x_TN.shape[0]} token rows, but the adapters' rows hold {int(counts.sum())}")
        h_Tr = grouped_linear(x_TN, a_KrN.to(dt), counts)
        d_TO = grouped_linear(h_Tr, b_KOr.to(dt), counts) * self.scaling[token_adapter, None]
        return d_TO.to(like.dtype).reshape(*x.shape[:-1], -1)

    def expert_groups(
        self, counts_E: torch.Tensor, token_R: torch.Tensor | None, adapter_R: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows per (expert, adapter) pair [E*K], each row's adapter [R] in that grouping, and the
        order that groups the rows (None: they already are).

        `token_R`: each routed row's source token, whose adapter `begin` knows; or `adapter_R`, each
        row's adapter itself (rows that expert parallelism brought from other ranks). Rows of one
        rank come sorted by expert and within it by token, so grouped per (expert, adapter); rows
        of several ranks interleave their adapters within an expert, and are sorted first."""
        if adapter_R is None:
            if token_R is None or token_R.shape[0] != int(counts_E.sum()):
                raise ValueError("per-row expert adapters need each routed row's source token or adapter")
            adapter_R = self.token_adapter[token_R]
        expert_R = torch.repeat_interleave(torch.arange(counts_E.shape[0], device=counts_E.device), counts_E)
        key_R = expert_R * self.k + adapter_R
        order = None
        if key_R.numel() > 1 and bool((key_R[1:] < key_R[:-1]).any()):
            order = torch.argsort(key_R, stable=True)
            adapter_R = adapter_R[order]
        return torch.bincount(key_R, minlength=counts_E.shape[0] * self.k), adapter_R, order

    def experts(
        self,
        x_R: torch.Tensor,
        a_EKrN: torch.Tensor,
        b_EKOr: torch.Tensor,
        groups: torch.Tensor,
        adapter_R: torch.Tensor,
        like: torch.Tensor,
    ) -> torch.Tensor:
        """Each routed row through its (expert, adapter) pair's update."""
        dt = compute_dtype(x_R, a_EKrN)
        h_Rr = grouped_linear(x_R.to(dt), a_EKrN.flatten(0, 1).to(dt), groups)
        return self.experts_second(h_Rr, b_EKOr, groups, adapter_R, like)

    def experts_second(
        self,
        h_Rr: torch.Tensor,
        b_EKOr: torch.Tensor,
        groups: torch.Tensor,
        adapter_R: torch.Tensor,
        like: torch.Tensor,
    ) -> torch.Tensor:
        """The B half of the expert update, scaled by each row's adapter: [R, r] -> [R, O]."""
        d = grouped_linear(h_Rr, b_EKOr.flatten(0, 1).to(h_Rr.dtype), groups) * self.scaling[adapter_R, None]
        return d.to(like.dtype)


def stack_padded(
    tensors: list[torch.Tensor | None], like: torch.Tensor, rank_dim: int, rank: int, dim: int
) -> torch.Tensor:
    """K adapters' tensors of one slot stacked along `dim`, ranks zero-padded to `rank`; an
    adapter without the tensor (None) stacks zeros of `like`'s shape at that rank."""
    out = []
    for t in tensors:
        if t is None:
            shape = list(like.shape)
            shape[rank_dim] = rank
            out.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
            continue
        pad = [0, 0] * (t.dim() - 1 - rank_dim % t.dim()) + [0, rank - t.shape[rank_dim]]
        out.append(F.pad(t, pad))
    return torch.stack(out, dim=dim)
