"""The simulated users of one client process: HTTP streaming speech requests and WebSocket conversations.

Every request (or WebSocket turn) becomes one record, a list in RECORD order:
  user, t_send, t_first (first audio; None if none), t_end, audio_s, first_audio_s, worst_lag (playback.py),
  status ("ok", "http 503 server_busy", "transport ReadTimeout", "ws server_busy", "empty": ended well with
  no audio, "cut": stopped by the benchmark before it ended), counted (sent inside the measured window), nbytes.
Times are time.monotonic() (one clock for every process of the machine).

Each HTTP user has its own httpx.AsyncClient holding one keep-alive connection: one shared pool of
thousands of connections costs O(connections) per request in httpcore, which a loop of many users
cannot afford.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable

from csmserve.apps.bench.serve.meters import PcmMeter, make_meter
from csmserve.apps.bench.serve.playback import Playback
from csmserve.apps.bench.serve.scenario import Scenario

RECORD = ("user", "t_send", "t_first", "t_end", "audio_s", "first_audio_s", "worst_lag", "status", "counted",
          "nbytes")
SPEECH_PATH = "/v1/audio/speech"
WS_PATH = "/v1/audio/speech/stream"
now = time.monotonic


class Run:
    """What every user of one process shares for one scenario."""

    def __init__(self, sc: Scenario, url: str, t_start: float, texts: list[str], voices: list[str],
                 api_key: str | None = None, backoff: float = 0.25, ws_compression: bool = False,
                 on_drained: Callable[[], None] | None = None, num_users: int = 0) -> None:
        self.sc, self.url, self.t_start = sc, url.rstrip("/"), t_start
        self.t0, self.t1 = sc.window(t_start)
        self.texts, self.voices, self.api_key = texts, voices, api_key
        self.backoff, self.ws_compression = backoff, ws_compression
        self.records: list[list] = []
        self.in_window = 0  # counted requests not yet ended
        self.users_left = num_users  # burst: users whose one request has not ended
        self.stopping = False
        self.drained = False
        self.on_drained = on_drained
        self.ssl = ssl.create_default_context()  # shared by every client: one per client costs ms each

    def text(self, user: int, k: int) -> str:
        return self.texts[(user + k) % len(self.texts)]

    def voice(self, user: int) -> str:
        return self.voices[user % len(self.voices)] if self.voices else "alloy"

    def begin(self, t_send: float) -> bool:
        counted = self.sc.mode == "burst" or self.t0 <= t_send < self.t1
        self.in_window += counted
        return counted

    def end(self, rec: list) -> None:
        self.records.append(rec)
        self.in_window -= rec[8]
        self.check_drained()

    def check_drained(self) -> None:
        """Tell the parent once every counted request of this process has ended."""
        if self.drained or self.on_drained is None:
            return
        done = self.users_left <= 0 if self.sc.mode == "burst" else (now() >= self.t1 and self.in_window == 0)
        if done:
            self.drained = True
            self.on_drained()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _record(user: int, t_send: float, play: Playback, status: str, counted: bool, nbytes: int) -> list:
    return [user, t_send, play.t_first, now(), play.audio, play.first_audio, play.worst_lag, status, counted,
            nbytes]


async def _sleep_until(t: float) -> None:
    delay = t - now()
    if delay > 0:
        await asyncio.sleep(delay)


# ---------------------------------------------------------------- HTTP
def _client(run: Run):
    import httpx

    transport = httpx.AsyncHTTPTransport(verify=run.ssl, limits=httpx.Limits(max_connections=1,
                                                                             max_keepalive_connections=1))
    timeout = httpx.Timeout(connect=30.0, read=120.0, write=30.0, pool=30.0)
    return httpx.AsyncClient(base_url=run.url, transport=transport, timeout=timeout, headers=run.headers())


def _error_code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def http_request(run: Run, client, user: int, k: int) -> str:
    """One POST /v1/audio/speech, its body read as it arrives -> the record's status."""
    import httpx

    sc = run.sc
    body = {"model": "tts-1", "voice": run.voice(user), "input": run.text(user, k),
            "response_format": sc.format, "max_audio_length_ms": sc.audio_ms}
    meter, play, nbytes = make_meter(sc.format), Playback(), 0
    status = "cut"
    t_send = now()
    counted = run.begin(t_send)
    try:
        async with client.stream("POST", SPEECH_PATH, json=body) as r:
            if r.status_code != 200:
                status = f"http {r.status_code} {_error_code(await r.aread())}"
                return status
            async for data in r.aiter_raw():
                nbytes += len(data)
                play.arrive(now(), meter.feed(data))
            play.arrive(now(), meter.finish())
        status = "ok" if play.t_first is not None else "empty"  # a 200 with no audio in it
    except httpx.HTTPError as e:
        status = f"transport {type(e).__name__}" + (" after audio" if play.t_first is not None else "")
    finally:
        run.end(_record(user, t_send, play, status, counted, nbytes))
    return status


async def http_user(run: Run, user: int) -> None:
    """closed: request after request until stopped; burst: one request."""
    await _sleep_until(run.t_start + run.sc.start_offset(user))
    try:
        async with _client(run) as client:
            k = 0
            while not run.stopping:
                status = await http_request(run, client, user, k)
                k += 1
                if run.sc.mode == "burst":
                    break
                if status != "ok":
                    await asyncio.sleep(run.backoff)
    finally:
        if run.sc.mode == "burst":
            run.users_left -= 1
            run.check_drained()


# ---------------------------------------------------------------- WebSocket
def _ws_connect(run: Run):
    try:
        from websockets.asyncio.client import connect
    except ImportError:  # websockets < 13
        from websockets import connect
    url = run.url.replace("https://", "wss://", 1).replace("http://", "ws://", 1) + WS_PATH + "?binary=1"
    kw = dict(max_size=None, ping_interval=None, open_timeout=60, close_timeout=5,
              compression="deflate" if run.ws_compression else None)
    if run.api_key:
        try:
            return connect(url, additional_headers=run.headers(), **kw)
        except TypeError:  # the legacy client names it extra_headers
            return connect(url, extra_headers=run.headers(), **kw)
    return connect(url, **kw)


async def ws_turn(run: Run, ws, user: int, k: int, context_id: str) -> str:
    """One turn: the sentence + flush (+ close with a fresh context), binary PCM until flush_done."""
    from websockets.exceptions import ConnectionClosed

    sc = run.sc
    msg = {"context_id": context_id, "text": run.text(user, k), "flush": True, "voice": run.voice(user),
           "max_audio_length_ms": sc.audio_ms}
    if sc.fresh:
        msg["close"] = True
    meter, play = PcmMeter(), Playback()
    status = "cut"
    t_send = now()
    counted = run.begin(t_send)
    try:
        await ws.send(json.dumps(msg))
        while True:
            m = await ws.recv()
            if not isinstance(m, str):
                play.arrive(now(), meter.feed(m))
                continue
            event = json.loads(m)
            kind = event.get("type")
            if kind == "flush_done" and event.get("context_id") == context_id:
                status = "ok" if play.t_first is not None else "empty"
                break
            if kind == "error" and event.get("context_id") in (context_id, None):
                status = f"ws {event.get('error', {}).get('code', '?')}"
                break
    except ConnectionClosed as e:
        status = f"transport {type(e).__name__}" + (" after audio" if play.t_first is not None else "")
        raise
    finally:
        run.end(_record(user, t_send, play, status, counted, meter.nbytes))
    return status


async def ws_user(run: Run, user: int) -> None:
    """One connection (reconnecting after a failure) and one context_id (or one per turn), turn after turn."""
    from websockets.exceptions import WebSocketException

    failures = (OSError, WebSocketException, asyncio.TimeoutError)
    await _sleep_until(run.t_start + run.sc.start_offset(user))
    k, conversation = 0, f"bench-{int(run.t_start * 1000) % 10**9}-{user}"
    while not run.stopping:
        t = now()
        try:
            ws = await _ws_connect(run)
        except failures as e:  # a record of its own: a turn that could not be sent
            run.end([user, t, None, now(), 0.0, 0.0, 0.0, f"transport connect {type(e).__name__}", run.begin(t), 0])
            await asyncio.sleep(run.backoff)
            continue
        try:
            while not run.stopping:
                cid = f"{conversation}-{k}" if run.sc.fresh else conversation
                status = await ws_turn(run, ws, user, k, cid)
                k += 1
                if status != "ok":
                    await asyncio.sleep(run.backoff)
        except failures:  # ws_turn recorded it
            await asyncio.sleep(run.backoff)
        finally:
            await _close_quietly(ws)


async def _close_quietly(ws) -> None:
    try:
        await asyncio.wait_for(ws.close(), 5)
    except Exception:  # noqa: BLE001 - the connection is being dropped either way
        pass


def user_coroutine(run: Run, user: int):
    return ws_user(run, user) if run.sc.mode == "ws" else http_user(run, user)


async def run_until_stop(run, commands: asyncio.Queue, tasks: list, *helpers: asyncio.Task) -> list[str]:
    """Let the users run until the parent sends "stop"; cancel them (then the helper tasks) -> the first
    errors the users raised (a cancellation is not one)."""
    while (await commands.get()).get("cmd") != "stop":
        pass
    run.stopping = True
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for h in helpers:
        h.cancel()
    return [f"{type(r).__name__}: {r}" for r in results
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
