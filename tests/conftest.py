import os
import uuid

import pytest
import torch

# Tiny models: intra-op threads only add synchronisation on a 2-core CI machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pg_server():
    """A throwaway PostgreSQL server (tests/pg.py) for the whole session -> its URL. Skipped where
    PostgreSQL or psycopg is missing, except in CI (CI=true), where .ci/run installs both."""
    import pg

    missing = pg.pg_bin() is None and "PostgreSQL (apt-get install -y postgresql)"
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
