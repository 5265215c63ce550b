"""Where a benchmark ran: ratios move with the CPU, its threads and the library versions, so every
results file that states one records them."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path


def machine(torch, *libraries) -> dict:
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
        "torch": torch.__version__,
        **{lib.__name__: lib.__version__ for lib in libraries},
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "load_at_end": load,
    }
