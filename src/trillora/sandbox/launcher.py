"""The code sandbox's launcher: a fresh, single-threaded process that builds the jail and runs the
program in it. Standard library only, run as `python -I -S launcher.py SPEC` (never imported),
so nothing of the trainer (threads, locks, CUDA) is alive between fork and the system calls.

    launcher (host PID namespace) ── unshare: mount, PID, network, IPC, UTS (+ user when not root)
      └─ init: PID 1 of the new namespace (its command line blanked, not dumpable: nothing of the
         │ host shows in /proc/1). Builds a new root on a tmpfs: read-only /usr and the
         │ Python install (site-packages masked), a fresh /proc, /dev with null/zero/random only,
         │ small tmpfs /tmp and /box (the program's folder); pivot_root; the host tree detached.
         └─ program: drops to an unprivileged uid (root: setresuid to a uid no account uses; not
            root: a nested user namespace where it is not root), joins a new empty session
            keyring, no_new_privs, a seccomp filter (libseccomp through `pyseccomp`: no keyrings,
            namespaces, mounts, ptrace, io_uring, bpf, modules), rlimits (CPU, memory, file
            size, processes, open files), then execs `python -I -S main.py` in /box.

Memory is bounded per jail, not per process: as root the launcher puts itself (and so the whole
jail) in a memory and a pids cgroup of its own under its current ones (v1 or v2, where the kernel
lets it make one), removed when the jail ends. Where none can be made, the per-process limit is
cut so that processes × RLIMIT_AS stays within the budget.

The init waits for the program, enforcing the wall clock, and exits when the program does: the
kernel then kills everything left in the PID namespace (a `setsid()` grandchild included), and
the init itself dies with the launcher (`PR_SET_PDEATHSIG`). It reports one JSON line on the spec's `report_fd`:
{"status": wait status, "timed_out": bool} or {"error": why the jail could not be built}.
"""

import contextlib
import ctypes
import errno
import json
import os
import platform
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH, PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 2, 1, 4, 24, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
UID_BASE = 2_000_000_000
DEVICES = ("null", "zero", "random", "urandom")
KEYCTL_JOIN_SESSION_KEYRING = 1
DENIED = (
    "keyctl",
    "add_key",
    "request_key",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "fsopen",
    "fsmount",
    "move_mount",
    "open_tree",
    "unshare",
    "setns",
    "pivot_root",
    "chroot",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "open_by_handle_at",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "fallocate",  # KEEP_SIZE and INSERT_RANGE grow a file past RLIMIT_FSIZE (its stdout: the host's disk)
)
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6: the others (vsock, packet, netlink...) are refused
NAMESPACES = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET)
MIN_PROCESS_BYTES = 64 << 20  # an interpreter's own address space, roughly

libc = ctypes.CDLL(None, use_errno=True)
_REPORT = [-1]  # the report pipe's fd, from the spec


class JailError(Exception):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise JailError(f"{what}: {os.strerror(err)}")


def _mount(src, dst, fstype, flags, data=None) -> None:
    def enc(s):
        return s.encode() if s is not None else None

    _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {src} on {dst}")


def _bind_read_only(src: str, dst: str) -> None:
    """Bind `src` at `dst`, read-only, no setuid, no devices. A remount in a user namespace must
    keep the flags the host mount has (they are locked), so those are read and kept."""
    _mount(src, dst, None, MS_BIND | MS_REC)
    st = os.statvfs(src)
    kept = {
        os.ST_NOEXEC: MS_NOEXEC,
        os.ST_NOATIME: MS_NOATIME,
        os.ST_NODIRATIME: MS_NODIRATIME,
        os.ST_RELATIME: MS_RELATIME,
    }
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    for st_flag, ms_flag in kept.items():
        if st.f_flag & st_flag:
            flags |= ms_flag
    _mount(None, dst, None, flags)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _report(**fields) -> None:
    with contextlib.suppress(OSError):
        os.write(_REPORT[0], (json.dumps(fields) + "\n").encode())


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
    _mount(
        "tmpfs",
        new + "/box",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={spec['folder_bytes']},mode=0700,uid={uid},gid={uid}",
    )
    with open(spec["code_file"], "rb") as src, open(new + "/box/main.py", "wb") as dst:  # the host file, in view
        dst.write(src.read())
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


def load_seccomp(path: str):
    """The `pyseccomp` binding, loaded from its file: this launcher runs without site-packages."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("pyseccomp", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def own_keyring(seccomp) -> None:
    """A new, empty session keyring: the host's (systemd, PAM, ssh, `keyctl session`) is left behind."""
    nr = seccomp.resolve_syscall(seccomp.system_arch(), "keyctl")
    if libc.syscall(nr, KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() != errno.ENOSYS:
        raise JailError(f"join a session keyring of its own: {os.strerror(ctypes.get_errno())}")


def deny_syscalls(seccomp) -> None:
    """EPERM for what a program needs none of and an escape needs: keyrings, namespaces (unshare,
    setns, and clone with a namespace flag), mounts, ptrace, io_uring, bpf, kernel modules,
    fallocate; sockets of any family but unix and IP.
    clone3 hides its flags behind a pointer, so it gets ENOSYS and libc falls back to clone."""
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    arch = seccomp.system_arch()
    for name in DENIED:
        if seccomp.resolve_syscall(arch, name) >= 0:  # names this kernel's architecture has
            f.add_rule(seccomp.ERRNO(errno.EPERM), name)
    for flag in NAMESPACES:
        f.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    # vsock is not namespaced: the network namespace does not keep it from the hypervisor's services
    for call in ("socket", "socketpair"):  # socketpair too: a family's create code runs before it fails
        f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.GT, max(SOCKET_FAMILIES)))
        for family in set(range(max(SOCKET_FAMILIES))) - set(SOCKET_FAMILIES):
            f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.EQ, family))
    f.load()


def jail_cgroups(pid: int, memory_bytes: int, processes: int) -> list[str]:
    """Folders of a memory and a pids cgroup made for this jail under this process's own (cgroup v1
    controllers, or v2), this process moved in; [] where the kernel does not let it make them."""
    made = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.split(":", 2) for line in f.read().splitlines()]
        v1 = {c: path for _, names, path in lines for c in names.split(",") if c in ("memory", "pids")}
        if set(v1) == {"memory", "pids"}:
            wanted = [(f"/sys/fs/cgroup/{c}{v1[c]}", c) for c in ("memory", "pids")]
        else:
            v2 = next(path for h, names, path in lines if h == "0" and names == "")
            wanted = [(f"/sys/fs/cgroup{v2}", "v2")]
        for base, kind in wanted:
            folder = f"{base.rstrip('/')}/trillora-jail-{pid}"
            os.mkdir(folder)
            made.append(folder)
            for name, value in {
                "memory": [("memory.limit_in_bytes", memory_bytes), ("memory.memsw.limit_in_bytes?", memory_bytes)],
                "pids": [("pids.max", processes)],
                "v2": [("memory.max", memory_bytes), ("memory.swap.max?", 0), ("pids.max", processes)],
            }[kind]:
                name, optional = name.rstrip("?"), name.endswith("?")  # swap accounting may be off
                if not (optional and not os.path.exists(f"{folder}/{name}")):
                    _write(f"{folder}/{name}", str(value))
            _write(f"{folder}/cgroup.procs", str(os.getpid()))
    except (OSError, StopIteration):
        remove_cgroups(made)
        return []
    return made


def remove_cgroups(folders: list[str]) -> None:
    """Leave them (back to the parent's) and remove them, once the jail's processes are gone."""
    for folder in folders:
        with contextlib.suppress(OSError):
            _write(f"{os.path.dirname(folder)}/cgroup.procs", str(os.getpid()))
        for _ in range(50):
            try:
                os.rmdir(folder)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


def drop_privileges(spec: dict, as_root: bool, seccomp) -> None:
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
    own_keyring(seccomp)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    deny_syscalls(seccomp)
    for limit, value in (
        (resource.RLIMIT_CPU, spec["cpu_seconds"]),
        (resource.RLIMIT_AS, spec["process_bytes"]),
        (resource.RLIMIT_FSIZE, spec["output_bytes"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, spec["processes"]),
        (resource.RLIMIT_NOFILE, 64),
    ):
        hard = value + 1 if limit == resource.RLIMIT_CPU else value  # soft CPU limit: SIGXCPU, not SIGKILL
        resource.setrlimit(limit, (value, hard))


def hide_init() -> None:
    """What the program may read of PID 1 shows nothing of the host: its command line (the launcher's,
    with the spec: host paths) blanked in place, and not dumpable, so the /proc files that need
    ptrace access (environ, exe, maps, cwd, root) are refused to the program even where it runs
    under the same uid (an unprivileged launcher's user namespace)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # from field 3 (state) on
    start, end = int(fields[48 - 3]), int(fields[49 - 3])  # arg_start, arg_end
    ctypes.memset(start, 0, end - start)
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "not dumpable")


def init(spec: dict, as_root: bool, seccomp) -> None:
    """PID 1 of the jail: build it, run the program, wait (wall clock), report, exit."""
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
    hide_init()
    try:
        build_root(spec, as_root)
    except (OSError, JailError) as e:
        _report(error=f"cannot build the jail: {e}")
        os._exit(125)
    program = os.fork()
    if program == 0:
        try:
            _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")  # as a forked child would be: its own /proc
            drop_privileges(spec, as_root, seccomp)
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
    _report(status=status, timed_out=bool(timed_out))  # a failed start reported its error before: that decides
    os._exit(0)  # the kernel kills what is left in the namespace


def main() -> None:
    spec = json.loads(sys.argv[1])
    _REPORT[0] = spec["report_fd"]
    os.set_inheritable(_REPORT[0], False)  # the program never holds the report pipe
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    as_root = os.geteuid() == 0
    try:  # loaded while the host's files are in view (libseccomp with it)
        seccomp = load_seccomp(spec["seccomp_module"])
    except (OSError, ImportError) as e:
        _report(error=f"the seccomp binding (pyseccomp, libseccomp): {e}")
        sys.exit(125)
    # root: a uid no account uses, its own per launcher (RLIMIT_NPROC counts processes per uid);
    # otherwise the uid the program has inside its own user namespace
    spec["uid"] = UID_BASE + os.getpid() if as_root else 65534
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    # the jail's PID 1 counts against its pids cgroup too
    cgroups = jail_cgroups(os.getpid(), spec["memory_bytes"], spec["processes"] + 1) if as_root else []
    spec["process_bytes"] = spec["memory_bytes"]
    if not cgroups:  # processes × address space within the budget
        spec["process_bytes"] = max(spec["memory_bytes"] // spec["processes"], MIN_PROCESS_BYTES)
        spec["processes"] = max(1, min(spec["processes"], spec["memory_bytes"] // spec["process_bytes"]))
    _report(cgroups=cgroups)
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
        remove_cgroups(cgroups)
        sys.exit(125)
    child = os.fork()
    if child == 0:
        init(spec, as_root, seccomp)
    _, status = os.waitpid(child, 0)
    remove_cgroups(cgroups)
    sys.exit(0)


if __name__ == "__main__":
    main()
