"""Context parallelism: the sequence of every row split over `cp` ranks, for long RL traces.

Load balance. Under a causal mask a late token attends to everything before it, so cutting
the sequence into cp contiguous pieces would give the last rank most of the work. Instead the
(padded) sequence of T tokens is cut into 2·cp chunks and rank r takes chunks r and
2·cp-1-r: one early and one late chunk each, the same number of query-key pairs on every
rank (the "zig-zag" layout of ring-attention implementations).

What crosses ranks. Everything token-wise (embeddings, norms, projections, MLP, MoE routing
and experts, the head) runs on the rank's own tokens unchanged. Attention all-gathers K and V
over cp (their gradients are reduce-scattered back in backward) and each local query chunk
attends to exactly the keys it sees in the single-process run: on CPU by flash-kernel blocks
merged by log-sum-exp (`block_attention`: no mask or score matrix is kept), elsewhere by SDPA
with a [t, T] mask of global positions. A ring (K/V blocks passed around while computing)
would hold one block at a time instead of the whole gathered sequence; the all-gather is
simpler and moves the same bytes.

The trainer wants per-token logprobs of whole rows on every rank: `gather_sequence`
all-gathers the local [B, t] logprobs in forward and, in backward, keeps only this rank's
positions of the gradient. Every cp rank then computes the same loss from the same tensor, so
that gradient is already identical everywhere and nothing needs summing; the LoRA gradients
(from the rank's own tokens) are summed over cp with data parallelism ("dp_cp").

Shape legend: B rows, T padded tokens, t = T/cp local tokens, H/K heads, D head dim.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd

from ..models.attention import InnerAttention, attend
from .block_attention import block_causal_attention, zigzag_plan


def padded_length(length: int, cp: int) -> int:
    """Rows are right-padded to a multiple of 2·cp so each rank gets two equal chunks."""
    return -(-length // (2 * cp)) * (2 * cp)


def local_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions rank `rank` holds of a sequence of `length` (a multiple of 2·cp): chunks r and 2cp-1-r."""
    if length % (2 * cp):
        raise ValueError(f"sequence length {length} is not a multiple of 2 × cp = {2 * cp}")
    size = length // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


class _GatherSequence(torch.autograd.Function):
    """[B, t, ...] per rank -> [B, T, ...] in global order; backward keeps this rank's columns of the gradient."""

    @staticmethod
    def forward(ctx, x_Bt, positions_T, local_t, group):
        ctx.local = local_t
        parts = [torch.empty_like(x_Bt) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_Bt.contiguous(), group=group)
        out = x_Bt.new_empty(x_Bt.shape[0], positions_T.numel(), *x_Bt.shape[2:])
        out[:, positions_T] = torch.cat(parts, dim=1)  # rank order -> position order
        return out

    @staticmethod
    def backward(ctx, grad_BT):
        return grad_BT[:, ctx.local], None, None, None


class ContextParallel:
    """The sequence split of one cp group; `shard` is what the model sees, `gather` what the loss sees."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.query_positions: torch.Tensor | None = None  # [t] this rank's positions in the current batch
        self.key_positions: torch.Tensor | None = None  # [T] positions of the gathered keys (rank order)
        self.active = True
        """Off (`off()`): the model runs whole rows with masks and a KV cache, as without cp; a
        service decodes so, every cp rank the same tokens, and splits only its training passes."""

    @contextlib.contextmanager
    def off(self):
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def local_width(self, length: int) -> int:
        """Tokens per row this rank holds of rows of `length` (padded to a multiple of 2·cp)."""
        return self.padded_length(length) // self.size

    def padded_length(self, length: int) -> int:
        return padded_length(length, self.size)

    def set_length(self, length: int, device: torch.device) -> int:
        """Fix the positions of this rank's tokens for rows of `length`; returns the padded length."""
        padded = self.padded_length(length)
        self.query_positions = local_positions(padded, self.size, self.rank).to(device)
        self.key_positions = torch.cat([local_positions(padded, self.size, r) for r in range(self.size)]).to(device)
        self.key_order = torch.argsort(self.key_positions)  # gathered (rank-order) keys -> global order
        self.plan = zigzag_plan([self.rank, 2 * self.size - 1 - self.rank], padded // (2 * self.size))
        return padded

    def shard(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens [B, t] and their positions [B, t]; right-pads to a multiple of 2·cp
        (harmless under a causal mask: no real token sees the padding)."""
        b, length = input_ids.shape
        padded = self.set_length(length, input_ids.device)
        ids = nn.functional.pad(input_ids, (0, padded - length))
        return ids[:, self.query_positions], self.query_positions.expand(b, -1)

    def split(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This rank's positions [B, t, ...] of per-position values [B, T, ...] (zero-padded past T)
        after `shard` fixed the split for rows of T."""
        pad = self.query_positions.shape[0] * self.size - x_BT.shape[1]
        x_BT = torch.cat([x_BT, x_BT.new_zeros(x_BT.shape[0], pad, *x_BT.shape[2:])], dim=1) if pad else x_BT
        return x_BT[:, self.query_positions]

    def next_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token after each of this rank's positions [B, t] (padding past the end)."""
        padded = self.padded_length(input_ids.shape[1])
        ids = nn.functional.pad(input_ids, (0, padded + 1 - input_ids.shape[1]))
        return ids[:, self.query_positions + 1]

    def gather(self, x_Bt: torch.Tensor, length: int) -> torch.Tensor:
        """Per-position values of this rank's tokens [B, t, ...] -> [B, length, ...] of the whole rows, on every
        rank."""
        return _GatherSequence.apply(x_Bt, self.key_positions, self.query_positions, self.group)[:, :length]


class ContextParallelAttention(InnerAttention):
    """Local queries against keys and values gathered from the whole cp group, masked by position."""

    def __init__(self, cp: ContextParallel, window: int = 0):
        super().__init__(window)
        self.cp = cp

    def forward(self, q, k, v, mask, scale, sinks=None):
        if not self.cp.active:
            return super().forward(q, k, v, mask, scale, sinks)
        # the backbone hands a sliding layer its local-index window mask; here the window is re-applied
        # by global position, so only a full layer's mask (padding, a cache) is refused
        if mask is not None and not self.window:
            raise ValueError("context parallel attention takes right-padded rows without a padding mask or KV cache")
        cp = self.cp
        k_all = all_gather_single_autograd(k.contiguous(), gather_dim=2, group=cp.group)  # [B, K, T, D] rank order
        v_all = all_gather_single_autograd(v.contiguous(), gather_dim=2, group=cp.group)
        if q.device.type == "cpu" and not self.window:  # flash blocks, no [t, T] mask or scores kept
            return block_causal_attention(
                q, k_all[:, :, cp.key_order], v_all[:, :, cp.key_order], cp.plan, scale, sinks
            )
        # sliding windows (gpt-oss) and CUDA: SDPA with a [t, T] mask of global positions
        q_pos, k_pos = cp.query_positions[:, None], cp.key_positions[None, :]
        allowed = k_pos <= q_pos  # [t, T] causal by global position
        if self.window:
            allowed = allowed & (k_pos > q_pos - self.window)
        return attend(q, k_all, v_all, allowed[None, None], scale, sinks)


def apply_context_parallel(model: nn.Module, group, rank: int, size: int) -> ContextParallel | None:
    """Swap every attention's inner product for the gathering one and shard the backbone's input.

    After this `model.hidden_states(ids)` returns this rank's tokens [B, t, C];
    `trillora.policy.logprobs.token_logprobs` finds `model.context_parallel` and returns whole rows."""
    if size == 1:
        return None
    cp = ContextParallel(group, rank, size)
    for m in list(model.modules()):
        for name, child in list(m.named_children()):
            if type(child) is InnerAttention:
                setattr(m, name, ContextParallelAttention(cp, child.window))

    def shard_inputs(module, args, kwargs):
        if not cp.active:
            return None
        input_ids, attention_mask, position_ids, cache = (list(args) + [None] * 4)[:4]
        if attention_mask is not None or position_ids is not None or cache is not None:
            raise ValueError(
                "under context parallelism the model takes right-padded input_ids only "
                "(no attention_mask, position_ids or cache)"
            )
        ids, positions = cp.shard(input_ids)
        return (ids, None, positions, None), {}

    model.model.register_forward_pre_hook(shard_inputs, with_kwargs=True)
    model.context_parallel = cp
    return cp
