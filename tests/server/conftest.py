"""The servers the tests talk to, over real sockets.

`server` runs every test that uses it twice: "inproc", a uvicorn server in a thread around
`create_app(csm, config)` (the engine on a thread of the test process: tests may look inside), and
"procs", `csmserve serve --api-workers 2` as users run it (parent, engine-core process, two API
workers; one for the session: every module's procs tests share it, so they use context_ids of their
own and look at counters as deltas once the engine is idle), where only the public API exists: tests
marked `inproc` (they read server.state) run in the first mode only. `serve(**config)` starts in-process servers with a config.

`csm` is `CSM("dummy-tiny", engine=True)`; with CSMSERVE_TEST_FAKE_CSM=1 the stand-in in fake_csm.py.
"""
from __future__ import annotations

import os
import warnings

import pytest

from csmserve.config import EngineConfig, ServerConfig
from csmserve.server import create_app

ENGINE = EngineConfig(max_slots=32, max_seq_len=512, first_chunk_frames=1, chunk_frames=2)
from server_helpers import SHORT_MS, ProcServer, Server


def _make_csm():
    if os.environ.get("CSMSERVE_TEST_FAKE_CSM") != "1":
        try:
            from csmserve import CSM

            c = CSM("dummy-tiny", device="cpu", dtype="float32", engine=True, engine_config=ENGINE)
            _ = c.client  # starts the engine
            return c
        except TypeError:  # csmserve.api without the engine yet
            warnings.warn("csmserve.CSM has no engine yet: server tests run on the stand-in (fake_csm.py)")
    from fake_csm import FakeCSM

    return FakeCSM("dummy-tiny", ENGINE)


@pytest.fixture(scope="session")
def csm():
    c = _make_csm()
    yield c
    c.close()


@pytest.fixture
def serve(csm, tmp_path):
    """serve(**ServerConfig fields) -> a started Server; all stopped at teardown."""
    servers = []

    def start(csm_=csm, sndbuf=None, **kw) -> Server:
        kw.setdefault("voices_db", str(tmp_path / "voices.db"))
        kw.setdefault("default_audio_length_ms", SHORT_MS)
        server = Server(create_app(csm_, ServerConfig(**kw)), sndbuf=sndbuf).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def proc_server(tmp_path_factory):
    """The procs server, started once (a tree takes ~6 s to start on the 2-core CI machine): the same
    flags for every module, and no test that uses it kills or reconfigures it (test_processes and
    test_durability start trees of their own)."""
    s = ProcServer(tmp_path_factory.mktemp("procs")).start()
    yield s
    s.stop()


@pytest.fixture(params=["inproc", "procs"])
def server(request, serve):
    if request.param == "inproc":
        return serve()
    if request.node.get_closest_marker("inproc"):
        pytest.skip("reads the in-process server's state")
    return request.getfixturevalue("proc_server")


def pytest_configure(config):
    config.addinivalue_line("markers", "inproc: reads server.state; runs against the in-process server only")




@pytest.fixture(scope="session")
def small_csm():
    """One slot and one place in the queue: the third request is refused by the engine (SchedulerBusy)."""
    global ENGINE
    saved, ENGINE = ENGINE, EngineConfig(max_slots=1, max_waiting=1, max_seq_len=512)
    try:
        c = _make_csm()
    finally:
        ENGINE = saved
    yield c
    c.close()
