"""The memory probe that benchmarks and the planner's checks rely on."""

from __future__ import annotations

import torch


def test_memory_probe_measures_what_backward_keeps():
    """A hand-countable graph: y = relu(x @ w) saves x (w excluded) and y's relu output; the peak
    holds x@w and its relu at once (2 × 4 MiB) plus the gradient buffers of backward."""
    from trillora.parallel.memory_probe import MemoryProbe

    w = torch.randn(1024, 1024, requires_grad=True)
    x = torch.randn(1024, 1024)
    with MemoryProbe() as probe:
        probe.exclude([w])
        y = (x @ w).relu()  # saves x (for w's grad) and the relu result: 2 × 4 MiB
        y.sum().backward()
    mib = 2**20
    assert probe.report.saved_bytes == 8 * mib
    assert 8 * mib <= probe.report.peak_bytes <= 20 * mib
