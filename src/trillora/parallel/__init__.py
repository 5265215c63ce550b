"""The hybrid parallel engine: data, tensor and expert parallelism on torch.distributed."""

from .data_parallel import GradientSync
from .dims import Meshes, ParallelDims, ParallelError, build_meshes
from .expert_parallel import ExpertParallel, apply_expert_parallel
from .parallelize import Parallelized, parallelize
from .tensor_parallel import LoraColwiseParallel, LoraRowwiseParallel, apply_tensor_parallel, tp_plan

__all__ = [
    "ExpertParallel",
    "GradientSync",
    "LoraColwiseParallel",
    "LoraRowwiseParallel",
    "Meshes",
    "ParallelDims",
    "ParallelError",
    "Parallelized",
    "apply_expert_parallel",
    "apply_tensor_parallel",
    "build_meshes",
    "parallelize",
    "tp_plan",
]
