"""A throwaway PostgreSQL server for the tests: `initdb` + `pg_ctl` in a temp dir, on a free port.

Debian's `postgresql` package (installed by .ci/run) puts the binaries in /usr/lib/postgresql/<v>/bin.
PostgreSQL refuses to run as root, so as root the cluster belongs to the `postgres` user (created by the
package) and every command runs through `runuser -u postgres`.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from collections.abc import Iterator


def pg_bin() -> str | None:
    """The folder holding initdb and pg_ctl (the newest installed version), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_owner(cmd: list[str], owner: str | None) -> list[str]:
    return ["runuser", "-u", owner, "--", *cmd] if owner else cmd


@contextmanager
def postgres_server() -> Iterator[str]:
    """-> the URL of a running server's `postgres` database (user postgres, trust auth); stopped after."""
    bindir = pg_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (apt-get install -y postgresql)")
    owner = None
    if os.geteuid() == 0:
        owner = "postgres"
        pw = pwd.getpwnam(owner)  # KeyError without the package's user
    root = tempfile.mkdtemp(prefix="csmserve-pg-")
    data = os.path.join(root, "data")
    if owner:
        os.chown(root, pw.pw_uid, pw.pw_gid)
    port = _free_port()
    run = lambda *cmd: subprocess.run(_as_owner(list(cmd), owner), check=True, capture_output=True,  # noqa: E731
                                      text=True, timeout=120)
    try:
        run(f"{bindir}/initdb", "-D", data, "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        opts = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} -c fsync=off"
        run(f"{bindir}/pg_ctl", "-D", data, "-l", os.path.join(root, "log"), "-o", opts, "-w", "-t", "60", "start")
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        _wait(port)
        yield url
    finally:
        if os.path.exists(os.path.join(data, "postmaster.pid")):
            subprocess.run(_as_owner([f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"], owner),
                           capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def _wait(port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def fresh_database(url: str, name: str) -> str:
    """CREATE DATABASE name on the server of `url` -> its URL (each test gets its own, empty)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + "/" + name
