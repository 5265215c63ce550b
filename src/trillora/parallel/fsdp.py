"""FSDP2 over the data-parallel ranks: the frozen base and the adapters sharded, not copied.

Each decoder layer is one `fully_shard` unit over the dp × cp mesh (context-parallel ranks
hold the same weights, like data-parallel ones); the root holds embeddings, final norm and
head, or under pipeline parallelism each stage module is a root. Routed experts under expert
parallelism are their own unit over the expert-data-parallel mesh (edp × cp: the replicas of
one expert shard), or left out of FSDP when there are no replicas: each expert shard then
has a single owner. Tensor-parallel
DTensors compose with the dp mesh into 2-D parameters, as torchtitan does.

Only adapters have gradients, so the reduce-scatters carry LoRA gradients alone; the
all-gathers carry the base (and adapter) shards, once in forward and once in backward. The
loss is normalised by the global token count, so reductions sum (divide factor 1). Every
collective FSDP issues goes through `TrafficCounter`, so the bytes are measured, not derived.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from ..models.moe import GroupedExperts
from ..models.transformer import DecoderLayer


@dataclass
class TrafficCounter:
    """Bytes this rank put into FSDP's collectives (inputs) and got out (outputs)."""

    all_gather_out: int = 0
    reduce_scatter_in: int = 0
    calls: dict[str, int] = field(default_factory=lambda: {"all_gather": 0, "reduce_scatter": 0})

    def reset(self) -> None:
        self.all_gather_out = self.reduce_scatter_in = 0
        self.calls = {"all_gather": 0, "reduce_scatter": 0}


class _CountingAllGather(DefaultAllGather):
    def __init__(self, counter: TrafficCounter):
        super().__init__()
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.counter.all_gather_out += output_tensor.numel() * output_tensor.element_size()
        self.counter.calls["all_gather"] += 1
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountingReduceScatter(DefaultReduceScatter):
    def __init__(self, counter: TrafficCounter):
        super().__init__()
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.counter.reduce_scatter_in += input_tensor.numel() * input_tensor.element_size()
        self.counter.calls["reduce_scatter"] += 1
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _shard(module: nn.Module, mesh, counter: TrafficCounter, policy: MixedPrecisionPolicy, ignored=None) -> None:
    fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    module.set_gradient_divide_factor(1.0)  # losses are already normalised over the whole batch
    module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
    module.set_custom_all_gather(_CountingAllGather(counter))
    module.set_custom_reduce_scatter(_CountingReduceScatter(counter))


def apply_fsdp(
    model: nn.Module,
    meshes,
    param_dtype: torch.dtype | None = None,
    roots: list[nn.Module] | None = None,
    keep: set[nn.Parameter] = frozenset(),
) -> TrafficCounter | None:
    """Shard `model` over dp × cp (experts over edp × cp); None when that is 1 rank (nothing to
    shard over). `roots`: the modules that are called (pipeline stages), each one unit with what
    the layers leave; default the model.
    `keep`: parameters FSDP leaves whole and alone (a service's adapter slots, swapped per call)."""
    dims = meshes.dims
    if dims.dp * dims.cp == 1:
        return None
    counter = TrafficCounter()
    # adapters and gradients stay fp32; the frozen base may be gathered in bf16 (GPU)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    dp_mesh = meshes.mesh("dp_cp")
    ignored = set(keep)  # and expert shards with a single owner (ep > 1, edp × cp = 1)
    for layer in [m for m in model.model.layers if isinstance(m, DecoderLayer)]:  # a pipeline stage's own layers
        for experts in [m for m in layer.modules() if isinstance(m, GroupedExperts)]:
            if dims.ep > 1 and dims.edp * dims.cp > 1:
                _shard(experts, meshes.mesh("edp_cp"), counter, policy, ignored)
            elif dims.ep > 1:
                ignored |= set(experts.parameters())
        _shard(layer, dp_mesh, counter, policy, ignored)
    for root in [model] if roots is None else roots:
        _shard(root, dp_mesh, counter, policy, ignored)
    if roots is None:  # the trainer computes logprobs from `hidden_states` + the head: FSDP must gather there too
        register_fsdp_forward_method(model, "hidden_states")
    return counter
