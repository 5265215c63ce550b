"""The jail attacked through its files and sockets (a third round, as root): an output file grown
past its size limit, the launcher's own exit status, long or unencodable programs, sockets of
families the network namespace does not cover."""

from __future__ import annotations

import errno

from trillora.sandbox.jail import Limits, _read_bounded, run_python

FAST = Limits(cpu_seconds=2, wall_seconds=5.0)
GROW = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.write(1, b'A' * 4096)
for name, mode in (('insert_range', 0x20), ('keep_size', 0x01)):
    ret = libc.fallocate(1, mode, ctypes.c_long(0), ctypes.c_long(1 << 30))
    os.write(2, f"{name} {os.strerror(ctypes.get_errno()) if ret else 'grew'}\\n".encode())
"""


def test_output_files_cannot_grow_past_their_limit():
    """fallocate with INSERT_RANGE grew stdout to 1 GiB of holes (RLIMIT_FSIZE does not check it) and
    the host read it whole; with KEEP_SIZE it took 2 GiB of the host's disk. The filter refuses it."""
    r = run_python(GROW, limits=FAST)
    assert r.ok, r.stderr
    assert r.stdout == "A" * 4096
    assert r.stderr.splitlines() == ["insert_range Operation not permitted", "keep_size Operation not permitted"]


def test_an_output_file_is_read_up_to_its_cap_whatever_its_size(tmp_path):
    big = tmp_path / "stdout"
    with open(big, "wb") as f:
        f.write(b"head")
        f.truncate(1 << 30)  # 1 GiB that reads as zeros after the head, none of it on disk
        f.seek((1 << 30) - 4)
        f.write(b"tail")
    assert _read_bounded(big, 8, tail=False) == "head\0\0\0\0"
    assert _read_bounded(big, 8, tail=True) == "\0\0\0\0tail"
    assert len(_read_bounded(big, 64 << 10, tail=True)) == 64 << 10


def test_a_program_may_exit_with_the_launchers_failure_status():
    """125 was the launcher's own "cannot start": a program ending with it raised SandboxUnavailable,
    which stops a code-task run (`task.on_reward_error="fail"`)."""
    for code in ("import os; os._exit(125)", "import sys; sys.exit(125)"):
        r = run_python(code, limits=FAST)
        assert r.returncode == 125 and not r.timed_out and not r.ok, (code, r)


def test_long_and_unencodable_programs_run_or_fail_as_programs():
    """The program travelled in argv as ASCII JSON (128 KiB per argument: 20,000 emoji were too many),
    and a lone surrogate crashed the launcher; it is now a file, and Python judges it."""
    r = run_python("# " + "\U0001f600" * 40_000 + "\nprint('ran')\n", limits=FAST)
    assert r.ok and r.stdout == "ran\n", r.stderr[-300:]
    r = run_python("x = 1\n" * 30_000 + "print(x)\n", limits=FAST)
    assert r.ok and r.stdout == "1\n"
    r = run_python("print('\ud800')\n", limits=FAST)
    assert not r.ok and "SyntaxError" in r.stderr


SOCKETS = """
import socket
for name in ('AF_UNIX', 'AF_INET', 'AF_INET6', 'AF_VSOCK', 'AF_PACKET', 'AF_NETLINK', 'AF_ALG'):
    try:
        socket.socket(getattr(socket, name), socket.SOCK_DGRAM if name == 'AF_NETLINK' else socket.SOCK_STREAM
                      if name != 'AF_PACKET' else socket.SOCK_RAW).close()
        print(name, 'made')
    except OSError as e:
        print(name, e.errno)
try:
    socket.socketpair(socket.AF_VSOCK, socket.SOCK_DGRAM)
except OSError as e:
    print('socketpair-vsock', e.errno)
"""


def test_only_unix_and_ip_sockets_can_be_made():
    """vsock is not network-namespaced: a jailed program could reach the hypervisor's services."""
    r = run_python(SOCKETS, limits=FAST)
    assert r.ok, r.stderr
    got = dict(line.split() for line in r.stdout.splitlines())
    refused = str(errno.EAFNOSUPPORT)
    assert got == {
        "AF_UNIX": "made",
        "AF_INET": "made",
        "AF_INET6": "made",
        "AF_VSOCK": refused,
        "AF_PACKET": refused,
        "AF_NETLINK": refused,
        "AF_ALG": refused,
        "socketpair-vsock": refused,  # not ENODEV: the family's code never ran
    }, got
