"""A real uvicorn server on 127.0.0.1:<free port>, in a thread, around `create_app(csm, config)`.

`csm` is `CSM("dummy-tiny", engine=True)` once csmserve.api has the engine; until then (or with
CSMSERVE_TEST_FAKE_CSM=1) the stand-in in fake_csm.py with the same surface.
"""
from __future__ import annotations

import os
import warnings

import pytest

from csmserve.config import EngineConfig, ServerConfig
from csmserve.server import create_app

ENGINE = EngineConfig(max_slots=32, max_seq_len=512, first_chunk_frames=1, chunk_frames=2)
from server_helpers import SHORT_MS, Server


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

    def start(csm_=csm, **kw) -> Server:
        kw.setdefault("voices_db", str(tmp_path / "voices.db"))
        kw.setdefault("default_audio_length_ms", SHORT_MS)
        server = Server(create_app(csm_, ServerConfig(**kw))).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def server(serve):
    return serve()




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
