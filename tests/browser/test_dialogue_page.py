"""The page's Dialogue panel in headless Chromium: a [S1]/[S2] script with a stored voice for [S1] is
one POST /v1/audio/speech; its PCM plays, each segment comes with exact timestamps, captions follow."""
from __future__ import annotations

import httpx

from test_page import page, server  # noqa: F401 - the fixtures (Chromium, a dummy-tiny server)
from server_helpers import wav_bytes


def test_dialogue_panel_plays_a_script_with_timestamps(server, page):  # noqa: F811
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "ann", "transcript": "I am Ann."},
                   files={"audio_sample": ("a.wav", wav_bytes(0.5), "audio/wav")}, timeout=60)
    assert r.status_code == 200
    seen, stream = [], server.state.stream
    server.state.stream = lambda request, *a, **kw: (seen.append(len(request.segments)), stream(request, *a, **kw))[1]
    try:
        page.goto(server.url + "/")
        page.wait_for_function(
            "[...document.querySelectorAll('#dialogue-s1 option')].some(o => o.textContent.startsWith('ann'))")
        page.select_option("#dialogue-s1", label=page.eval_on_selector(
            "#dialogue-s1", "s => [...s.options].find(o => o.textContent.startsWith('ann')).textContent"))
        page.fill("#max-ms", "240")
        page.fill("#temperature", "0")
        page.fill("#dialogue-script", "[S1] Hello there. [S2] Hi! [S1] Bye now.")
        page.click("#dialogue-play")
        page.wait_for_function("csm.dialogue.done !== null && !csm.dialogue.busy")
        d = page.evaluate("csm.dialogue")
        page.wait_for_function("document.querySelector('#dialogue-caption').textContent.length > 0")
        caption = page.inner_text("#dialogue-caption")
    finally:
        server.state.stream = stream
    assert not page.problems and not d["errors"]
    assert seen == [2]  # one request: the first line's sentence, then two more segments
    segs = d["segments"]
    assert [(s["speaker"], s["text"]) for s in segs] == [(0, "Hello there."), (1, "Hi!"), (0, "Bye now.")]
    assert d["samples"] == segs[-1]["audio_end_ms"] * 24 == d["done"]["usage"]["output_tokens"] * 1920
    assert [s["audio_start_ms"] for s in segs[1:]] == [s["audio_end_ms"] for s in segs[:-1]]
    assert caption.startswith("S")


def test_dialogue_voices_fill_when_the_list_loaded_before_its_script(server, page):  # noqa: F811
    """dialogue.js fills its voice lists from the page's on load too, not only on a later change: here its script
    arrives after app.js has already loaded the voice list (held back 1.5 s), as on a slow link or a busy server."""
    import time

    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "bea", "transcript": "I am Bea."},
                   files={"audio_sample": ("b.wav", wav_bytes(0.5), "audio/wav")}, timeout=60)
    assert r.status_code == 200

    def late(route):
        time.sleep(1.5)
        route.continue_()

    page.route("**/static/dialogue.js", late)
    page.goto(server.url + "/")
    page.wait_for_function("[...document.querySelectorAll('#voice-select option')].some(o => "
                           "o.textContent.startsWith('bea'))")
    names = page.eval_on_selector_all("#dialogue-s1 option", "os => os.map(o => o.textContent)")
    assert any(n.startswith("bea") for n in names), names
    assert not page.problems
