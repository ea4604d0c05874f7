"""The simulated users of a client process (client.py): HTTP streaming speech requests and WebSocket
conversations, run in a scenario (`MODE[:key=value,...]` on the command line; keys not given take the flags):

    closed   C users; each sends a request and the next as soon as the last ends; users start spread
             over `ramp` s; then `warmup` s; then `duration` s measured (requests sent in the window)
    burst    C users, each one request, arriving evenly spread within `within` s (all measured)
    ws       C users on the WebSocket, each one connection and one context_id; per turn a sentence +
             flush, the next turn as soon as flush_done arrives (closed loop, windows as `closed`);
             `fresh=1`: a new context_id per turn (closed with `close`), no conversation carried

One record per request or turn, a list in RECORD order. status: "ok", "empty" (ended well, no audio), "cut"
(stopped before it ended), else what failed ("http 503 server_busy", "transport ReadTimeout", "ws server_busy");
server_error: HTTP >= 500 or a WebSocket server_error; counted: sent inside the window. Times are
time.monotonic() (one clock for every process of the machine). Each HTTP user has its own httpx.AsyncClient
with one keep-alive connection: a shared pool of thousands costs O(connections) per request in httpcore.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from csmserve.apps.bench.serve.meters import PcmMeter, make_meter
from csmserve.apps.common import bearer

MODES = ("closed", "burst", "ws")
FORMATS = ("pcm", "mp3", "opus", "wav")  # what meters.py reads
BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
RECORD = ("kind", "user", "t_send", "t_first", "t_end", "status", "server_error", "audio_s", "first_audio_s",
          "worst_lag", "counted", "detail")
SPEECH_PATH = "/v1/audio/speech"
WS_PATH = "/v1/audio/speech/stream"
BACKOFF_S = 0.25  # a user's wait after an error
READ_TIMEOUT = 120.0  # a WebSocket answer slower than this is a hang
now = time.monotonic


@dataclass(frozen=True)
class Scenario:
    mode: str = "closed"
    users: int = 64
    format: str = "pcm"  # ws: always binary pcm (s16le)
    ramp: float = 10.0
    warmup: float = 2.0
    duration: float = 20.0
    within: float = 3.0  # burst
    audio_ms: int = 10_000  # max_audio_length_ms per request / per turn's sentence
    voices: int = 0  # > 0: stored voices, user u speaks voice u % voices (prefix-cache affinity)
    adapters: int = 0  # > 0: LoRA adapters, user u's requests name adapter u % adapters in `model`
    fresh: bool = False  # ws: a new context_id per turn
    label: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"scenario mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.users < 1:
            raise ValueError(f"users must be >= 1, got {self.users}")
        if min(self.ramp, self.warmup) < 0 or self.duration <= 0 or self.within < 0:
            raise ValueError("ramp and warmup must be >= 0, duration > 0, within >= 0")
        if self.audio_ms < 80:
            raise ValueError(f"audio_ms must be >= 80 (one frame), got {self.audio_ms}")
        if self.voices < 0 or self.adapters < 0:
            raise ValueError(f"voices and adapters must be >= 0, got {self.voices}, {self.adapters}")

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        what = "ws" + (" fresh" if self.fresh else "") if self.mode == "ws" else self.format
        extra = f" in {self.within:g}s" if self.mode == "burst" else ""
        voices = f" {self.voices}v" if self.voices else ""
        adapters = f" {self.adapters}a" if self.adapters else ""
        return f"{self.mode} {self.users} {what}{extra}{voices}{adapters}"

    def window(self, t_start: float) -> tuple[float, float]:
        """The measured window [t0, t1): requests sent in it are counted."""
        if self.mode == "burst":
            return t_start, t_start + max(self.within, 1e-3)
        t0 = t_start + self.ramp + self.warmup
        return t0, t0 + self.duration

    def start_offset(self, user: int) -> float:
        """When user `user` starts (closed/ws) or arrives (burst), after the scenario's start."""
        span = self.within if self.mode == "burst" else self.ramp
        return span * user / self.users


def parse_scenario(spec: str, defaults: Scenario) -> Scenario:
    mode, _, rest = spec.partition(":")
    kw: dict = {"mode": mode.strip() or defaults.mode}
    types = {f.name: f.type for f in dataclasses.fields(Scenario) if f.name != "mode"}
    parse = {"int": int, "float": float, "str": str, "bool": lambda v: BOOLS[v.lower()]}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not eq or key not in types:
            raise ValueError(f"scenario {spec!r}: expected key=value with key one of {', '.join(types)}, got {item!r}")
        try:
            kw[key] = parse[types[key]](value)
        except (ValueError, KeyError):
            raise ValueError(f"scenario {spec!r}: {value!r} is not a valid {types[key]}") from None
    return dataclasses.replace(defaults, **kw)


class Playback:
    """One stream as a listener hears it. Playback with a buffer of B seconds starts at the first audio + B and
    consumes real time; it runs dry when the audio received so far is less than what playback has reached. The
    audio received only rises at arrivals, so the worst moments are just before each: `worst_lag` = max over
    arrivals i of (t_i - first) - audio before i, and a buffer B runs dry iff worst_lag > B."""

    __slots__ = ("t_first", "audio", "first_audio", "worst_lag")

    def __init__(self) -> None:
        self.t_first: float | None = None  # the first audio's arrival
        self.audio = 0.0  # seconds received
        self.first_audio = 0.0  # seconds in the first arrival
        self.worst_lag = 0.0

    def arrive(self, t: float, audio: float) -> None:
        """At time t (seconds, monotonic) the stream holds `audio` seconds in all."""
        if audio <= self.audio:
            return
        if self.t_first is None:
            self.t_first, self.first_audio = t, audio
        else:
            self.worst_lag = max(self.worst_lag, (t - self.t_first) - self.audio)
        self.audio = audio


def ran_dry(worst_lag: float, buffer_s: float) -> bool:
    return worst_lag > buffer_s


class Run:
    """What every user of one process shares for one scenario (sc; None: the soak's, all counted)."""

    def __init__(self, url: str, texts: list[str], voices: list[str], api_key: str | None = None,
                 sc: Scenario | None = None, t_start: float = 0.0,
                 on_drained: Callable[[], None] | None = None, num_users: int = 0,
                 adapters: list[str] = ()) -> None:
        self.sc, self.url, self.t_start = sc, url.rstrip("/"), t_start
        self.t0, self.t1 = sc.window(t_start) if sc is not None else (t_start, float("inf"))
        self.texts, self.voices, self.api_key, self.adapters = texts, voices, api_key, list(adapters)
        self.records: list[list] = []
        self.in_window = 0  # counted requests not yet ended
        self.users_left = num_users  # burst: users whose one request has not ended
        self.stopping = self.drained = False
        self.on_drained = on_drained
        self.ssl = ssl.create_default_context()  # shared by every client: one per client costs ms each

    def take(self) -> list[list]:
        out, self.records = self.records, []
        return out

    def text(self, user: int, k: int) -> str:
        return self.texts[(user + k) % len(self.texts)]

    def voice(self, user: int) -> str:
        return self.voices[user % len(self.voices)] if self.voices else "alloy"

    def model(self, user: int) -> str:
        """The request's `model`: the user's adapter, else the base."""
        return self.adapters[user % len(self.adapters)] if self.adapters else "tts-1"

    def begin(self, t_send: float) -> bool:
        counted = self.sc is None or self.sc.mode == "burst" or self.t0 <= t_send < self.t1
        self.in_window += counted
        return counted

    def record(self, kind: str, user: int, t_send: float, status: str, play: Playback | None = None,
               server_error: bool = False, counted: bool = False, detail: str = "",
               t_first: float | None = None) -> None:
        p = play or Playback()
        self.records.append([kind, user, t_send, p.t_first if play else t_first, now(), status, server_error,
                             round(p.audio, 3), p.first_audio, p.worst_lag, counted, detail])
        self.in_window -= counted
        self.check_drained()

    def check_drained(self) -> None:
        """Tell the parent once every counted request of this process has ended."""
        if self.drained or self.on_drained is None:
            return
        if self.users_left <= 0 if self.sc.mode == "burst" else (now() >= self.t1 and self.in_window == 0):
            self.drained = True
            self.on_drained()


async def sleep_until(t: float) -> None:
    if (delay := t - now()) > 0:
        await asyncio.sleep(delay)


# ---------------------------------------------------------------- HTTP
def http_client(run: Run):
    import httpx

    transport = httpx.AsyncHTTPTransport(verify=run.ssl, limits=httpx.Limits(max_connections=1,
                                                                             max_keepalive_connections=1))
    timeout = httpx.Timeout(connect=30.0, read=120.0, write=30.0, pool=30.0)
    return httpx.AsyncClient(base_url=run.url, transport=transport, timeout=timeout, headers=bearer(run.api_key))


def error_code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def speech(run: Run, client, user: int, body: dict, kind: str = "speech", detail: str = "") -> str:
    """One POST /v1/audio/speech, its body read as it arrives -> the record's status."""
    import httpx

    meter, play, status, server_error = make_meter(body["response_format"]), Playback(), "cut", False
    t_send = now()
    counted = run.begin(t_send)
    try:
        async with client.stream("POST", SPEECH_PATH, json=body) as r:
            if r.status_code != 200:
                status, server_error = f"http {r.status_code} {error_code(await r.aread())}", r.status_code >= 500
                return status
            async for data in r.aiter_raw():
                play.arrive(now(), meter.feed(data))
        status = "ok" if play.t_first is not None else "empty"  # a 200 with no audio in it
    except httpx.HTTPError as e:
        status = f"transport {type(e).__name__}" + (" after audio" if play.t_first is not None else "")
    finally:
        run.record(kind, user, t_send, status, play, server_error, counted, detail)
    return status


async def http_user(run: Run, user: int) -> None:
    """closed: request after request until stopped; burst: one request."""
    sc = run.sc
    await sleep_until(run.t_start + sc.start_offset(user))
    try:
        async with http_client(run) as client:
            k = 0
            while not run.stopping:
                body = {"model": run.model(user), "voice": run.voice(user), "input": run.text(user, k),
                        "response_format": sc.format, "max_audio_length_ms": sc.audio_ms}
                status = await speech(run, client, user, body)
                k += 1
                if sc.mode == "burst":
                    break
                if status != "ok":
                    await asyncio.sleep(BACKOFF_S)
    finally:
        if sc.mode == "burst":
            run.users_left -= 1
            run.check_drained()


# ---------------------------------------------------------------- WebSocket
def ws_connect(run: Run):
    from websockets.asyncio.client import connect

    url = run.url.replace("https://", "wss://", 1).replace("http://", "ws://", 1) + WS_PATH + "?binary=1"
    return connect(url, additional_headers=bearer(run.api_key), max_size=None, ping_interval=None, open_timeout=60,
                   close_timeout=5, compression=None)


def ws_error(event: dict) -> tuple[str, bool]:
    err = event.get("error") or {}
    return f"ws {err.get('code', '?')}", err.get("type") == "server_error"


async def ws_turn(run: Run, ws, user: int, cid: str, pieces: list[str], settings: dict, kind: str = "ws-turn",
                  detail: str = "") -> str:
    """One turn: the text in pieces (the settings with the first, flush with the last), then binary PCM until
    its flush_done. TTFA of a turn: from its flush."""
    from websockets.exceptions import ConnectionClosed

    meter, play, status, server_error = PcmMeter(), Playback(), "cut", False
    t_send = now()
    counted = run.begin(t_send)
    try:
        for i, piece in enumerate(pieces):
            await ws.send(json.dumps({"context_id": cid, "text": piece, **(settings if i == 0 else {}),
                                      **({"flush": True} if i == len(pieces) - 1 else {})}))
        t_send = now()
        while True:
            m = await asyncio.wait_for(ws.recv(), READ_TIMEOUT)
            if not isinstance(m, str):
                play.arrive(now(), meter.feed(m))
                continue
            event = json.loads(m)
            if event.get("type") == "flush_done" and event.get("context_id") == cid:
                status = "ok" if play.t_first is not None else "empty"
                break
            if event.get("type") == "error" and event.get("context_id") in (cid, None):
                status, server_error = ws_error(event)
                break
    except TimeoutError:
        status = "ws timeout" + (" after audio" if play.t_first is not None else "")
    except ConnectionClosed as e:
        status = f"transport {type(e).__name__}" + (" after audio" if play.t_first is not None else "")
        raise
    finally:
        run.record(kind, user, t_send, status, play, server_error, counted, detail)
    return status


async def close_quietly(ws) -> None:
    try:
        await asyncio.wait_for(ws.close(), 5)
    except Exception:  # noqa: BLE001 - the connection is being dropped either way
        pass


async def ws_user(run: Run, user: int) -> None:
    """One connection (reconnecting after a failure) and one context_id (or one per turn), turn after turn."""
    from websockets.exceptions import WebSocketException

    failures, sc = (OSError, WebSocketException, asyncio.TimeoutError), run.sc
    await sleep_until(run.t_start + sc.start_offset(user))
    k, conversation = 0, f"bench-{int(run.t_start * 1000) % 10**9}-{user}"
    while not run.stopping:
        t = now()
        try:
            ws = await ws_connect(run)
        except failures as e:  # a record of its own: a turn that could not be sent
            run.record("ws-connect", user, t, f"transport connect {type(e).__name__}", counted=run.begin(t))
            await asyncio.sleep(BACKOFF_S)
            continue
        try:
            while not run.stopping:
                settings = {"voice": run.voice(user), "model": run.model(user), "max_audio_length_ms": sc.audio_ms,
                            **({"close": True} if sc.fresh else {})}
                cid = f"{conversation}-{k}" if sc.fresh else conversation
                status = await ws_turn(run, ws, user, cid, [run.text(user, k)], settings)
                k += 1
                if status != "ok":
                    await asyncio.sleep(BACKOFF_S)
        except failures:  # ws_turn recorded it
            await asyncio.sleep(BACKOFF_S)
        finally:
            await close_quietly(ws)


def send(payload: dict) -> None:
    """A message to the parent (bench.py, soak.py): a JSON line on stdout."""
    sys.stdout.write(json.dumps(payload, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def run_users(run: Run, commands: asyncio.Queue, tasks: list[asyncio.Task], tick_s: float,
                    on_tick: Callable[[], None]) -> tuple[dict, list[float]]:
    """The users until the parent sends "stop" (or is gone), then cancelled; beside them a ticker calls on_tick every tick_s
    -> (the result message: its records, CPU and wall seconds, the users' first errors (a cancellation is not
    one); the ticker's lags in the window, ms: how late it woke, which bounds how late an arrival is stamped)."""
    cpu0, wall0, lags = time.process_time(), now(), []

    async def ticker() -> None:
        while True:
            t = now()
            await asyncio.sleep(tick_s)
            if run.t0 <= t < run.t1:
                lags.append((now() - t - tick_s) * 1e3)
            on_tick()

    tick = asyncio.create_task(ticker())
    while (cmd := (await commands.get()).get("cmd")) not in ("stop", "exit"):  # exit: the parent is gone
        pass
    if cmd == "exit":
        commands.put_nowait({"cmd": "exit"})  # for the client's loop: it ends after this result
    run.stopping = True
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    tick.cancel()
    errors = [f"{type(r).__name__}: {r}" for r in results
              if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)][:5]
    return {"event": "result", "records": run.take(), "cpu_s": time.process_time() - cpu0, "wall_s": now() - wall0,
            "user_errors": errors}, lags
