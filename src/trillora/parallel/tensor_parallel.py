"""Tensor parallelism as plans over module names, applied from outside with `parallelize_module`.

Column-parallel layers split their output features, row-parallel ones their input
features (Megatron's pairing: one all-reduce per attention block and per MLP). A LoRA
adapter follows its base layer so its math stays local: column-parallel W [O/tp, I] gets
A [r, I] replicated and B [O/tp, r] split; row-parallel W [O, I/tp] gets A [r, I/tp] split
and B [O, r] replicated, whose partial output joins the base's partial sum in the same
all-reduce. Attention splits heads (q/k/v and MLA's up-projections column-wise, o_proj
row-wise, gpt-oss's per-head sinks with them); MLA's small down-projections (q_a_proj, kv_a_proj_with_mqa) stay
replicated.
Routers, routed experts (see expert_parallel), norms, embeddings and the head are replicated.

With sequence parallelism (`sp`), the residual stream between blocks is split over the
sequence (Shard(1) DTensors): the norms run on their slice of tokens (replicated weights),
each attention / MLP / MoE block all-gathers its input and its row-parallel output is
reduce-scattered back to sequence shards instead of all-reduced; the embedding output is
split, the head gathers. Same bytes as plain TP, a tp-th of the activations for the norms
and the residual.

One MLA detail: the rope part of kv_a_proj_with_mqa's output (k_rope, one head shared by all
heads) is used by every rank's local heads outside any DTensor op, so its gradient is a
partial sum over tp; a hook on that layer all-reduces exactly those columns of the gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..models.attention import GQAttention, MLAttention
from ..models.layers import SwiGLU
from ..models.moe import MoE
from ..models.transformer import DecoderLayer, OtherStage


def _distribute(module: nn.Module, mesh, placements: dict[str, list]) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        place = placements.get(name, [Replicate()])
        module.register_parameter(
            name, nn.Parameter(distribute_tensor(param, mesh, place), requires_grad=param.requires_grad)
        )


class LoraColwiseParallel(ColwiseParallel):
    """ColwiseParallel that also places the adapter: A replicated, B split by output row."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {"weight": [Shard(0)], "bias": [Shard(0)], "lora_B": [Shard(0)]})


class LoraRowwiseParallel(RowwiseParallel):
    """RowwiseParallel that also places the adapter: A split by input column, B replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {"weight": [Shard(1)], "lora_A": [Shard(1)]})


class _AllReduceGradColumns(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's columns [start:] over the group."""

    @staticmethod
    def forward(ctx, x, start: int, group):
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        part = grad[..., ctx.start :].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.start :] = part
        return grad, None, None


def _share_k_rope(attn: MLAttention, group) -> None:
    attn.kv_a_proj_with_mqa.register_forward_hook(
        lambda mod, args, out: _AllReduceGradColumns.apply(out, attn.latent, group)
    )


def tp_plan(model: nn.Module, sequence_parallel: bool = False, vocab_parallel: bool = False) -> dict[str, object]:
    """{module name: style} for every layer the family splits. `vocab_parallel`: the head is
    column-parallel over the vocabulary and the model returns this rank's logits slice."""
    plan: dict[str, object] = {}
    row_out = {"output_layouts": Shard(1), "use_local_output": False} if sequence_parallel else {}
    block_out: set[str] = set()  # the row-parallel layers whose output rejoins the residual stream
    for name, m in model.named_modules():
        if isinstance(m, DecoderLayer):
            block_out.add(f"{name}.self_attn.o_proj")
            if isinstance(m.mlp, SwiGLU):
                block_out.add(f"{name}.mlp.down_proj")
    for name, m in model.named_modules():
        if isinstance(m, GQAttention):
            for proj in ("q_proj", "k_proj", "v_proj"):
                plan[f"{name}.{proj}"] = LoraColwiseParallel()
            plan[f"{name}.o_proj"] = LoraRowwiseParallel(**row_out)
        elif isinstance(m, MLAttention):
            plan[f"{name}.{'q_proj' if hasattr(m, 'q_proj') else 'q_b_proj'}"] = LoraColwiseParallel()
            plan[f"{name}.kv_b_proj"] = LoraColwiseParallel()
            plan[f"{name}.o_proj"] = LoraRowwiseParallel(**row_out)
        elif isinstance(m, SwiGLU):  # dense MLP and shared experts
            plan[f"{name}.gate_proj"] = LoraColwiseParallel()
            plan[f"{name}.up_proj"] = LoraColwiseParallel()
            plan[f"{name}.down_proj"] = LoraRowwiseParallel(**(row_out if f"{name}.down_proj" in block_out else {}))
        if sequence_parallel and isinstance(m, DecoderLayer):
            plan[f"{name}.input_layernorm"] = SequenceParallel()
            plan[f"{name}.post_attention_layernorm"] = SequenceParallel()
            # attention(x, rope, mask, cache, index): gather x; the other arguments pass through
            plan[f"{name}.self_attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None),
                use_local_output=True,
            )
            if isinstance(m.mlp, MoE):  # routing and experts see every token; the result goes back to sequence shards
                plan[f"{name}.mlp"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(1),),
                    use_local_output=False,
                )
            else:
                plan[f"{name}.mlp"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                )
    if sequence_parallel:
        plan["model.embed_tokens"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
        plan["model.norm"] = SequenceParallel()
        plan["lm_head"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    if vocab_parallel:
        plan["lm_head"] = LoraColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate())
    # under pipeline parallelism the modules of other stages are placeholders: nothing to split there
    return {name: style for name, style in plan.items() if _has(model, name)}


def _has(model: nn.Module, name: str) -> bool:
    try:
        return not isinstance(model.get_submodule(name), OtherStage)
    except AttributeError:
        return False


def apply_tensor_parallel(
    model: nn.Module, tp_mesh, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> dict[str, object]:
    plan = tp_plan(model, sequence_parallel, vocab_parallel)
    if tp_mesh is not None and tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, plan)
        for m in model.modules():
            if isinstance(m, MLAttention):
                _share_k_rope(m, tp_mesh.get_group())
            if isinstance(m, GQAttention) and hasattr(m, "sinks"):  # gpt-oss: one sink per head, split with the heads
                _distribute(m, tp_mesh, {"sinks": [Shard(0)]})
        if vocab_parallel:  # trillora.policy.logprobs.token_logprobs combines the slices over this group
            model.vocab_parallel_group = tp_mesh.get_group()
    return plan
