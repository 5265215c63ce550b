"""Measured memory of a forward + backward on any device, CPU included.

CPU tensors have no allocator statistics like `torch.cuda.max_memory_allocated`, so this
reads the profiler's allocation events (every allocation and free that torch makes, with
its size) in time order and takes the running peak above the level where the probe began.
It also counts the tensors autograd saves for backward (the activations), once per storage.
Both are measured, not derived; the cost model in `trillora.plan.cost` is checked against them
(that is why this lives beside it: tests and benchmarks use it, the trainer does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from ..models import layers


@dataclass
class MemoryReport:
    peak_bytes: int = 0
    """Highest total of live torch allocations made inside the probe, above its start."""
    saved_bytes: int = 0
    """Bytes of distinct storages autograd saved for backward (activations; weights excluded when
    they are leaves that existed before the probe)."""


class MemoryProbe:
    """`with MemoryProbe() as probe: loss = f(); loss.backward()` then `probe.report`.

    On CUDA the allocator's own peak is used; on CPU the profiler's allocation events."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.report = MemoryReport()
        self._storages: dict[int, int] = {}
        self._excluded: set[int] = set()

    def exclude(self, tensors) -> None:
        """Storages not to count as saved activations (the model's weights)."""
        self._excluded |= {t.untyped_storage().data_ptr() for t in tensors}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = layers.local(t)  # a DTensor's shard is what this rank holds
        try:
            s = local.untyped_storage()
            key, size = s.data_ptr(), s.nbytes()
        except RuntimeError:  # wrapper tensors without a storage of their own
            key, size = id(local), local.numel() * local.element_size()
        if key not in self._excluded:
            self._storages[key] = size
        return t

    def __enter__(self) -> MemoryProbe:
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._profile.__exit__(*exc)
            events = [e for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"]
            live = peak = 0
            for e in sorted(events, key=lambda e: e.start_ns()):
                live += e.nbytes()
                peak = max(peak, live)
        self.report = MemoryReport(peak_bytes=peak, saved_bytes=sum(self._storages.values()))
