"""Running generated code for a reward: a separate Python process with no network, limited CPU
time, memory, output and wall-clock time, in an empty temporary folder.

The model's program is untrusted; what keeps it in:
- a new network namespace (`unshare(CLONE_NEWNET)`, with a user namespace when not root): no
  interface but a loopback that is down, so every connect fails; if the kernel refuses both
  the sandbox refuses to run (`SandboxUnavailable`) rather than run code with network access;
- `RLIMIT_CPU` (a busy loop gets SIGXCPU), `RLIMIT_AS` (a memory bomb gets MemoryError),
  `RLIMIT_FSIZE` (no large files), `RLIMIT_CORE` 0;
- a wall-clock timeout that kills the whole process group (a program sleeping or blocked);
- `python -I -S`: isolated mode, no site-packages, an environment of PATH only; stdout and stderr
  go to files capped at `output_bytes` by `RLIMIT_FSIZE`.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from ..errors import TrilloraError

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


class SandboxUnavailable(TrilloraError, RuntimeError):
    """This machine cannot isolate the network for a child process."""


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 2
    memory_bytes: int = 512 * 2**20
    wall_seconds: float = 5.0
    output_bytes: int = 64 * 2**10


@dataclass(frozen=True)
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def signal_name(self) -> str | None:
        """The signal that ended the program (SIGXCPU for its CPU limit, SIGKILL for the wall clock)."""
        if self.returncode is not None and self.returncode < 0:
            return signal.Signals(-self.returncode).name
        return "SIGKILL" if self.timed_out else None


def _unshare_network() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(network namespace) failed: {os.strerror(err)}")


def _limit(limits: Limits):
    def child() -> None:  # runs in the child between fork and exec
        os.setsid()
        _unshare_network()
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return child


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> Result:
    """Run `code` as a Python program in the sandbox and return what it printed."""
    with tempfile.TemporaryDirectory(prefix="trillora-sandbox-") as folder:
        root = Path(folder)
        (root / "main.py").write_text(code)
        (root / "stdin").write_text(stdin)
        # output goes to files, not pipes: RLIMIT_FSIZE then bounds it (a program printing forever
        # gets SIGXFSZ instead of filling this process's memory)
        with open(root / "stdin", "rb") as i, open(root / "stdout", "wb") as o, open(root / "stderr", "wb") as e:
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-S", "main.py"], cwd=folder, stdin=i, stdout=o,
                                        stderr=e, env={"PATH": "/usr/bin:/bin"}, preexec_fn=_limit(limits))
            except subprocess.SubprocessError as err:  # the child could not set its limits up
                raise SandboxUnavailable(f"cannot start the code sandbox: {err}; it needs a network namespace "
                                         f"(root, or unprivileged user namespaces enabled in the kernel)") from None
            try:
                proc.wait(timeout=limits.wall_seconds)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
        cut = limits.output_bytes
        out = (root / "stdout").read_bytes()[:cut].decode(errors="replace")
        err = (root / "stderr").read_bytes()[-cut:].decode(errors="replace")
    return Result(returncode=proc.returncode, stdout=out, stderr=err, timed_out=timed_out)
