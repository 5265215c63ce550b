"""The machines the cost model (`plan.cost`) prices layouts on: memory, bandwidth and peak
compute per GPU, nominal figures from the vendors' sheets (and this 2-core CPU box, measured)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    """Nominal figures per GPU. Bandwidths are what one GPU can move per direction in GB/s."""

    name: str
    gpus_per_node: int
    memory_gib: float
    intra_node_gbps: float
    inter_node_gbps: float
    peak_tflops: float  # dense bf16 (fp32 for "cpu")
    mfu: float = 0.4  # the fraction of peak a training step reaches
    act_bytes: int = 2  # bf16 activations (fp32 on CPU)
    reserve: float = 0.1  # memory kept free for the allocator, CUDA context, fragmentation


CLUSTERS = {
    "h800": Cluster("h800", 8, 80, 200, 50, 989),  # NVLink 400 GB/s bidirectional; 8 × 400 Gb/s IB per node
    "h100": Cluster("h100", 8, 80, 450, 50, 989),
    "h200": Cluster("h200", 8, 141, 450, 50, 989),
    "a100": Cluster("a100", 8, 80, 300, 25, 312),
    "cpu": Cluster("cpu", 2, 24, 5, 1, 0.16, mfu=0.5, act_bytes=4, reserve=0.2),  # this 2-core machine, fp32
}


__all__ = ["CLUSTERS", "Cluster"]
