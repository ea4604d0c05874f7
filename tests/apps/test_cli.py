"""`python -m csmserve speak | bench` on dummy-tiny weights, and the public API."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from server_helpers import Server, decode_24k, wav_bytes  # noqa: E402

TINY = ("--model", "dummy-tiny", "--device", "cpu")


def _run(*args: str, env: dict[str, str] | None = None, stdin: bytes | None = None,
         text: bool = True) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    inp = stdin.decode() if (stdin is not None and text) else stdin
    return subprocess.run([sys.executable, "-m", "csmserve", *args], capture_output=True, text=text, env=e,
                          timeout=300, input=inp, cwd=tempfile.gettempdir())  # stray relative outputs land there


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    err = r.stderr.decode() if isinstance(r.stderr, bytes) else r.stderr
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0], err
    for n in needles:
        assert n in lines[0], err


def _wav_seconds(data: bytes) -> float:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24_000, 1, 2)
        return w.getnframes() / 24_000 if w.getnframes() < 2**31 // 2 else (len(data) - 44) / 2 / 24_000


def test_speak_writes_codes(tmp_path):
    out = tmp_path / "x.npy"
    r = _run("speak", "Hello there.", *TINY, "--seed", "3", "--temperature", "0.8", "--top-k",
             "20", "--max-audio-length-ms", "640", "--speaker", "1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    codes = np.load(out)
    assert codes.shape == (8, 32) and codes.dtype == np.int64
    assert "0.64 s of audio" in r.stderr and r.stdout == ""


def test_readme_speak_on_random_weights_stops_at_a_readers_length(tmp_path):
    """Issue 39: the README's first command. dummy-tiny never ends a sentence (no EOS): with no
    --max-audio-length-ms its two sentences stop at a reader's length for the text (150 ms a character: each
    sentence at most the longest's, 25 characters, and all of it 46 characters: 6.88 s), not 20 s each."""
    out = tmp_path / "hello.wav"
    r = _run("speak", "Hello from csmserve. Any length of text works.", "-o", str(out), "--model", "dummy-tiny")
    assert r.returncode == 0, r.stderr
    assert _wav_seconds(out.read_bytes()) == (46 * 150 // 80) * 1920 / 24_000
    assert "6.88 s of audio" in r.stderr


def test_stdin_to_stdout_is_only_audio():
    r = _run("speak", "-", "-o", "-", *TINY, "--max-audio-length-ms", "240", "--seed", "1",
             stdin=b"Hello from stdin. A second sentence!", text=False)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout[:4] == b"RIFF" and r.stdout[8:12] == b"WAVE"  # nothing before the audio
    samples = (len(r.stdout) - 44) // 2
    assert samples % 1920 == 0 and 2 * 1920 <= samples <= 2 * 3 * 1920  # 2 sentences, 1..3 frames each
    # and the raw pcm format, also via -i -
    r = _run("speak", "-i", "-", "-o", "-", "--format", "pcm", *TINY, "--max-audio-length-ms", "160", "-q",
             stdin=b"Just one.", text=False)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert len(r.stdout) % (2 * 1920) == 0 and 0 < len(r.stdout) <= 2 * 2 * 1920


def test_twenty_sentences_one_file(tmp_path):
    sentences = [f"This is sentence number {i}, of twenty." for i in range(1, 21)]
    src = tmp_path / "story.txt"
    src.write_text("\n".join(sentences) + "\n")
    out = tmp_path / "story.wav"
    r = _run("speak", "-i", str(src), "-o", str(out), *TINY, "--max-audio-length-ms", "240", "--seed", "7")
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    seconds = _wav_seconds(data)  # the header carries the real sizes in a file
    assert (len(data) - 44) / 2 / 24_000 == pytest.approx(seconds)
    # each sentence gives 1..3 frames (random weights rarely stop early) into one continuous file
    assert 20 * 0.08 - 1e-6 <= seconds <= 20 * 0.24 + 1e-6, seconds
    assert round(seconds / 0.08, 6) == int(round(seconds / 0.08))
    assert "s of audio" in r.stderr


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_formats_from_extension(tmp_path, fmt):
    out = tmp_path / f"x.{fmt}"
    r = _run("speak", "One. Two.", "-o", str(out), *TINY, "--max-audio-length-ms", "160", "-q")
    assert r.returncode == 0, r.stderr
    audio = decode_24k(out.read_bytes(), fmt)
    assert 0.1 < audio.size / 24_000 < 0.6


def test_ref_audio_and_stored_voice(tmp_path):
    ref = tmp_path / "ref.wav"
    ref.write_bytes(wav_bytes(0.8))
    out = tmp_path / "r.wav"
    r = _run("speak", "Hello.", "-o", str(out), *TINY, "--ref-audio", str(ref), "--ref-text", "A tone.",
             "--max-audio-length-ms", "160")
    assert r.returncode == 0, r.stderr
    assert 0 < _wav_seconds(out.read_bytes()) <= 0.16 + 1e-6
    from csmserve.voices import VoiceStore

    db = tmp_path / "voices.db"
    with VoiceStore(db) as store:
        store.create("narrator", "Some words.", np.full((3, 32), 7), speaker=1)
    r = _run("speak", "Hello.", "-o", str(out), *TINY, "--voice", "narrator", "--voices-db", str(db),
             "--max-audio-length-ms", "160", "-q")
    assert r.returncode == 0, r.stderr
    r = _run("speak", "Hello.", "-o", str(out), *TINY, "--voice", "nobody", "--voices-db", str(db))
    _one_line_error(r, "nobody", "not found")


def test_url_against_a_running_server(tmp_path):
    from csmserve import CSM
    from csmserve.config import EngineConfig, ServerConfig
    from csmserve.server import create_app

    csm = CSM("dummy-tiny", device="cpu", dtype="float32",
              engine_config=EngineConfig(max_slots=4, max_seq_len=512, first_chunk_frames=1, chunk_frames=2))
    server = Server(create_app(csm, ServerConfig(voices_db=str(tmp_path / "v.db"), api_key="k3y"))).start()
    try:
        out = tmp_path / "u.flac"
        r = _run("speak", "Over the wire. Twice over.", "-o", str(out), "--url", server.url, "--api-key", "k3y",
                 "--max-audio-length-ms", "240", "--seed", "5")
        assert r.returncode == 0, r.stderr
        assert 0.08 <= decode_24k(out.read_bytes(), "flac").size / 24_000 <= 0.48 + 0.01
        assert server.url in r.stderr
        r = _run("speak", "Hi.", "-o", "-", "--url", server.url + "/v1", "--api-key", "k3y", "-q",
                 "--max-audio-length-ms", "160", text=False)
        assert r.returncode == 0 and r.stdout[:4] == b"RIFF", r.stderr
        r = _run("speak", "Hi.", "-o", str(out), "--url", server.url, "--api-key", "wrong")
        _one_line_error(r, "401")
        r = _run("speak", "Hi.", "-o", str(out), "--url", server.url, "--api-key", "k3y", "--voice", "nobody")
        _one_line_error(r, "404", "nobody")
    finally:
        server.stop()
        csm.close()
    r = _run("speak", "Hi.", "-o", str(out), "--url", server.url)  # nobody listens there any more
    _one_line_error(r, server.url)


def test_bad_flags_and_unreadable_files(tmp_path):
    _one_line_error(_run("speak", "hi", *TINY, "--top-k", "many", "-o", "x.wav"), "--top-k")
    _one_line_error(_run("speak", "hi", *TINY), "-o")
    _one_line_error(_run("speak", "hi", "-o", str(tmp_path / "x.doc"), *TINY), "extension")
    _one_line_error(_run("speak", "hi", "-o", "x.wav", "--format", "ogg-vorbis"), "--format")
    _one_line_error(_run("speak", "-o", "x.wav", *TINY), "no text")
    _one_line_error(_run("speak", "hi", "-i", "f.txt", "-o", "x.wav"), "not both")
    _one_line_error(_run("speak", "hi", "-o", "x.wav", "--ref-audio", "a.wav"), "--ref-text")
    _one_line_error(_run("speak", "hi", "-o", "x.wav", "--speaker", "300"), "--speaker")
    _one_line_error(_run("speak", "hi", "-o", "x.wav", "--top-p", "0"), "--top-p")
    _one_line_error(_run("speak", "hi", "-o", "x.wav", "--url", "localhost:8000"), "--url")
    _one_line_error(_run("speak", "-i", str(tmp_path / "missing.txt"), "-o", "x.wav", *TINY), "missing.txt",
                    "No such file")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x81")
    _one_line_error(_run("speak", "-i", str(tmp_path / "bin.txt"), "-o", "x.wav", *TINY), "UTF-8")
    _one_line_error(_run("speak", "-i", str(tmp_path), "-o", "x.wav", *TINY), "cannot read")
    (tmp_path / "empty.txt").write_text("  \n")
    _one_line_error(_run("speak", "-i", str(tmp_path / "empty.txt"), "-o", "x.wav", *TINY), "empty")
    (tmp_path / "noise.wav").write_bytes(b"not audio at all")
    _one_line_error(_run("speak", "hi", "-o", "x.wav", *TINY, "--ref-audio", str(tmp_path / "noise.wav"),
                         "--ref-text", "x"), "--ref-audio")
    _one_line_error(_run("speak", "hi", "-o", "x.wav", *TINY, "--ref-audio", str(tmp_path / "nope.wav"),
                         "--ref-text", "x"), "nope.wav")
    _one_line_error(_run("speak", "hi", "-o", str(tmp_path / "no" / "dir" / "x.wav"), *TINY), "cannot write")
    _one_line_error(_run("nonsense"), "invalid choice")


def test_a_failed_run_leaves_an_existing_output_and_a_fifo_alone(tmp_path):
    """A run that fails before any audio (a wrong --model) leaves an existing -o file as it was and a FIFO in
    place; a new file it made is removed; a WAV into a FIFO (not seekable) keeps its streaming header, exit 0."""
    keep = tmp_path / "keep.wav"
    keep.write_bytes(b"precious")
    _one_line_error(_run("speak", "hi", "--model", str(tmp_path / "nowhere"), "-o", str(keep)), "nowhere")
    assert keep.read_bytes() == b"precious"
    _one_line_error(_run("speak", "hi", "--model", str(tmp_path / "nowhere"), "-o", str(tmp_path / "new.wav")))
    assert not (tmp_path / "new.wav").exists()
    fifo = tmp_path / "out.fifo"
    for model, rc in ((str(tmp_path / "nowhere"), 2), ("dummy-tiny", 0)):
        os.mkfifo(fifo)
        reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
        r = _run("speak", "Hello there.", "--model", model, "--device", "cpu", "--format", "wav", "-o", str(fifo))
        data = reader.communicate(timeout=60)[0]
        assert r.returncode == rc and fifo.is_fifo(), r.stderr
        if rc == 0:
            assert _wav_seconds(data) > 0.5
        fifo.unlink()


def test_a_bad_voices_db_port_or_script_is_one_line(tmp_path):
    (tmp_path / "notadb").write_text("not a database file, not even close to one")
    _one_line_error(_run("speak", "hi", *TINY, "--voice", "ann", "--voices-db", str(tmp_path / "notadb"), "-o",
                         str(tmp_path / "x.wav")), "cannot open the voices DB", "not a database")
    _one_line_error(_run("serve", *TINY, "--voices-db", str(tmp_path / "notadb"), "--port", "0"),
                    "cannot open the voices DB")
    _one_line_error(_run("serve", *TINY, "--port", "99999"), "port must be in 0..65535")
    (tmp_path / "empty.json").write_text("[]")
    _one_line_error(_run("speak", "--script", str(tmp_path / "empty.json"), *TINY, "-o", str(tmp_path / "x.wav")),
                    "no text")


def test_offline_hub_id_names_dummy(tmp_path):
    r = _run("speak", "hi", "--model", "sesame/csm-1b", "-o", str(tmp_path / "x.npy"),
             env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert r.returncode == 2 and "--model dummy" in r.stderr


def test_bench_tiny_cpu_run_and_gpu_message():
    r = _run("bench", *TINY, "--sweep", "1", "--frames", "4", "--one-stream-frames", "6", "--probes", "1")
    assert r.returncode == 0, r.stderr
    assert "| one stream | frames/s" in r.stdout and "| streams | aggregate frames/s" in r.stdout
    assert "device: cpu" in r.stdout
    r = _run("bench", "--device", "cpu")  # full-size weights on a CPU: say what to do instead
    _one_line_error(r, "dummy-tiny")


def test_api_prompt_and_generate():
    from csmserve import CSM, SamplingParams, Segment

    assert SamplingParams().temperature == 0.9
    csm = CSM("dummy-tiny", device="cpu", dtype="float32")
    codes = np.full((4, 32), 5, dtype=np.int64)
    tokens, mask = csm.prompt("Hello.", speaker=0, context=[Segment(speaker=1, text="Hi.", codes=codes)])
    assert tokens.shape == mask.shape and tokens.shape[1] == 33 and tokens.dtype == np.int64 and mask.dtype == bool
    a = csm.generate("Hello.", context=[Segment(1, "Hi.", codes=codes)], temperature=0.9, seed=11,
                     max_audio_length_ms=320)
    b = csm.generate("Hello.", context=[Segment(1, "Hi.", codes=codes)], temperature=0.9, seed=11,
                     max_audio_length_ms=320)
    assert a.codes.shape == (4, 32) and a.audio.shape == (4 * 1920,) and a.audio.dtype == np.float32
    np.testing.assert_array_equal(a.codes, b.codes)
    greedy = csm.generate("Hello.", temperature=0, max_audio_length_ms=240)
    assert greedy.codes.shape == (3, 32)
    # context audio is Mimi-encoded into audio frames (+ the EOS frame) between the turn's text frames
    t2, m2 = csm.prompt("x", context=[Segment(0, "y", audio=np.zeros(2 * 1920, dtype=np.float32))])
    audio_rows = m2[:, :32].all(1)
    assert audio_rows.sum() == 3 and not t2[audio_rows][-1].any()  # 2 frames + the all-zero EOS frame
    with pytest.raises(ValueError, match="prompt too long"):
        csm.generate("x" * 2100, max_audio_length_ms=800)
    csm.close()


def test_prefix_ttfa_bench_tiny_cpu():
    """bench/prefix_ttfa.py on dummy-tiny: every cached probe is a prefix-cache hit, every uncached one not."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "prefix_ttfa.py"), "--model", "dummy-tiny", "--device",
                        "cpu", "--probes", "2", "--context-s", "20", "--max-seq-len", "1024"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith("| 0 |")]
    assert len(rows) == 4
    for row in rows:
        cached = row[4].strip() == "cached"
        assert row[6].strip() == ("2/2" if cached else "0/2")
        assert int(row[5]) == (15 if cached else int(row[3]) + 15)


def test_engine_slots_sized_from_memory_unless_given():
    """EngineConfig.max_slots None (the `csmserve serve` default): CSM sizes the pool when it starts the
    engine (free GPU memory; 8 on the CPU) keeping the other settings; the scheduler refuses an unsized one."""
    from csmserve import CSM
    from csmserve.config import EngineConfig
    from csmserve.engine.scheduler import Scheduler

    c = CSM("dummy-tiny", engine_config=EngineConfig(max_seq_len=256, chunk_frames=3))
    try:
        cfg = c.engine.config
        assert (cfg.max_slots, cfg.max_seq_len, cfg.chunk_frames) == (8, 256, 3)
        assert c.engine.runner.num_slots == 8 and c.engine.runner.max_seq_len == 256
    finally:
        c.close()
    with pytest.raises(ValueError, match="max_slots"):
        Scheduler(EngineConfig())


def _help_problems(parser) -> list[str]:
    """Each option of `parser` whose help line is missing, only repeats the flag's name, is a few words, shows
    "None" as its default or shows two defaults."""
    bad = []
    for action in parser._actions:
        if not action.option_strings or action.help == "==SUPPRESS==" or "-h" in action.option_strings:
            continue
        flag = action.option_strings[-1]
        text = " ".join((action.help or "").split())
        what = text.split("(default")[0].lower().replace("-", " ").replace("_", " ").strip(" .;:")
        if not what or what == flag.lstrip("-").replace("-", " ") or len(what.split()) < 3:
            bad.append(f"{flag}: {text!r} says nothing")
        if "default: None" in text or "default None" in text:
            bad.append(f"{flag}: {text!r} shows None as its default")
        if text.lower().count("default") > 1 and text.count("(default") > 1:
            bad.append(f"{flag}: {text!r} shows two defaults")
    return bad


@pytest.mark.parametrize("command", ["serve", "speak", "bench"])
def test_every_flag_says_what_it_does_and_its_default(command):
    from csmserve.apps.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    assert _help_problems(sub) == []
    assert "(default: None)" not in sub.format_help()


def test_speak_with_a_lora_adapter(tmp_path, capsys):
    """`speak --lora [NAME=]PATH` (in-process): the adapter's codes, as CSM.speak with it gives them (greedy); a
    stored voice bound to an adapter takes its --lora; `--adapter NAME --url`: the server's adapter (the request's
    `model`); each misuse one line. In this process (csmserve's main), not a subprocess: each run is a second."""
    import torch

    from csmserve import CSM
    from csmserve.apps.cli.main import main
    from csmserve.config import EngineConfig, ServerConfig
    from csmserve.models.loader import tiny_config
    from csmserve.models.lora import write_adapter
    from csmserve.server import create_app
    from csmserve.voices import VoiceStore

    ann = write_adapter(tmp_path / "ann", tiny_config(), rank=4, seed=1, std=0.3, dtype=torch.float32)
    csm = CSM("dummy-tiny", device="cpu", dtype="float32", adapters={"ann": str(ann)},
              engine_config=EngineConfig(max_slots=4, max_seq_len=512, first_chunk_frames=1, chunk_frames=2))

    def codes(adapter):
        return np.concatenate([c.codes for c in csm.speak("Hello there.", adapter=adapter, temperature=0,
                                                         max_segment_length_ms=480)])

    def speak(*args) -> int:
        return main(["speak", "Hello there.", *TINY, "--temperature", "0", "--max-audio-length-ms", "480", "-q",
                     *args])

    out = tmp_path / "a.npy"
    assert speak("--lora", str(ann), "-o", str(out)) == 0
    np.testing.assert_array_equal(np.load(out), codes("ann"))
    assert not np.array_equal(np.load(out), codes(None))
    db = tmp_path / "voices.db"
    with VoiceStore(db) as store:
        store.create("annie", "Some words.", np.full((3, 32), 7), speaker=1, adapter="ann")
    capsys.readouterr()
    assert speak("--voice", "annie", "--voices-db", str(db), "-o", str(out)) == 2
    assert "--lora ann=PATH" in capsys.readouterr().err
    assert speak("--voice", "annie", "--voices-db", str(db), "--lora", f"ann={ann}", "-o", str(out)) == 0
    for args, words in ((("--lora", str(tmp_path / "nope")), "no such adapter directory"),
                        (("--lora", str(ann), "--url", "http://127.0.0.1:9"), "--adapter NAME"),
                        (("--adapter", "ann"), "--url")):
        assert speak(*args, "-o", str(out)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    server = Server(create_app(csm, ServerConfig(voices_db=str(tmp_path / "v.db")))).start()
    try:
        wav = tmp_path / "u.wav"
        assert speak("--url", server.url, "--adapter", "ann", "-o", str(wav)) == 0
        assert _wav_seconds(wav.read_bytes()) == pytest.approx(0.48)
        assert speak("--url", server.url, "--adapter", "nope", "-o", str(wav)) == 2
        err = capsys.readouterr().err
        assert "404" in err and "'nope'" in err
    finally:
        server.stop()
        csm.close()
