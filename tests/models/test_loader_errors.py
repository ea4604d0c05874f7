"""First-run errors: every way of not getting the model from the hub is one line that says why and
what to do (huggingface_hub's own exception classes, raised by a monkeypatched snapshot_download)."""
from __future__ import annotations

import errno

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import pytest
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

from csmserve.apps.cli import main as cli
from csmserve.models.loader import ModelUnavailableError, resolve_model_dir

MODEL = "sesame/csm-1b"


def _http():
    """The HTTP library huggingface_hub raises with (httpx2 in 2.x, requests in 0.x)."""
    for name in ("httpx2", "httpx"):
        try:
            return __import__(name)
        except ImportError:
            pass
    raise pytest.skip("no HTTP library for huggingface_hub's errors")


def _response(status: int):
    http = _http()
    url = f"https://huggingface.co/api/models/{MODEL}/revision/main"
    return http.Response(status, request=http.Request("GET", url), headers={"x-request-id": "abc"})


def _connect_error():
    return _http().ConnectError("[Errno -2] Name or service not known")


def _offline_error() -> Exception:
    cause = _connect_error()
    e = LocalEntryNotFoundError(f"Got: ConnectError: {cause}\nAn error happened while trying to locate the files "
                                "on the Hub, and we cannot find the appropriate snapshot folder for the specified "
                                "revision on the local disk. Please check your internet connection and try again.")
    e.__cause__ = cause
    return e


ERRORS = {
    "offline": (_offline_error, ["cannot reach the Hugging Face hub", "Name or service not known", "not in the cache",
                                 "--model dummy-tiny"]),
    "gated": (lambda: GatedRepoError("401 Client Error. Cannot access gated repo for url ...",
                                     response=_response(401)),
              ["gated", "accept its terms at https://huggingface.co/sesame/csm-1b", "HF_TOKEN",
               "huggingface-cli login"]),
    "wrong_id": (lambda: RepositoryNotFoundError("404 Client Error. Repository Not Found for url ...",
                                                 response=_response(404)),
                 ["no model 'sesame/csm-1b' on the Hugging Face hub", "check the id", "--model dummy-tiny"]),
    "disk_full": (lambda: OSError(errno.ENOSPC, "No space left on device"),
                  ["no space left", "HF_HOME", "--model dummy-tiny"]),
    "hub_down": (lambda: huggingface_hub.errors.HfHubHTTPError("503 Server Error", response=_response(503)),
                 ["HTTP 503", "retry later"]),
}


@pytest.fixture
def no_token(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)


def _raising(make):
    def snapshot_download(*a, **kw):
        raise make()
    return snapshot_download


@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_each_hub_failure_is_one_line_with_why_and_what_to_do(kind, monkeypatch, no_token):
    make, needles = ERRORS[kind]
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(make))
    with pytest.raises(ModelUnavailableError) as info:
        resolve_model_dir(MODEL)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_gated_with_a_token_says_the_token_lacks_access(monkeypatch, no_token):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_abc")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(ERRORS["gated"][0]))
    with pytest.raises(ModelUnavailableError, match="token has no access.*accept its terms"):
        resolve_model_dir(MODEL)


def test_disk_full_found_through_the_exception_chain(monkeypatch, no_token):
    def make():
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            try:
                raise RuntimeError("download failed") from e
            except RuntimeError as wrapped:
                return wrapped

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(make))
    with pytest.raises(ModelUnavailableError, match="no space left"):
        resolve_model_dir(MODEL)


def test_hub_offline_env_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(
        lambda: LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder\n...")))
    with pytest.raises(ModelUnavailableError, match="HF_HUB_OFFLINE.*--model dummy-tiny"):
        resolve_model_dir(MODEL)


def test_not_a_hub_id_names_what_works():
    with pytest.raises(ValueError, match="hub id like sesame/csm-1b.*dummy-tiny"):
        resolve_model_dir("no such thing")


@pytest.mark.parametrize("kind", ["offline", "gated"])
def test_cli_prints_the_whole_message_on_one_line(kind, monkeypatch, no_token, capsys, tmp_path):
    make, needles = ERRORS[kind]
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(make))
    rc = cli.main(["speak", "Hi.", "-o", str(tmp_path / "hi.wav"), "--model", MODEL, "--device", "cpu", "-q"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("csmserve speak: error: "), err
    for needle in needles:  # the hint after the reason reaches the user
        assert needle in lines[0], (needle, lines[0])
    assert not (tmp_path / "hi.wav").exists()


def test_cli_joins_a_multi_line_message():
    assert cli.one_line(ValueError("first line\n  the hint\n")) == "first line the hint"


def test_serve_logs_a_model_it_cannot_get_as_one_line(monkeypatch, no_token, caplog, tmp_path):
    """`csmserve serve` loads in the background (/health answers at once): the failure is one log line with
    the hint, no traceback, and /ready stays 503."""
    import asyncio
    import logging

    from csmserve.config import ServerConfig
    from csmserve.models.loader import load_csm
    from csmserve.server.app import _load
    from csmserve.server.state import ServerState
    from csmserve.voices import VoiceStore

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(ERRORS["gated"][0]))
    with VoiceStore(tmp_path / "v.db") as store:
        state = ServerState(None, ServerConfig(), store)
        with caplog.at_level(logging.ERROR, logger="csmserve.server"):
            asyncio.run(_load(state, lambda: load_csm(MODEL)))
    (record,) = [r for r in caplog.records if r.name == "csmserve.server"]
    assert record.exc_info is None and "\n" not in record.getMessage()
    assert "HF_TOKEN" in record.getMessage() and "/ready stays 503" in record.getMessage()
    assert not state.ready
