"""`csmserve speak --script FILE`: a dialogue in one stream, in-process and through a server (--url)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from csmserve import api
from csmserve.apps.cli import main as cli
from csmserve.voices import VoiceStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import Server  # noqa: E402

TINY = ["--model", "dummy-tiny", "--device", "cpu", "--max-audio-length-ms", "160", "--temperature", "0", "-q"]


def test_script_in_process_casts_voices_and_speakers(tmp_path, monkeypatch):
    db = tmp_path / "voices.db"
    with VoiceStore(db) as store:
        store.create("ann", "I am Ann.", np.full((3, 32), 7), speaker=5)
    calls = []
    dialogue = api.CSM.dialogue
    monkeypatch.setattr(api.CSM, "dialogue", lambda self, lines, **kw: (calls.append((lines, kw)),
                                                                         dialogue(self, lines, **kw))[1])
    script = tmp_path / "s.txt"
    script.write_text("[S1] Hi there. How are you?\n[S2] Fine!\n")
    out = tmp_path / "d.wav"
    assert cli.main(["speak", "--script", str(script), "--voices", "ann", "--voices-db", str(db), "-o", str(out),
                     *TINY]) == 0
    (lines, kw), = calls
    assert lines == [(0, "Hi there. How are you?"), (1, "Fine!")]
    (clip,) = kw["context"]  # ann's clip as [S1]'s speaker id, 0 (stored as 5)
    assert clip.speaker == 0 and clip.text == "I am Ann." and (clip.codes == 7).all()
    assert out.read_bytes()[:4] == b"RIFF" and out.stat().st_size > 44
    script.write_text(json.dumps([{"text": "One.", "voice": "ann"}, {"text": "Two.", "speaker": 3}]))
    assert cli.main(["speak", "--script", str(script), "--voices-db", str(db), "-o", str(out), *TINY]) == 0
    assert calls[-1][0] == [(0, "One."), (3, "Two.")]


def test_script_errors_are_one_line(tmp_path, capsys):
    script = tmp_path / "s.txt"
    script.write_text("no tags here")
    for argv, needle in [(["--script", str(script)], "speaker tag"), (["Hi.", "--script", str(script)], "not both"),
                         (["Hi.", "--voices", "a"], "--voices goes with --script"),
                         (["--script", str(tmp_path / "none.txt")], "cannot read")]:
        assert cli.main(["speak", *argv, "-o", str(tmp_path / "x.wav"), *TINY]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_script_through_a_server_is_one_dialogue_request(tmp_path):
    from csmserve import CSM
    from csmserve.config import EngineConfig, ServerConfig
    from csmserve.server import create_app

    csm = CSM("dummy-tiny", device="cpu", dtype="float32", engine_config=EngineConfig(max_slots=2, max_seq_len=512))
    server = Server(create_app(csm, ServerConfig(voices_db=str(tmp_path / "v.db")))).start()
    seen, stream = [], server.state.stream
    server.state.stream = lambda request, *a, **kw: (seen.append(len(request.segments)), stream(request, *a, **kw))[1]
    try:
        script = tmp_path / "s.txt"
        script.write_text("[S1] Hello there. [S2] Hi! [S1] Bye.")
        out = tmp_path / "d.pcm"
        assert cli.main(["speak", "--script", str(script), "--url", server.url, "-o", str(out), "-q",
                         "--max-audio-length-ms", "160", "--temperature", "0"]) == 0
        assert seen == [2] and out.stat().st_size % (1920 * 2) == 0 and out.stat().st_size > 0
    finally:
        server.stop()
        csm.close()
