"""The page's fine-tunes in a real browser (headless Chromium): the server's LoRA adapters are choices (the request's
`model` over the WebSocket), a voice can be created bound to one and the voice list says so. Skipped where Chromium
or Playwright is missing, failed under CI=true (tests/browser/chromium.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
sys.path.insert(0, str(Path(__file__).parent))
from server_helpers import wav_bytes  # noqa: E402
from test_page import dummy_server, page  # noqa: E402,F401 (page: the fixture)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import torch

    from csmserve.models.loader import tiny_config
    from csmserve.models.lora import write_adapter

    root = tmp_path_factory.mktemp("loras")
    ann = write_adapter(root / "ann", tiny_config(), rank=4, seed=1, std=0.3, dtype=torch.float32)
    with dummy_server(tmp_path_factory, {"ann": str(ann)}, default_audio_length_ms=800) as s:
        yield s


def test_fine_tunes_are_choices_and_voices_bind_to_them(server, page, tmp_path):  # noqa: F811
    clip = tmp_path / "clip.wav"
    clip.write_bytes(wav_bytes(1.0))
    page.goto(server.url + "/")
    page.wait_for_function("document.querySelectorAll('#model-select option').length > 1")
    assert page.eval_on_selector_all("#model-select option", "os => os.map(o => o.value)") == ["", "ann"]
    assert "1 fine-tune" in page.inner_text("#model")

    # a voice bound to the fine-tune: the list says so, and it alone picks the adapter
    page.set_input_files("#voice-file", str(clip))
    page.fill("#voice-name", "annie")
    page.fill("#voice-transcript", "A steady tone.")
    page.select_option("#voice-adapter", "ann")
    page.click("#voice-create-btn")
    page.wait_for_function("window.csm.createdVoice !== undefined")
    assert server.state.store.get("annie").adapter == "ann"
    assert "fine-tune ann" in page.inner_text("#voice-select")
    assert "the voice's: ann" in page.inner_text("#model-select")

    # the base voice alloy with the fine-tune chosen: the session speaks with `model` = ann
    page.select_option("#voice-select", "alloy")
    page.select_option("#model-select", "ann")
    page.fill("#max-ms", "320")
    page.fill("#text", "Hello from a fine-tune.")
    page.click("#speak")
    page.wait_for_function("csm.utterances >= 1 && !csm.busy")
    assert server.state.sessions.get(page.evaluate("contextId")).model == "ann"
    assert page.evaluate("csm.samplesReceived") == 4 * 1920 and not page.evaluate("csm.errors")
    assert not page.problems, page.problems
