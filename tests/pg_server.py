"""A real PostgreSQL server for the tests, started from Debian's `postgresql` package in a temporary
folder on a free loopback port (`.ci/run` installs the package where it is missing).

As root (CI), the server runs as the `postgres` user, since PostgreSQL refuses to run as root.
`make test` sets TRILLORA_REQUIRE_BENCH=1: a missing server then fails instead of skipping."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile

import pytest
from engine_helpers import free_port


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def postgres_server():
    """Yields a `postgresql://` URL of a fresh database on a server stopped afterwards."""
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        if os.environ.get("TRILLORA_REQUIRE_BENCH") == "1":
            pytest.fail("PostgreSQL is not installed (Debian: apt-get install postgresql; .ci/run does this)")
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    pytest.importorskip("psycopg", reason="the postgres extra: pip install -e '.[postgres]'")
    root = tempfile.mkdtemp(prefix="trillora-pg-")
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(root, "data"), free_port()
    subprocess.run(
        [*as_user, initdb, "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    subprocess.run(
        [
            *as_user,
            pg_ctl,
            "-D",
            data,
            "-l",
            os.path.join(root, "log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=on",
            "start",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)
