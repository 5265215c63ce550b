"""The code sandbox attacked as root (which CI is): each escape that worked against a sandbox that
only unshared the network (shown by a control where it is cheap to show) fails in the jail.
Programs print what they managed; the host checks what they left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import trillora
from trillora.sandbox.jail import LAUNCHER, Limits, jail_spec, run_python
from trillora.tasks.guard import RewardTimeout, time_limit

FAST = Limits(cpu_seconds=2, wall_seconds=5.0)
SETNS = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
pids = [p for p in os.listdir('/proc') if p.isdigit()]
print('pids', len(pids))
for pid in pids + [str(os.getppid())]:
    try:
        fd = os.open(f'/proc/{pid}/ns/net', os.O_RDONLY)
    except OSError as e:
        print('open', pid, e); continue
    if libc.setns(fd, 0x40000000) != 0:
        print('setns', pid, os.strerror(ctypes.get_errno())); continue
    try:
        socket.create_connection(('127.0.0.1', PORT), timeout=2); print('connected'); break
    except OSError as e:
        print('connect', pid, e)
"""

PID1 = """
import os
print('cmdline', open('/proc/1/cmdline', 'rb').read().strip(b'\\0'))
for name in ('environ', 'maps', 'exe', 'cwd', 'root'):
    try:
        os.readlink(f'/proc/1/{name}') if name in ('exe', 'cwd', 'root') else open(f'/proc/1/{name}', 'rb').read()
        print(name, 'read')
    except OSError:
        print(name, 'refused')
"""


def _alive(marker: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                pids.append(int(p.name))
        except OSError:
            pass
    return pids


def _escaper(marker: str, then: str) -> str:
    """A program whose grandchild leaves the process group (setsid) and sleeps under `marker`."""
    return f"""
import os, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print('grandchild running', flush=True)
        os.write(w, b'x')
        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', '{marker}'])
    os._exit(0)
os.read(r, 1)
time.sleep(0.3)
{then}
"""


@pytest.fixture
def server():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


def test_setns_into_the_host_network_fails(server):
    code = SETNS.replace("PORT", str(server))
    control = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert "connected" in control.stdout  # a network namespace alone, as root: setns back out and connect
    r = run_python(code, limits=FAST)
    assert "connected" not in r.stdout, r.stdout
    assert r.stdout.startswith("pids ") and int(r.stdout.split()[1]) <= 2  # its own PID namespace: init and itself
    assert "Operation not permitted" in r.stdout


def test_host_files_are_out_of_sight(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the key")
    secret.chmod(0o644)
    targets = [str(secret), trillora.__file__, "/etc/passwd", "/root", str(Path(sys.executable).parent)]
    code = f"""
import os
for t in {targets!r}:
    try:
        print('read', t, open(t).read()[:20] if os.path.isfile(t) else os.listdir(t)[:3])
    except OSError as e:
        print('refused', t, type(e).__name__)
print('root', sorted(os.listdir('/')))
"""
    r = run_python(code, limits=FAST)
    assert r.ok, r.stderr
    seen = {
        line.split()[1]: line.split()[0] for line in r.stdout.splitlines() if line.split()[0] in ("read", "refused")
    }
    assert [seen[t] for t in targets] == ["refused", "refused", "refused", "read", "refused"], r.stdout
    assert "the key" not in r.stdout  # /root, when listed, holds only the Python install's path
    top = r.stdout.split("root ", 1)[1]
    assert "'box'" in top and not any(f"'{d}'" in top for d in ("home", "etc", "work", "mnt", "var"))


def test_the_jails_pid_1_shows_nothing_of_the_host():
    """PID 1 of the jail is the launcher's fork: its command line held the spec (the host's Python,
    launcher and temp-folder paths, the masked folders). Blanked, and its other files refused."""
    out = run_python(PID1, limits=FAST)
    assert out.returncode == 0, out.stderr
    assert "cmdline b''" in out.stdout, out.stdout
    assert [line.split()[1] for line in out.stdout.splitlines()[1:]] == ["refused"] * 5, out.stdout


def test_writes_stay_in_the_jail(tmp_path):
    tmp_path.chmod(0o777)
    outside = [
        str(tmp_path / "escaped"),
        "/usr/escaped",
        os.path.join(sys.base_prefix, "escaped"),
        "/escaped",
        "/proc/sys/kernel/hostname",
    ]
    code = f"""
for t in {outside!r} + ['/box/ok', '/tmp/ok']:
    try:
        open(t, 'w').write('x'); print('wrote', t)
    except OSError as e:
        print('refused', t, type(e).__name__)
"""
    hostname = Path("/proc/sys/kernel/hostname").read_text()
    r = run_python(code, limits=FAST)
    assert "wrote /box/ok" in r.stdout and "wrote /tmp/ok" in r.stdout
    assert r.stdout.count("wrote") == 2, r.stdout
    assert not any(Path(t).exists() for t in outside[:4])
    assert Path("/proc/sys/kernel/hostname").read_text() == hostname


def test_a_fork_bomb_hits_the_process_limit():
    code = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30); os._exit(0)
        n += 1
except OSError as e:
    print('forked', n, type(e).__name__)
"""
    r = run_python(code, limits=Limits(cpu_seconds=2, wall_seconds=10.0, processes=8))
    assert r.ok, r.stderr
    forked, kind = r.stdout.split()[1:]
    assert 1 <= int(forked) < 8 and kind == "BlockingIOError"


def test_no_privilege_comes_back():
    code = """
import os
status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
print('uid', os.getuid(), os.geteuid(), 'caps', status['CapEff'], status['CapBnd'], 'nnp', status['NoNewPrivs'])
attempts = (lambda: os.setuid(0), lambda: os.chroot('/tmp'),
            lambda: os.mknod('/tmp/sda', 0o60600, os.makedev(8, 0)))
for attempt in attempts:
    try:
        attempt(); print('allowed')
    except OSError as e:
        print('refused', type(e).__name__)
"""
    r = run_python(code, limits=FAST)
    assert r.ok, r.stderr
    words = r.stdout.split()
    assert words[1] != "0" and words[2] != "0"
    assert words[4] == words[5] == "0000000000000000" and words[7] == "1"
    assert "allowed" not in r.stdout and r.stdout.count("refused PermissionError") == 3


@pytest.mark.parametrize("then, wall", [("", 5.0), ("time.sleep(60)", 1.0)])
def test_descendants_die_with_the_program(then, wall):
    marker = f"trillora-escape-{uuid.uuid4().hex}"
    r = run_python(_escaper(marker, then), limits=Limits(cpu_seconds=2, wall_seconds=wall))
    assert "grandchild running" in r.stdout
    assert r.timed_out == bool(then)
    assert _alive(marker) == []  # gone when run_python returns, though it had left the process group


def test_the_escape_works_without_the_jail():
    marker = f"trillora-escape-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _escaper(marker, "")], stdout=subprocess.PIPE, start_new_session=True
    )
    proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    time.sleep(0.2)
    survivors = _alive(marker)
    for pid in survivors:
        os.kill(pid, 9)
    assert survivors  # killing the process group is not enough: what the jail's PID namespace adds


def test_a_reward_time_limit_during_the_wait_kills_the_jail():
    marker = f"trillora-escape-{uuid.uuid4().hex}"
    with pytest.raises(RewardTimeout), time_limit(1.5):
        run_python(_escaper(marker, "time.sleep(60)"), limits=Limits(cpu_seconds=2, wall_seconds=60.0))
    assert _alive(marker) == []


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
    reason="needs root (to become another user), setpriv and a system python3",
)
def test_the_jail_as_a_normal_user(tmp_path, server):
    """The same jail started by an unprivileged user: user namespaces instead of root."""
    folder = Path(tempfile.mkdtemp(prefix="trillora-sandbox-user-"))
    try:
        folder.chmod(0o755)
        shutil.copy(LAUNCHER, folder / "launcher.py")
        shutil.copy(jail_spec("", folder, FAST, "", [], [])["seccomp_module"], folder / "pyseccomp.py")
        (folder / "root").mkdir()
        os.chown(folder / "root", 65534, 65534)
        secret = tmp_path / "secret.txt"
        secret.write_text("the key")
        secret.chmod(0o644)
        code = (
            SETNS.replace("PORT", str(server))
            + PID1
            + f"""
print('uid', os.getuid())
try:
    print('read', open({str(secret)!r}).read())
except OSError as e:
    print('refused', type(e).__name__)
"""
        )
        python = os.path.realpath("/usr/bin/python3")
        spec = jail_spec(code, folder / "root", FAST, python, ["/usr"], ["/usr/lib/python3/dist-packages"])
        spec["seccomp_module"] = str(folder / "pyseccomp.py")
        read_end, write_end = os.pipe()
        spec["report_fd"] = write_end
        out = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                python,
                "-I",
                "-S",
                str(folder / "launcher.py"),
                json.dumps(spec),
            ],
            capture_output=True,
            text=True,
            pass_fds=(write_end,),
            timeout=60,
        )
        os.close(write_end)
        with os.fdopen(read_end) as f:
            reports = [json.loads(line) for line in f.read().splitlines()]
        refused = [r["error"] for r in reports if "error" in r and "user" in r["error"]]
        if refused:
            pytest.skip(f"unprivileged user namespaces refused here: {refused[0]}")
        assert reports and "status" in reports[-1], (reports, out.stderr)
        assert "connected" not in out.stdout and "uid 65534" in out.stdout and "refused FileNotFoundError" in out.stdout
        assert int(out.stdout.split()[1]) <= 2
        # the same uid as PID 1 here (its user namespace's root): still nothing of the host
        assert "cmdline b''" in out.stdout and "read\n" not in out.stdout and out.stdout.count(" refused\n") == 5
    finally:
        shutil.rmtree(folder, ignore_errors=True)


KEYRING = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
print('session', libc.syscall(NR, 0, -3, 0), errno.errorcode.get(ctypes.get_errno()))  # KEYCTL_GET_KEYRING_ID, @s
found = libc.syscall(NR, 10, -3, b"user", b"trillora-test", 0)  # KEYCTL_SEARCH in @s
print('search', found, errno.errorcode.get(ctypes.get_errno()))
buf = ctypes.create_string_buffer(64)
# KEYCTL_READ, by id
print('read', libc.syscall(NR, 11, KEY, buf, 64), errno.errorcode.get(ctypes.get_errno()), buf.value)
print('proc', 'trillora-test' in open('/proc/keys').read())
"""


def test_the_host_keyring_is_out_of_reach():
    """A parent that holds a session keyring with a secret (systemd, PAM, ssh, `keyctl session`): the
    jail neither finds nor reads it. This test process joins a new session keyring and puts the
    secret there first."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    nr = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
    if nr is None or libc.syscall(nr, 1, None) < 0:  # KEYCTL_JOIN_SESSION_KEYRING: a keyring for this test
        pytest.skip("no kernel keyrings here")
    key = libc.syscall(
        248 if nr == 250 else 217, b"user", b"trillora-test", b"HOST-SECRET-1234", 16, -3
    )  # add_key to @s
    assert key > 0, os.strerror(ctypes.get_errno())
    buf = ctypes.create_string_buffer(64)
    assert libc.syscall(nr, 11, key, buf, 64) == 16 and buf.value == b"HOST-SECRET-1234"  # the host reads it
    r = run_python(KEYRING.replace("KEY", str(key)), limits=FAST)
    assert r.ok, r.stderr
    assert "HOST-SECRET" not in r.stdout and "proc False" in r.stdout, r.stdout
    assert r.stdout.count("EPERM") == 3, r.stdout  # the filter refuses every keyctl


ESCAPES = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def tried(name, ret):
    print(name, 'allowed' if ret >= 0 else errno.errorcode.get(ctypes.get_errno()))
tried('unshare-user', libc.unshare(0x10000000))
tried('unshare-mount', libc.unshare(0x00020000))
tried('mount-tmpfs', libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=1g"))
params = ctypes.create_string_buffer(120)
tried('io_uring_setup', libc.syscall({"x86_64": 425, "aarch64": 425}[os.uname().machine], 4, params))
tried('ptrace', libc.ptrace(16, os.getppid(), 0, 0))  # PTRACE_ATTACH
pid = os.fork()  # plain processes still work
if pid == 0:
    os._exit(7)
print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
import threading
t = threading.Thread(target=lambda: None); t.start(); t.join(); print('thread ok')
"""


def test_namespaces_mounts_io_uring_and_ptrace_are_refused():
    """A nested user namespace let a program mount a tmpfs of any size past /tmp's bound; io_uring
    bypasses the file-size checks of write(). The filter refuses them, fork and threads still work."""
    r = run_python(ESCAPES, limits=FAST)
    assert r.ok, r.stderr
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert got == {
        "unshare-user": "EPERM",
        "unshare-mount": "EPERM",
        "mount-tmpfs": "EPERM",
        "io_uring_setup": "EPERM",
        "ptrace": "EPERM",
        "fork": "7",
        "thread": "ok",
    }, got


MEMORY = """
import os, time
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray(300 << 20)  # zero-filled: every page touched
            time.sleep(1.0)
            os._exit(0)
        except MemoryError:
            os._exit(3)
    kids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids]
print('held', sum(c == 0 for c in codes), codes)
"""


def test_memory_is_bounded_per_jail_not_per_process():
    """Three children of 300 MiB each under a 512 MiB jail: at most one holds its block (before,
    RLIMIT_AS alone let each process have the whole budget)."""
    r = run_python(MEMORY, limits=Limits(cpu_seconds=5, wall_seconds=20.0, memory_bytes=512 << 20))
    assert r.ok, (r.stdout, r.stderr)
    assert int(r.stdout.split()[1]) <= 1, r.stdout
