"""Where a benchmark ran: ratios move with the CPU, its threads and the library versions, so every
results file that states one records them."""

from __future__ import annotations

import datetime
import os
import platform
import time
from pathlib import Path

import torch


def machine(*libraries) -> dict:
    """The CPU model, cores, torch's threads, each library's version (by module name), Python, the date
    and the load average when this is called (at the end of the run)."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        **{lib.__name__: lib.__version__ for lib in libraries},
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "load_at_end": load,
    }


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(repeats: int, device, dtype) -> float:
    """FLOP/s of the best of `3 × repeats` square matmuls (2048 on CPU, 8192 on GPU): the ceiling that
    MFU and a step's model FLOP/s are measured against."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats * 3):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)
