"""The code sandbox's launcher: a fresh, single-threaded process that builds the jail and runs the
program in it. Standard library only, run as `python -I -S sandbox_init.py SPEC` (never imported),
so nothing of the trainer (threads, locks, CUDA) is alive between fork and the system calls.

    launcher (host PID namespace) ── unshare: mount, PID, network, IPC, UTS (+ user when not root)
      └─ init: PID 1 of the new namespace. Builds a new root on a tmpfs: read-only /usr and the
         │ Python install (site-packages masked), a fresh /proc, /dev with null/zero/random only,
         │ small tmpfs /tmp and /box (the program's folder); pivot_root; the host tree detached.
         └─ program: drops to an unprivileged uid (root: setresuid to a uid no account uses; not
            root: a nested user namespace where it is not root), no_new_privs, rlimits (CPU,
            memory, file size, processes, open files), then execs `python -I -S main.py` in /box.

The init waits for the program, enforcing the wall clock, and exits when the program does: the
kernel then kills everything left in the PID namespace (a `setsid()` grandchild included), and
the init itself dies with the launcher (`PR_SET_PDEATHSIG`). It reports one JSON line on the spec's `report_fd`:
{"status": wait status, "timed_out": bool} or {"error": why the jail could not be built}.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH, PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 2, 1, 24, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
UID_BASE = 2_000_000_000
DEVICES = ("null", "zero", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)
_REPORT = [-1]  # the report pipe's fd, from the spec


class JailError(Exception):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise JailError(f"{what}: {os.strerror(err)}")


def _mount(src, dst, fstype, flags, data=None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {src} on {dst}")


def _bind_read_only(src: str, dst: str) -> None:
    """Bind `src` at `dst`, read-only, no setuid, no devices. A remount in a user namespace must
    keep the flags the host mount has (they are locked), so those are read and kept."""
    _mount(src, dst, None, MS_BIND | MS_REC)
    st = os.statvfs(src)
    kept = {os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME,
            os.ST_RELATIME: MS_RELATIME}
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    for st_flag, ms_flag in kept.items():
        if st.f_flag & st_flag:
            flags |= ms_flag
    _mount(None, dst, None, flags)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _report(**fields) -> None:
    try:
        os.write(_REPORT[0], (json.dumps(fields) + "\n").encode())
    except OSError:
        pass


def build_root(spec: dict, as_root: bool) -> None:
    """The new root at spec["root"] (an empty host folder), entered with pivot_root."""
    new = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    visible = ["/usr"] + [p for p in spec["python_dirs"] if p != "/usr" and not p.startswith("/usr/")]
    for top in ("bin", "lib", "lib64", "sbin"):  # merged /usr: symlinks; otherwise read-only binds
        host = "/" + top
        if os.path.islink(host):
            os.symlink(os.readlink(host), new + host)
        elif os.path.isdir(host):
            visible.append(host)
    for path in visible:
        os.makedirs(new + path, mode=0o755, exist_ok=True)
        _bind_read_only(path, new + path)
    for path in spec["masked"]:  # installed packages (the project's among them) stay unseen
        if os.path.isdir(new + path):
            _mount("tmpfs", new + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    os.makedirs(new + "/dev", mode=0o755)
    _mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=4k,mode=0755")
    for name in DEVICES:
        open(new + "/dev/" + name, "w").close()
        _mount("/dev/" + name, new + "/dev/" + name, None, MS_BIND)
    os.makedirs(new + "/proc")
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace only
    os.makedirs(new + "/tmp")
    _mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['folder_bytes']},mode=1777")
    uid = spec["uid"] if as_root else 0  # the user namespace's root is the caller; its child maps it to uid
    os.makedirs(new + "/box")
    _mount("tmpfs", new + "/box", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['folder_bytes']},mode=0700,uid={uid},gid={uid}")
    _write(new + "/box/main.py", spec["code"])
    os.chown(new + "/box/main.py", uid, uid)
    os.makedirs(new + "/.old")
    arch = platform.machine()
    if arch not in SYS_PIVOT_ROOT:
        raise JailError(f"pivot_root: unknown system call number on {arch}")
    _check(libc.syscall(SYS_PIVOT_ROOT[arch], new.encode(), (new + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "detach the host tree")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges(spec: dict, as_root: bool) -> None:
    uid = spec["uid"]
    if as_root:
        for cap in range(64):  # and none to regain from the bounding set (last_cap < 64)
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # from root to a non-zero uid: every capability goes
    else:  # a nested user namespace in which the program is `uid`; exec as non-root clears its capabilities
        _check(libc.unshare(CLONE_NEWUSER), "unshare(user namespace)")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} 0 1")
        _write("/proc/self/gid_map", f"{uid} 0 1")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for limit, value in ((resource.RLIMIT_CPU, spec["cpu_seconds"]), (resource.RLIMIT_AS, spec["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, spec["output_bytes"]), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, spec["processes"]), (resource.RLIMIT_NOFILE, 64)):
        hard = value + 1 if limit == resource.RLIMIT_CPU else value  # soft CPU limit: SIGXCPU, not SIGKILL
        resource.setrlimit(limit, (value, hard))


def init(spec: dict, as_root: bool) -> None:
    """PID 1 of the jail: build it, run the program, wait (wall clock), report, exit."""
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
    try:
        build_root(spec, as_root)
    except (OSError, JailError) as e:
        _report(error=f"cannot build the jail: {e}")
        os._exit(125)
    program = os.fork()
    if program == 0:
        try:
            drop_privileges(spec, as_root)
            os.chdir("/box")
            os.execve(spec["python"], [spec["python"], "-I", "-S", "main.py"], {"PATH": "/usr/bin:/bin"})
        except (OSError, JailError) as e:
            _report(error=f"cannot start the program: {e}")
        os._exit(125)
    timed_out = []

    def on_wall_clock(signum, frame):
        timed_out.append(True)
        os.kill(program, signal.SIGKILL)

    signal.signal(signal.SIGALRM, on_wall_clock)
    signal.setitimer(signal.ITIMER_REAL, spec["wall_seconds"])
    while True:  # PID 1 reaps every orphan; only the program's end ends the jail
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            break
    signal.setitimer(signal.ITIMER_REAL, 0)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 125 and not timed_out):
        _report(status=status, timed_out=bool(timed_out))
    os._exit(0)  # the kernel kills what is left in the namespace


def main() -> None:
    spec = json.loads(sys.argv[1])
    _REPORT[0] = spec["report_fd"]
    os.set_inheritable(_REPORT[0], False)  # the program never holds the report pipe
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    as_root = os.geteuid() == 0
    # root: a uid no account uses, its own per launcher (RLIMIT_NPROC counts processes per uid);
    # otherwise the uid the program has inside its own user namespace
    spec["uid"] = UID_BASE + os.getpid() if as_root else 65534
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    try:
        if as_root:
            _check(libc.unshare(flags), "unshare(mount, PID, network namespaces)")
        else:
            uid, gid = os.geteuid(), os.getegid()
            _check(libc.unshare(flags | CLONE_NEWUSER), "unshare(user, mount, PID, network namespaces)")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
    except (OSError, JailError) as e:
        _report(error=str(e))
        sys.exit(125)
    child = os.fork()
    if child == 0:
        init(spec, as_root)
    _, status = os.waitpid(child, 0)
    sys.exit(0)


if __name__ == "__main__":
    main()
