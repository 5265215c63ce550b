"""Running generated code for a reward: `python -I -S` in a jail of its own, with no network, no
view of the host, no privileges, and limits on CPU time, memory, output, processes and wall clock.

The model's program is untrusted, and the trainer often runs as root. `launcher.py` (a separate,
single-threaded launcher; no `preexec_fn` runs in this possibly threaded process) puts it in new
mount, PID, network, IPC and UTS namespaces (and a user namespace when not root):
- no network: its namespace has only a loopback that is down, so every connect fails;
- its own filesystem: read-only /usr and Python (installed packages masked), a fresh /proc of its
  own PID namespace, /dev with null/zero/random, a small /tmp and /box (its folder, where it
  runs); nothing of the host (home, project, other processes) is reachable;
- an unprivileged uid with no capabilities and `no_new_privs`, so it cannot `setns` back into the
  host's namespaces, mount, or gain root through a setuid file;
- a session keyring of its own (the host's keys stay out of reach) and a seccomp filter that
  refuses keyrings, new namespaces, mounts, ptrace, io_uring, bpf and kernel modules outright;
- memory bounded for the whole jail: a memory and a pids cgroup of its own where one can be made
  (as root), else processes × address space kept within `memory_bytes`;
- `RLIMIT_CPU` (SIGXCPU), `RLIMIT_AS` (MemoryError), `RLIMIT_FSIZE` (output capped at
  `output_bytes`: stdout and stderr are files, not pipes), `RLIMIT_NPROC` (no fork bomb),
  `RLIMIT_NOFILE`, no core files;
- the wall clock is kept by the jail's PID 1, whose exit takes every process of the namespace with
  it (a `setsid()` grandchild too); the launcher is killed if this process stops waiting for any
  reason (a reward time limit firing in `wait` included), and the jail dies with it.
If the kernel refuses the namespaces the sandbox raises `SandboxUnavailable` rather than run code
unconfined.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import TrilloraError

LAUNCHER = Path(__file__).with_name("launcher.py")


class SandboxUnavailable(TrilloraError, RuntimeError):
    """This machine cannot build the jail for a child process."""


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 2
    memory_bytes: int = 512 * 2**20
    wall_seconds: float = 5.0
    output_bytes: int = 64 * 2**10
    processes: int = 16  # the program's own processes and threads
    folder_bytes: int = 16 * 2**20  # /box and /tmp, each


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


def _remove_folder(folder: str) -> None:
    for _ in range(50):
        try:
            os.rmdir(folder)
            return
        except FileNotFoundError:
            return
        except OSError:  # its last processes are still being reaped
            time.sleep(0.02)


def _read_bounded(path: Path, cut: int, tail: bool) -> str:
    """At most `cut` bytes of an output file (its start, or its end), whatever size it claims: the
    program cannot write past `RLIMIT_FSIZE`, but a file's size is not all it could forge."""
    with open(path, "rb") as f:
        if tail:
            f.seek(max(0, os.fstat(f.fileno()).st_size - cut))
        return f.read(cut).decode(errors="replace")


def python_install() -> tuple[str, list[str], list[str]]:
    """The base interpreter (not a virtual environment's), the folders it needs and the folders of
    installed packages the program must not see."""
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    prefix = os.path.realpath(sys.base_prefix)
    dirs = [prefix] + [d for d in [os.path.dirname(python)] if not d.startswith(prefix + "/")]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    masked = {
        sysconfig.get_path("purelib", vars={"base": prefix}),
        sysconfig.get_path("platlib", vars={"platbase": prefix}),
        "/usr/lib/python3/dist-packages",
        f"/usr/local/lib/{version}/dist-packages",
        f"/usr/local/lib/{version}/site-packages",
    }
    return python, dirs, sorted(os.path.realpath(m) for m in masked)


def jail_spec(code: str, root: Path, limits: Limits, python: str, dirs: list[str], masked: list[str]) -> dict:
    """What `launcher.py` reads: the program, the empty folder its root is built in, the interpreter
    and the limits."""
    seccomp = importlib.util.find_spec("pyseccomp")
    code_file = root.parent / "main.py"  # a file, not an argument: argv is capped (128 KiB) and seen in /proc
    code_file.write_bytes(code.encode("utf-8", "surrogatepass"))  # a lone surrogate: Python refuses the file
    return {
        "root": str(root),
        "code_file": str(code_file),
        "python": python,
        "python_dirs": dirs,
        "masked": masked,
        "seccomp_module": seccomp.origin if seccomp is not None else "",
        **asdict(limits),
    }


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> Result:
    """Run `code` as a Python program in the sandbox and return what it printed."""
    with tempfile.TemporaryDirectory(prefix="trillora-sandbox-") as folder:
        root = Path(folder)
        (root / "root").mkdir()
        (root / "stdin").write_text(stdin)
        spec = jail_spec(code, root / "root", limits, *python_install())
        read_end, write_end = os.pipe()
        spec["report_fd"] = write_end
        with os.fdopen(read_end, "rb") as report:
            try:
                with (
                    open(root / "stdin", "rb") as i,
                    open(root / "stdout", "wb") as o,
                    open(root / "stderr", "wb") as e,
                ):
                    proc = subprocess.Popen(
                        [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(spec)],
                        cwd=folder,
                        stdin=i,
                        stdout=o,
                        stderr=e,
                        env={"PATH": "/usr/bin:/bin"},
                        pass_fds=(write_end,),
                        start_new_session=True,
                    )
            finally:
                os.close(write_end)
            stuck = False
            try:
                proc.wait(timeout=limits.wall_seconds + 30)  # the jail keeps the wall clock; this is a backstop
            except subprocess.TimeoutExpired:
                stuck = True
            finally:  # also when a reward time limit interrupts the wait: the jail never outlives this call
                if proc.returncode is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                reports = [json.loads(line) for line in report.read().decode().splitlines() if line.strip()]
                for folder in (f for r in reports for f in r.get("cgroups", [])):  # the launcher's, if it was killed:
                    _remove_folder(folder)  # removed once the jail's last process is gone
        out = _read_bounded(root / "stdout", limits.output_bytes, tail=False)
        err = _read_bounded(root / "stderr", limits.output_bytes, tail=True)
    if stuck:
        return Result(returncode=-signal.SIGKILL, stdout=out, stderr=err, timed_out=True)
    errors = [r["error"] for r in reports if "error" in r]
    reports = [r for r in reports if "status" in r]
    if errors or not reports:
        why = errors[0] if errors else f"the launcher ended with {proc.returncode} and no report: {err[-500:]}"
        raise SandboxUnavailable(
            f"cannot run the code sandbox: {why}; it needs mount, PID and network namespaces "
            f"(root, or unprivileged user namespaces enabled in the kernel)"
        )
    status = reports[-1]["status"]
    code_ = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return Result(returncode=code_, stdout=out, stderr=err, timed_out=reports[-1]["timed_out"])
