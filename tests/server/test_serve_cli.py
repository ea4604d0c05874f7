"""`csmserve serve` flags and CSMSERVE_* environment variables; the command starting a real server."""
import argparse
import os
import subprocess
import sys
import time

import httpx
import pytest

from csmserve.config import EngineConfig, ServerConfig
from csmserve.server.flags import add_serve_parser, configs
from server_helpers import free_port


def parse(argv):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults_flags_and_env(monkeypatch):
    server, engine = configs(parse([]))
    assert server == ServerConfig() and engine == EngineConfig()
    monkeypatch.setenv("CSMSERVE_API_KEY", "from-env")
    monkeypatch.setenv("CSMSERVE_MAX_SLOTS", "8")
    monkeypatch.setenv("CSMSERVE_MAX_CLIP_SECONDS", "12.5")
    monkeypatch.setenv("CSMSERVE_CORS_ORIGINS", "http://a, http://b")
    monkeypatch.setenv("CSMSERVE_MODEL", "dummy-tiny")
    args = parse(["--port", "9001", "--max-slots", "16"])  # a flag beats the environment
    server, engine = configs(args)
    assert args.model == "dummy-tiny" and server.model_name == "dummy-tiny"
    assert server.api_key == "from-env" and server.port == 9001 and server.max_clip_seconds == 12.5
    assert server.cors_origins == ("http://a", "http://b") and engine.max_slots == 16
    assert engine.first_frame_from_prefill is True
    assert configs(parse(["--first-frame-from-prefill", "false"]))[1].first_frame_from_prefill is False
    monkeypatch.setenv("CSMSERVE_FIRST_FRAME_FROM_PREFILL", "0")
    assert configs(parse([]))[1].first_frame_from_prefill is False


def test_the_lora_pool_s_default_slots():
    """No --max-loras: a slot per --lora, 8 more with --lora-dir (its load route then has room), else none."""
    assert configs(parse([]))[1].max_loras == 0
    assert configs(parse(["--lora", "a=/x", "--lora", "b=/y"]))[1].max_loras == 2
    assert configs(parse(["--lora-dir", "/tmp"]))[1].max_loras == 8
    assert configs(parse(["--lora", "a=/x", "--lora-dir", "/tmp"]))[1].max_loras == 9
    assert configs(parse(["--lora-dir", "/tmp", "--max-loras", "3"]))[1].max_loras == 3


def test_serve_subprocess(tmp_path):
    port = free_port()
    env = {**os.environ, "CSMSERVE_VOICES_DB": str(tmp_path / "v.db"), "CSMSERVE_MAX_SLOTS": "4",
           "CSMSERVE_MAX_SEQ_LEN": "256"}
    code = ("import sys, argparse; from csmserve.server.flags import add_serve_parser;"
            "from csmserve.apps.cli.serve import run_serve; p = argparse.ArgumentParser();"
            "add_serve_parser(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(run_serve(a))")
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", "dummy-tiny", "--device", "cpu",
                             "--port", str(port), "--api-key", "k", "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("server did not become ready")
        r = httpx.post(f"{url}/v1/audio/speech", headers={"Authorization": "Bearer k"}, timeout=60, json={
            "model": "tts-1", "voice": "alloy", "input": "From the command line.", "response_format": "wav",
            "max_audio_length_ms": 160})
        assert r.status_code == 200 and r.content[:4] == b"RIFF" and len(r.content) == 44 + 2 * 1920 * 2
    finally:
        proc.terminate()
        proc.wait(30)


def test_weights_flag(monkeypatch):
    assert configs(parse([]))[1].weights == "bf16"
    assert configs(parse(["--weights", "fp8"]))[1].weights == "fp8"
    monkeypatch.setenv("CSMSERVE_WEIGHTS", "fp8-all")
    assert configs(parse([]))[1].weights == "fp8-all"
    with pytest.raises(ValueError, match="weights must be one of"):
        configs(parse(["--weights", "int4"]))


def test_codec_stream_flag(monkeypatch, capsys):
    assert configs(parse([]))[1].codec_stream is True
    assert configs(parse(["--codec-stream", "false"]))[1].codec_stream is False
    monkeypatch.setenv("CSMSERVE_CODEC_STREAM", "0")
    assert configs(parse([]))[1].codec_stream is False
    with pytest.raises(SystemExit):
        parse(["--codec-stream", "sometimes"])
    assert "codec-stream" in capsys.readouterr().err


def test_help_names_every_flag_and_what_an_unset_default_means(capsys, monkeypatch):
    """`serve --help`: every config field's flag has a help line of its own (server/flags.py's _HELP) and, where
    the field's default is None, what that means (_UNSET); one default each; booleans list what they take."""
    import dataclasses

    from csmserve.config import RayConfig
    from csmserve.server import flags

    for cls in (ServerConfig, EngineConfig, RayConfig):
        for f in dataclasses.fields(cls):
            assert f.name in flags._HELP, f"--{f.name} has no help line in server/flags.py's _HELP"
            if f.default is None or f.name == "model_name":
                assert f.name in flags._UNSET, f"--{f.name}'s None default needs its meaning in _UNSET"
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "(default: None)" not in text and "(default: --model)" in text and "every core but three" in text
    assert len(out.splitlines()) < 270  # it was 318 lines (two lines a flag, three with a wrapped help)


@pytest.mark.parametrize("value, want", [("true", True), ("1", True), ("yes", True), ("ON", True), (None, True),
                                         ("false", False), ("0", False), ("no", False), ("off", False)])
def test_booleans_take_the_usual_spellings(value, want):
    argv = ["--native-codecs"] + ([] if value is None else [value])  # the flag alone: true
    assert configs(parse(argv))[0].native_codecs is want


def test_a_bad_boolean_names_what_it_takes(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        parse(["--native-codecs", "maybe"])
    err = capsys.readouterr().err
    assert "--native-codecs" in err and "true/false, 1/0, yes/no" in err
    monkeypatch.setenv("CSMSERVE_CODEC_STREAM", "perhaps")
    with pytest.raises(SystemExit, match="CSMSERVE_CODEC_STREAM='perhaps' .* true/false, 1/0, yes/no"):
        parse([])


def test_lora_flags(tmp_path, monkeypatch):
    """--lora NAME=PATH (any number; PATH alone: named after its directory; CSMSERVE_LORA comma-separated): the
    engine gets a pool slot per adapter unless --max-loras says; a bad name, a name given twice, the base's name, a
    missing directory or one whose config the pool cannot take (DoRA, a rank over --max-lora-rank) is one line
    before anything starts (ValueError)."""
    from csmserve.server.flags import lora_adapters
    from csmserve.server.processes import ServeSpec

    import json

    import torch

    from csmserve.models.loader import tiny_config
    from csmserve.models.lora import write_adapter

    a, b, big, dora = (write_adapter(tmp_path / n, tiny_config(), rank=r, dtype=torch.float32)
                       for n, r in (("ann", 4), ("bob", 4), ("big", 64), ("dora", 4)))
    (dora / "adapter_config.json").write_text(json.dumps({**json.loads((dora / "adapter_config.json").read_text()),
                                                          "use_dora": True}))
    args = parse(["--lora", f"ann={a}", "--lora", str(b)])
    assert lora_adapters(args) == {"ann": str(a), "bob": str(b)}
    server, engine = configs(args)
    assert engine.max_loras == 2 and server.lora_dir is None
    assert configs(parse(["--lora", f"ann={a}", "--max-loras", "8"]))[1].max_loras == 8
    assert configs(parse([]))[1].max_loras == 0  # no --lora: no pool
    spec = ServeSpec.from_args(args, server, engine)
    assert spec.adapters == (("ann", str(a)), ("bob", str(b)))
    assert lora_adapters(parse(["--lora", f"ann={a},{b}"])) == {"ann": str(a), "bob": str(b)}  # comma-separated
    monkeypatch.setenv("CSMSERVE_LORA", f"ann={a},{b}")
    assert lora_adapters(parse([])) == {"ann": str(a), "bob": str(b)} and configs(parse([]))[1].max_loras == 2
    assert lora_adapters(parse(["--lora", f"cat={a}"])) == {"cat": str(a)}  # a flag given wins
    monkeypatch.delenv("CSMSERVE_LORA")
    for argv, words in ((["--lora", f"tts-1={a}"], "base model"), (["--lora", f"a b={a}"], "letters"),
                        (["--lora", f"ann={a}", "--lora", f"ann={b}"], "twice"),
                        (["--lora", f"ann={tmp_path / 'nope'}"], "no such adapter directory"),
                        (["--lora", f"ann={tmp_path}"], "not a PEFT adapter directory"),
                        (["--lora", f"big={big}"], "rank 64 is over the pool's max_lora_rank 32"),
                        (["--lora", f"dora={dora}"], "DoRA"),
                        (["--model-name", "mine", "--lora", f"mine={a}"], "base model")):
        with pytest.raises(ValueError, match=words):
            lora_adapters(parse(argv))
    with pytest.raises(SystemExit):
        parse(["--lora", "ann="])


def test_the_engine_stall_bound_leaves_room_for_heartbeats():
    """--engine-stall-s under a second (4 heartbeats) would turn an idle engine's /health 503 between beats."""
    assert configs(parse(["--engine-stall-s", "1"]))[0].engine_stall_s == 1
    with pytest.raises(ValueError, match="engine_stall_s must be >= 1"):
        configs(parse(["--engine-stall-s", "0.2"]))
