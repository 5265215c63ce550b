"""All-or-nothing writes: a folder (checkpoint, adapter, model) or a small file is either the old
one or the new one, never half of either, whatever moment the process dies at.

Every writer in trillora goes through here: files go into a staging folder beside the
destination, are fsynced, and the folder is renamed over the destination (the old one moved
aside first and removed after); the parent folder is fsynced so the rename itself survives a
power cut.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import TrilloraError


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') bytes to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFolder:
    """`with AtomicFolder(dest) as tmp:` write into `tmp`; it replaces `dest` when the block ends
    normally and is removed when it raises. (Or `folder.path` ... `folder.commit()` by hand.)

    `staging` names the staging folder instead of a random one: several processes (the ranks of
    one job) can then write into the same folder before one of them commits it, and a run that
    finds it after a crash knows it is half-written."""

    def __init__(self, dest: str | Path, staging: str | Path | None = None):
        self.dest = Path(dest)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        if staging is None:
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.dest.name}.tmp-", dir=self.dest.parent))
        else:
            self.path = Path(staging)
            self.path.mkdir(parents=True, exist_ok=True)
        self.synced: set[Path] = set()

    def commit(self) -> Path:
        for f in sorted(self.path.rglob("*")):
            if f.is_file() and f not in self.synced:  # `synced`: flushed by their writers
                fsync_path(f)
        for d in [*sorted((p for p in self.path.rglob("*") if p.is_dir()), reverse=True), self.path]:
            fsync_path(d)
        old = None
        if self.dest.exists():
            old = self.dest.with_name(f".{self.dest.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(self.dest, old)
        os.rename(self.path, self.dest)
        fsync_path(self.dest.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.dest

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, kind, value, tb) -> None:
        """Commit when the body finished; otherwise nothing of it is left behind."""
        if kind is None:
            self.commit()
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace a small file in one step (temp file, fsync, rename, fsync of the folder)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


class FolderInUse(TrilloraError, RuntimeError):
    """Another process writes this folder (a run folder, a state folder)."""


class FolderLock:
    """`with FolderLock(folder):` one writer at a time. An exclusive `flock` on `folder/.lock`, which
    holds the writer's pid; the kernel frees it whenever the process ends, `kill -9` included, so a
    crashed run never leaves a stale lock behind. A second writer is refused with the holder's pid
    and command line instead of interleaving its rows and checkpoints with the first's."""

    def __init__(self, folder: str | Path, what: str = "run folder", hint: str = ""):
        self.folder, self.what, self.hint = Path(folder), what, hint
        self.fd: int | None = None

    def __enter__(self) -> FolderLock:
        import fcntl

        self.created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise FolderInUse(
                f"{self.folder}: this {self.what} is in use by process {holder or '?'}{_command_of(holder)}; "
                f"wait for it to end or stop it{self.hint}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        if self.created and [p.name for p in self.folder.iterdir()] == [".lock"]:  # a start that wrote nothing
            (self.folder / ".lock").unlink()
            self.folder.rmdir()
        os.close(self.fd)  # closing the last descriptor releases the lock
        self.fd = None


def _command_of(pid: str) -> str:
    try:
        argv = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
    except (ValueError, OSError):
        return ""
    return f" ({' '.join(a.decode(errors='replace') for a in argv if a)[:200]})"
