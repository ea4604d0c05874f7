"""The soak's users in one client process (client.py runs them for a `{"cmd": "soak", ...}`):

    http    request after request: speech in a rotation of formats and voices (stored or alias),
            `disconnect` of them cut mid-stream (or while queued) by FIN or RST (SO_LINGER 0),
            `hostile` of them a case of hostile.py, answered as the case says
    ws      WebSocket conversations: one context_id each, several turns (text streamed in pieces,
            then flush: every turn's prompt holds the earlier ones), then `close`; between turns, now
            and then a hostile message (the next turn goes on on the same connection) or a turn cut
            (close frame, FIN or RST) after which the conversation goes on on a new connection
    voice   voices created (POST /v1/audio/voices), used, deleted (DELETE), then checked gone (404),
            keeping KEEP_VOICES alive; its ledger says which ids were acknowledged created and deleted

One record per request, turn or voice operation (users.RECORD); status "ok" (as it must be), "cut" (ended by
the soak's stop), else what went wrong ("http 503 server_busy", "hostile <case>: ...", "transport
ReadTimeout after audio", "ws internal_error").
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
from collections import deque
from urllib.parse import urlsplit

from csmserve.apps.bench.serve.hostile import CID, GOOD, HTTP_CASES, WS_CASES, Case, error_shape
from csmserve.apps.bench.serve.server import VOICE_TRANSCRIPT, voice_wav
from csmserve.apps.bench.serve.users import (BACKOFF_S, READ_TIMEOUT, SPEECH_PATH, Run, close_quietly, error_code,
                                             http_client, now, run_users, send, sleep_until, speech, ws_connect,
                                             ws_error, ws_turn)

VOICES_PATH = "/v1/audio/voices"
ALIASES = ("alloy", "echo", "nova", "onyx")
KEEP_VOICES = 2  # voices each voice user keeps alive
FLUSH_S = 2.0  # records go up to the parent this often


class SoakRun(Run):
    """What the users of one process share: settings from the parent, the records not yet sent, the
    voice ledger."""

    def __init__(self, cmd: dict) -> None:
        super().__init__(cmd["url"], cmd["texts"], cmd["voices"], cmd.get("api_key"), t_start=cmd["t_start"])
        parts = urlsplit(self.url)
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.https else 80)
        self.ramp, self.num_users, self.formats = cmd["ramp"], max(1, cmd["num_users"]), cmd["formats"]
        self.audio_ms, self.turns = tuple(cmd["audio_ms"]), tuple(cmd["turns"])  # (lo, hi) each
        self.disconnect, self.hostile = cmd["disconnect"], cmd["hostile"]
        self.seed, self.run_id = cmd["seed"], cmd["run_id"]
        self.created: dict[str, int] = {}  # acknowledged, not deleted: id -> num_frames
        self.deleted: list[str] = []  # acknowledged deleted
        self.uncertain: list[str] = []  # ids (or names) whose create/delete was cut before its answer

    def rng(self, user: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + user)

    def ms(self, rng: random.Random, long: bool = False) -> int:
        lo, hi = self.audio_ms
        return max(80, (hi if long else rng.randint(lo, hi)) // 80 * 80)

    def voice_for(self, rng: random.Random) -> str:
        return rng.choice(self.voices) if self.voices and rng.random() < 0.5 else rng.choice(ALIASES)

    def body(self, rng: random.Random, voice: str | None = None, long: bool = False) -> dict:
        return {"model": "tts-1", "voice": voice or self.voice_for(rng), "input": rng.choice(self.texts),
                "response_format": rng.choice(self.formats), "max_audio_length_ms": self.ms(rng, long)}

    async def start(self, user: int) -> None:
        await sleep_until(self.t_start + self.ramp * user / self.num_users)


async def soak_speech(run: SoakRun, client, user: int, rng: random.Random, voice: str | None = None,
                      kind: str | None = None) -> str:
    body = run.body(rng, voice)
    return await speech(run, client, user, body, kind or f"speech-{body['response_format']}",
                        body["voice"] if body["voice"].startswith("voice_") else "")


# ---------------------------------------------------------------- HTTP
def _request_bytes(run: SoakRun, method: str, path: str, body: bytes, ctype: str = "application/json") -> bytes:
    auth = f"Authorization: Bearer {run.api_key}\r\n" if run.api_key else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: {run.host}:{run.port}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{auth}\r\n").encode() + body


def _reset(transport: asyncio.BaseTransport) -> None:
    """Leave with an RST: SO_LINGER 0, then close (the kernel sends RST)."""
    if (sock := transport.get_extra_info("socket")) is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


async def _open(run: SoakRun):
    return await asyncio.wait_for(asyncio.open_connection(run.host, run.port, ssl=run.ssl if run.https else None), 30)


async def disconnect(run: SoakRun, user: int, rng: random.Random) -> None:
    """A speech request (raw HTTP/1.1) left mid-stream, or while queued (a quarter of them), by FIN or RST."""
    how = "rst" if rng.random() < 0.5 else "fin"
    early = rng.random() < 0.25
    body = run.body(rng, long=True)
    t_send, t_first, status, server_error, nbytes, writer = now(), None, "cut", False, 0, None
    try:
        reader, writer = await _open(run)
        writer.write(_request_bytes(run, "POST", SPEECH_PATH, json.dumps(body).encode()))
        await writer.drain()
        if early:
            await asyncio.sleep(rng.uniform(0, 0.05))
        else:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            code = int(head.split(None, 2)[1])
            if code != 200:
                rest = await asyncio.wait_for(reader.read(1 << 16), 30)
                status, server_error = f"http {code} {error_code(rest)}", code >= 500
                return
            first = await asyncio.wait_for(reader.read(1 << 16), READ_TIMEOUT)
            t_first, nbytes = now(), len(first)
            until = now() + rng.uniform(0, 1.0)  # cut at a random moment of the stream
            while (left := until - now()) > 0:
                try:
                    data = await asyncio.wait_for(reader.read(1 << 16), left)
                except TimeoutError:
                    break
                if not data:
                    break
                nbytes += len(data)
        _reset(writer.transport) if how == "rst" else writer.close()
        writer, status = None, "ok"
    except (TimeoutError, OSError, EOFError, ValueError, IndexError) as e:
        status = f"transport {type(e).__name__}"
    finally:
        if writer is not None:
            writer.transport.abort()
        run.record(f"disconnect-{how}", user, t_send, status, server_error=server_error,
                   detail="queued" if early else f"{nbytes} B", t_first=t_first)


async def _raw_exchange(run: SoakRun, data: bytes) -> tuple[int, bytes]:
    """Bytes on a fresh connection -> (status, body) of the answer (read until the server closes)."""
    reader, writer = await _open(run)
    try:
        writer.write(data)
        await writer.drain()
        answer = b""
        while len(answer) < 1 << 20:
            chunk = await asyncio.wait_for(reader.read(1 << 16), READ_TIMEOUT)
            if not chunk:
                break
            answer += chunk
    finally:
        writer.transport.abort()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(None, 2)[1]), body


async def hostile_http(run: SoakRun, client, user: int, case: Case) -> None:
    """One hostile request: its status must be the case's, an error in OpenAI's shape with its code."""
    import httpx

    t_send, status, server_error = now(), "cut", False
    try:
        if case.kind == "socket":
            code, content = await _raw_exchange(run, case.payload)
        else:
            if case.kind == "json":
                r = await client.post(SPEECH_PATH, json={**GOOD, **case.payload})
            elif case.kind == "raw":
                r = await client.post(SPEECH_PATH, content=case.payload, headers={"content-type": "application/json"})
            elif case.kind == "voice":
                r = await client.post(VOICES_PATH, **case.payload)
            else:  # route
                r = await client.request(*case.payload)
            code, content = r.status_code, r.content
        server_error = code >= 500
        if code != case.status:
            status = f"hostile {case.name}: HTTP {code} {error_code(content)}, expected {case.status}"
        elif code >= 400 and (wrong := error_shape(content, case.code)) is not None:
            status = f"hostile {case.name}: {wrong}"
        elif code == 200 and case.kind == "json" and not content:
            status = f"hostile {case.name}: 200 without audio"
        else:
            status = "ok"
        if code == 200 and case.kind == "voice":  # a hostile upload that is a valid voice: not kept
            d = await client.delete(f"{VOICES_PATH}/{json.loads(content)['id']}")
            if d.status_code != 200:
                status = f"hostile {case.name}: DELETE of its voice HTTP {d.status_code}"
    except (TimeoutError, httpx.HTTPError, OSError, EOFError, ValueError, IndexError, KeyError) as e:
        status = f"hostile {case.name}: transport {type(e).__name__}"
    finally:
        run.record("hostile-http", user, t_send, status, server_error=server_error, detail=case.name)


async def http_user(run: SoakRun, user: int) -> None:
    rng = run.rng(user)
    await run.start(user)
    async with http_client(run) as client:
        h = 0
        while not run.stopping:
            x = rng.random()
            if x < run.hostile:
                await hostile_http(run, client, user, HTTP_CASES[(user * 7 + h) % len(HTTP_CASES)])
                h += 1
            elif x < run.hostile + run.disconnect:
                await disconnect(run, user, rng)
            elif await soak_speech(run, client, user, rng) != "ok":
                await asyncio.sleep(BACKOFF_S)


# ---------------------------------------------------------------- WebSocket
async def _recv(ws):
    return await asyncio.wait_for(ws.recv(), READ_TIMEOUT)


async def _close_context(ws, cid: str) -> None:
    """`close` a context_id and wait for its `done` (other contexts' messages skipped)."""
    await ws.send(json.dumps({"context_id": cid, "close": True}))
    while not (isinstance(m := await _recv(ws), str) and (e := json.loads(m)).get("context_id") == cid
               and e.get("type") == "done"):
        pass


async def ws_disconnect(run: SoakRun, ws, user: int, rng: random.Random, cid: str, voice: str) -> None:
    """A turn left after its first audio (or before): a close frame, FIN without one, or RST."""
    how = rng.choice(("close", "fin", "rst"))
    t_send, t_first, status = now(), None, "cut"
    try:
        await ws.send(json.dumps({"context_id": cid, "text": rng.choice(run.texts), "flush": True, "voice": voice,
                                  "max_audio_length_ms": run.ms(rng, long=True)}))
        if rng.random() < 0.75:
            while True:
                m = await _recv(ws)
                if not isinstance(m, str):
                    t_first = now()
                    break
                if json.loads(m).get("type") in ("error", "flush_done"):
                    break
        if how == "close":
            await asyncio.wait_for(ws.close(), 10)
        else:
            _reset(ws.transport) if how == "rst" else ws.transport.close()
        status = "ok"
    except TimeoutError:
        status = "ws timeout"
    finally:
        run.record(f"ws-disconnect-{how}", user, t_send, status, t_first=t_first)


async def ws_hostile(run: SoakRun, ws, user: int, case: Case, cid: str) -> None:
    """A hostile message between two turns: answered as the case says; its side session closed after."""
    side = f"{cid}-h"
    kind, _, code = case.code.partition(":")
    t_send, status, server_error = now(), "cut", False
    try:
        for m in case.payload:
            await ws.send(m.replace(CID, side) if isinstance(m, str) else m)
        while True:
            m = await _recv(ws)
            if isinstance(m, str) and (event := json.loads(m)).get("type") not in ("audio", "segment"):
                break  # (audio of a case that must speak: skipped)
        got = event.get("type")
        if got != kind:
            status = f"hostile {case.name}: {got} {json.dumps(event)[:120]}"
        elif kind == "error" and (wrong := error_shape(json.dumps({"error": event.get("error")}).encode(), code)):
            status = f"hostile {case.name}: {wrong}"
        else:
            status = "ok"
        server_error = got == "error" and ws_error(event)[1]
        await _close_context(ws, side)
    except TimeoutError:
        status = f"hostile {case.name}: no answer"
    finally:
        run.record("hostile-ws", user, t_send, status, server_error=server_error, detail=case.name)


def _pieces(rng: random.Random, text: str) -> list[str]:
    """A turn's text in 1-3 pieces, as an LLM streams it."""
    words = text.split()
    cuts = sorted(rng.sample(range(1, len(words)), min(len(words) - 1, rng.randint(0, 2)))) if len(words) > 1 else []
    return [" ".join(words[a:b]) + " " for a, b in zip([0, *cuts], [*cuts, len(words)])]


async def ws_user(run: SoakRun, user: int) -> None:
    from websockets.exceptions import WebSocketException

    failures = (OSError, WebSocketException, asyncio.TimeoutError)
    rng = run.rng(user)
    await run.start(user)
    conv, h = 0, 0
    while not run.stopping:
        cid, voice = f"{run.run_id}-u{user}-c{conv}", run.voice_for(rng)
        turns, done, ws = rng.randint(*run.turns), 0, None
        try:
            while done < turns and not run.stopping:
                if ws is None:
                    t = now()
                    try:
                        ws = await ws_connect(run)
                    except failures as e:
                        run.record("ws-connect", user, t, f"transport connect {type(e).__name__}")
                        await asyncio.sleep(BACKOFF_S)
                        continue
                x = rng.random()
                if x < run.hostile:
                    await ws_hostile(run, ws, user, WS_CASES[(user * 3 + h) % len(WS_CASES)], cid)
                    h += 1
                elif x < run.hostile + run.disconnect and done:  # the conversation goes on without the cut turn
                    await ws_disconnect(run, ws, user, rng, cid, voice)
                    ws = None
                else:
                    settings = {"voice": voice, "max_audio_length_ms": run.ms(rng)}
                    status = await ws_turn(run, ws, user, cid, _pieces(rng, rng.choice(run.texts)), settings,
                                           detail=f"turn {done}")
                    done += 1
                    if status != "ok":
                        await asyncio.sleep(BACKOFF_S)
            if ws is not None and not run.stopping:
                t = now()
                await _close_context(ws, cid)
                run.record("ws-close", user, t, "ok", detail=f"{done} turns")
        except failures as e:
            run.record("ws-connection", user, now(), f"transport {type(e).__name__}")
            await asyncio.sleep(BACKOFF_S)
        finally:
            if ws is not None:
                await close_quietly(ws)
        conv += 1


# ---------------------------------------------------------------- voices
async def voice_user(run: SoakRun, user: int) -> None:
    """Create, use, delete, check gone; KEEP_VOICES of them stay alive at a time."""
    import httpx

    rng = run.rng(user)
    await run.start(user)
    live: deque[str] = deque()
    async with http_client(run) as client:
        k = 0
        while not run.stopping:
            name = f"{run.run_id}-v{user}-{k}"
            k += 1
            t, status, vid = now(), "cut", None
            run.uncertain.append(name)
            try:
                r = await client.post(VOICES_PATH, data={"name": name, "transcript": VOICE_TRANSCRIPT},
                                      files={"audio_sample": ("v.wav", voice_wav(rng.uniform(1.0, 3.0), seed=k),
                                                              "audio/wav")})
                if r.status_code == 200:
                    vid = r.json()["id"]
                    run.created[vid] = r.json()["num_frames"]
                    status = "ok"
                else:
                    status = f"http {r.status_code} {error_code(r.content)}"
                run.uncertain.remove(name)
            except httpx.HTTPError as e:
                status = f"transport {type(e).__name__}"
            finally:
                run.record("voice-create", user, t, status, server_error=status.startswith("http 5"),
                           detail=vid or name)
            if vid is None:
                await asyncio.sleep(BACKOFF_S)
                continue
            live.append(vid)
            for _ in range(rng.randint(1, 2)):
                await soak_speech(run, client, user, rng, voice=vid, kind="voice-use")
            if len(live) > KEEP_VOICES:
                await _delete_and_check(run, client, user, live.popleft())


async def _delete_and_check(run: SoakRun, client, user: int, vid: str) -> None:
    import httpx

    t, status = now(), "cut"
    run.created.pop(vid, None)
    run.uncertain.append(vid)
    try:
        r = await client.delete(f"{VOICES_PATH}/{vid}")
        status = "ok" if r.status_code == 200 else f"http {r.status_code} {error_code(r.content)}"
        if r.status_code == 200:
            run.deleted.append(vid)
            run.uncertain.remove(vid)
    except httpx.HTTPError as e:
        status = f"transport {type(e).__name__}"
    finally:
        run.record("voice-delete", user, t, status, server_error=status.startswith("http 5"), detail=vid)
    if status != "ok":
        return
    t, status = now(), "cut"
    try:  # gone: GET and a speech request in it both 404 voice_not_found
        g = await client.get(f"{VOICES_PATH}/{vid}")
        s = await client.post(SPEECH_PATH, json={**GOOD, "voice": vid})
        got = (g.status_code, error_code(g.content), s.status_code, error_code(s.content))
        status = "ok" if got == (404, "voice_not_found", 404, "voice_not_found") else f"deleted voice answers {got}"
    except httpx.HTTPError as e:
        status = f"transport {type(e).__name__}"
    finally:
        run.record("voice-gone", user, t, status, server_error=status.startswith("http 5"), detail=vid)


USERS = {"http": http_user, "ws": ws_user, "voice": voice_user}


async def run_soak(cmd: dict, commands: asyncio.Queue) -> dict:
    """This process's users until the parent says stop; records go up every FLUSH_S as they end."""
    run = SoakRun(cmd)
    tasks = [asyncio.create_task(USERS[role](run, user)) for user, role in cmd["users"]]

    def flush() -> None:
        if run.records:
            send({"event": "records", "records": run.take()})

    result, lags = await run_users(run, commands, tasks, FLUSH_S, flush)
    return result | {"loop_lag_max_ms": round(max(lags, default=0.0), 1),
                     "voices": {"live": run.created, "deleted": run.deleted, "uncertain": run.uncertain}}
