"""All-or-nothing folder writes: checkpoints and adapters are never seen half-written."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_folder(dest: Path) -> tuple[Path, Callable[[], None]]:
    """A temporary sibling folder and a `commit()` that fsyncs it and renames it over `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))

    def commit() -> None:
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.rename(dest, old)
        os.rename(tmp, dest)
        dirfd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
        if old is not None:
            shutil.rmtree(old)

    return tmp, commit
