"""The engine loop: scheduler + runner, one step at a time; its outputs leave as one record per step.

One iteration: drain the inbox (submit / abort / append / close) -> Scheduler.schedule() ->
runner.admit/prefill/step (launched, not waited) -> read the PREVIOUS step's results (the output
buffer of that step) -> Scheduler.update (vectorised StepRows) -> one `EngineStep` per client to
`emit(client, EngineStep, codes, pcm)`.

Where it runs: on a thread inside the caller's process (client.py `EngineClient`, the `CSM` Python API), or
alone in the engine-core process (engine/core.py), where the inbox is the API workers' connections
and `emit` writes one message per worker. A client is named by the high bits of each request's
handle (`client_of`).

LoRA adapters (EngineConfig.max_loras): `load_adapter` / `unload_adapter` reach the loop through the inbox and
answer through a Future; the loop starts each adapter's copy into its pool slot on the runner's side stream when
the scheduler asks for one, and tells the scheduler when a copy is done (a request for it is admitted then).

A failed step fails the requests it held and the engine goes on, except after an error that leaves
the device unusable (a CUDA device-side assert, an illegal address: `device_lost`): then `fatal`
names it, every later request is refused at once with that reason, and the server's /ready and
/health answer 503, so an orchestrator restarts the process.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from csmserve.config import EngineConfig
from csmserve.engine import trace
from csmserve.engine.adapters import AdapterPoolFullError, AdapterSlots
from csmserve.engine.outputs import (EV_ERROR, EV_FINAL, EngineStats, EngineStep, Event, Progress, Router,
                                     CLIENT_SHIFT, client_of, error_payload)
from csmserve.engine.pacing import LaunchPacer
from csmserve.engine.prefix_cache import PrefixCache, default_prefix_cache_bytes
from csmserve.engine.request import Request, RequestStatus
from csmserve.engine.output_ring import StepOutput
from csmserve.engine.runner import ModelRunner
from csmserve.engine.scheduler import Scheduler, StepRows

log = logging.getLogger("csmserve.engine")
DEVICE_LOST = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
               "CUDA-capable device", "cudaErrorLaunchFailure")


def device_lost(error: BaseException) -> bool:
    """An error after which the CUDA context cannot run anything again (only a new process can)."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(error, accel)) or any(s in str(error) for s in DEVICE_LOST)


# inbox messages: (kind, request_id | Request | adapter name, payload)
ADD, ABORT, APPEND, CLOSE, WAKE = "add", "abort", "append", "close", "wake"
LOAD, UNLOAD, ADAPTERS = "load", "unload", "adapters"  # payload: (LoraAdapter, Future) / Future / Future
Emit = Callable[[int, EngineStep, "StepOutput | None"], None]


class Inbox:
    """Thread-safe queue of messages for the engine loop."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, msg: tuple) -> None:
        self.q.put(msg)

    def get(self, block: bool) -> list[tuple]:
        """Everything queued now; with block, wait up to 0.5 s for the first."""
        out = []
        try:
            out.append(self.q.get(timeout=0.5) if block else self.q.get_nowait())
            while True:
                out.append(self.q.get_nowait())
        except queue.Empty:
            pass
        return out


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, start: bool = True,
                 emit: Emit | None = None, inbox: Inbox | None = None) -> None:
        self.runner, self.config = runner, config
        cache_bytes = config.prefix_cache_bytes
        if cache_bytes is None:  # the default, or half of what the slots and graphs left free on the device
            cache_bytes = default_prefix_cache_bytes(runner.device.type)
            if runner.device.type == "cuda":
                cache_bytes = max(cache_bytes, torch.cuda.mem_get_info(runner.device)[0] // 2)
        self.prefix_cache = PrefixCache(cache_bytes, runner.kv.bytes_per_position) if cache_bytes > 0 else None
        # the LoRA pool's policy, where the runner has a pool (the paced stand-in has none: it serves no adapters)
        adapters = (AdapterSlots(config.max_loras, config.max_cpu_loras)
                    if config.max_loras and getattr(runner, "lora", None) is not None else None)
        self.scheduler = Scheduler(config, runner.cfg.num_codebooks, self.prefix_cache, adapters)
        self._adapter_info: dict[str, dict] = {}  # adapters(): a snapshot the loop refreshes
        self._adapter_info_t = 0.0
        self.num_codebooks = runner.cfg.num_codebooks
        self.inbox = inbox or Inbox()
        self.emit = emit  # None: outputs go to the sinks given to submit(), through self.router
        self.router = Router.of(config, self.num_codebooks, self.abort)
        self.stats = {"frames": 0, "steps": 0, "host_s": 0.0, "gpu_bound_steps": 0, "reader_waits": 0,
                      "reader_wait_s": 0.0}
        self._given_up: dict[int, int] = {}  # client -> the step it had not read within reader_wait_s
        self._prev: tuple[int, StepOutput] | None = None  # the launched step whose results are not read yet
        self._prev_first = False  # _prev makes only first frames (Batch.first_frames)
        self._events: dict[int, list[Event]] = {}  # client -> events for its next EngineStep
        self._live: dict[int, set[str]] = {}  # client -> its unfinished request ids
        self.fatal: str | None = None  # set once the device is lost: the engine only refuses from then on
        self.pacer = LaunchPacer()  # when to launch the next step while one runs (engine/pacing.py)
        # EngineConfig.trace_requests: stamps of the requests not yet at their first frame step, by id
        self.tracer = trace.start(config.trace_requests, "engine") if config.trace_requests else None
        self._traced: dict[str, dict] = {}
        self._trace_prefilling: list[Request] = []  # admitted, first frame step not yet scheduled
        self._t_drained = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="csmserve-engine", daemon=True)
        if start:  # start=False: tests (and the engine-core process) drive step() by hand
            self._thread.start()

    # ---- thread-safe entry points
    def submit(self, request: Request, sink: Callable | None = None, max_lag_s: float | None = None,
               progress: Progress | None = None) -> None:
        """Queue a request. sink: where its AudioChunks (or an exception) go, from the engine's thread
        (in-process; without `emit`); max_lag_s/progress: see Router."""
        request.arrival_time = request.arrival_time or time.perf_counter()
        self.inbox.put((ADD, request, None if sink is None else (sink, max_lag_s, progress)))

    def abort(self, request_id: str) -> None:
        self.inbox.put((ABORT, request_id, None))

    def append(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> None:
        """One more segment (text frames) for an open long-form request (Request.open)."""
        self.inbox.put((APPEND, request_id, (tokens, mask)))

    def close(self, request_id: str) -> None:
        """No more segments for an open request: it ends after the ones it has."""
        self.inbox.put((CLOSE, request_id, None))

    def read_adapter(self, path: str):
        """A PEFT adapter directory read and checked for this engine's model and pool (models/lora.py LoraAdapter;
        LoraError): any thread, before `load_adapter`."""
        from csmserve.models.lora import read_adapter

        if self.scheduler.adapters is None:
            raise ValueError("this engine serves no LoRA adapters: start it with max_loras >= 1 (--max-loras)")
        p = next(self.runner.model.parameters())
        adapter = read_adapter(path, self.runner.cfg, p.dtype, self.config.max_lora_rank)
        return adapter.pin() if p.is_cuda else adapter

    def load_adapter(self, name: str, adapter) -> Future:
        """Serve `adapter` (a path, or a LoraAdapter from read_adapter) as `name` -> a Future of its info dict
        (ValueError: a name taken, max_cpu_loras reached, an engine without adapters; LoraError: a bad adapter)."""
        fut: Future = Future()
        try:
            adapter = self.read_adapter(adapter) if isinstance(adapter, str) else adapter
        except Exception as e:  # noqa: BLE001 - the caller's error, through the future
            fut.set_exception(e)
            return fut
        self.inbox.put((LOAD, name, (adapter, fut)))
        return fut

    def unload_adapter(self, name: str) -> Future:
        """Stop serving `name` -> a Future (UnknownAdapterError): refused for new requests now; its requests in
        flight finish with it, and its pool slot is freed after them."""
        fut: Future = Future()
        self.inbox.put((UNLOAD, name, fut))
        return fut

    def adapters(self) -> dict[str, dict]:
        """name -> info (rank, bytes, resident, running, queued, requests, loads, load_s) as of the loop's last
        refresh (at once after a load or unload, else at most every 0.5 s)."""
        return self._adapter_info

    def shutdown(self) -> None:
        """Stop the loop; then every request submitted, queued or running ends with an error (a reader of its
        chunks would otherwise wait for a loop that is gone), every adapter call too."""
        self._stop.set()
        self.inbox.put((WAKE, None, None))
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._thread.is_alive():
            return
        why = "the engine was shut down"
        self._refuse(False, why)
        payload = error_payload(RuntimeError(why))
        for rids in self._live.values():
            for rid in list(rids):
                req = self.scheduler.abort(rid)
                rids.discard(rid)
                if req is not None:
                    self._event(req.handle, EV_ERROR, payload)
        self._emit_events()

    @property
    def idle(self) -> bool:
        return self._prev is None and not self.scheduler.has_unfinished()

    @property
    def waiting_for_input(self) -> bool:
        """Nothing to compute: only requests idling for their next segment's text, if any."""
        return self._prev is None and not self.scheduler.has_work()

    def engine_stats(self) -> EngineStats:
        s, pc = self.scheduler, self.prefix_cache
        st = pc.stats if pc is not None else {}
        return EngineStats(s.num_running + s.num_prefilling, s.num_waiting, s.num_idle, s.num_free_slots,
                           s.max_slots, st.get("hits", 0), st.get("misses", 0), st.get("hit_positions", 0),
                           st.get("stores", 0), st.get("evictions", 0), self.stats["steps"], self.stats["frames"],
                           self.fatal, self.stats["reader_waits"], self.stats["reader_wait_s"])

    # ---- the loop
    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                self.run_once()

    def run_once(self) -> None:
        """One loop iteration: a step (a failed one fails its requests, the engine goes on), or after a
        lost device one refusal."""
        if self.fatal is not None:
            self._refuse(block=True)
            return
        try:
            self.step(block=self.waiting_for_input)
        except Exception as e:
            log.exception("engine step failed")
            self._prev = None
            self._fail_all(e)
            self._reconcile_prefixes()
            if device_lost(e):
                self.fatal = f"{type(e).__name__}: {e}".splitlines()[0]
                log.critical("the device is lost (%s); restart the process", self.fatal)
            self._emit_events()
        if self.tracer is not None:
            self.tracer.maybe_flush()

    def _refuse(self, block: bool, down: str | None = None) -> None:
        """After a lost device (or a shutdown: `down`): answer every new request (and adapter call) with the reason
        at once (never a hang)."""
        down = down or f"the engine is down after a device error ({self.fatal}); the process must be restarted"
        for kind, a, b in self.inbox.get(block):
            if kind == ADD:
                if b is not None:
                    self.router.open(a.handle, a.request_id, *b)
                self._event(a.handle, EV_ERROR, error_payload(RuntimeError(down)))
            elif kind in (LOAD, UNLOAD, ADAPTERS):
                (b[1] if kind == LOAD else b).set_exception(RuntimeError(down))
        self._emit_events()

    def step(self, block: bool = False) -> None:
        t_in = time.perf_counter()
        # step N+1 is launched before step N's results are read (the GPU never waits for the host), as late as it
        # can still start when N ends, so what arrives during N joins N+1 (engine/pacing.py); after a step of first
        # frames only (an idle engine's new requests) once that step is done, so its Mimi decode has the GPU to itself
        if self._prev is not None and self._prev_first:
            self._prev[1].wait()
        elif self._prev is not None:
            at = self.pacer.launch_at()
            delay = 0.0 if at is None else at - time.perf_counter()
            if delay > 2e-4:
                time.sleep(delay)  # requests arriving meanwhile join this step
        t_awake = time.perf_counter()
        t_idle = t_awake - t_in
        drained = self._drain(block)
        t0 = time.perf_counter()
        adapters = self.scheduler.adapters
        if adapters is not None:  # copies done since the last step: their requests can be admitted now
            for slot, a in self.runner.lora_loads_done():
                adapters.loaded(slot, a)
            if self.scheduler.num_parked:
                self._expire_parked(t0)
        batch = self.scheduler.schedule()
        if adapters is not None:
            loads = adapters.take_loads()
            if loads:  # on the runner's side stream, after the steps launched so far (they may read the slots)
                self.runner.load_loras(loads)
            if loads or t0 - self._adapter_info_t > 0.5:
                self._refresh_adapters(t0)
        tr = self.tracer
        if tr is not None and (self._traced or batch.admissions):
            self._trace_admitted(batch)
        # the prefill first (after the cached prefixes it attends to): the GPU runs it while the host launches the
        # admissions' loads (~40 small copies), which only the frame step reads
        self.runner.copy_prefixes(batch.admissions)
        self.runner.prefill(batch.prefills)
        self.runner.admit(batch.admissions, prefixes=False)
        self.runner.resume(batch.resumes)
        self.runner.store_prefixes(batch.prefix_stores)
        t_r = time.perf_counter()
        if self.emit is not None and len(batch.decode_slots):
            self._await_readers()
        t_r = time.perf_counter() - t_r
        out = self.runner.step(batch.decode_slots, batch.step, batch.from_prefill)
        t_launched = time.perf_counter()
        if out is not None:  # the launch cost of a frame step, not of an empty iteration
            self.pacer.launched(t_launched - t0)
        if tr is not None and (out is not None or batch.admissions or batch.prefills):
            tr.row("step", batch.step, t_in, t_awake, self._t_drained, t0, t_launched,
                   len(batch.decode_slots), len(batch.admissions), sum(len(c.tokens) for c in batch.prefills),
                   drained, t_r)
        if self._prev is not None:
            waited = not self._prev[1].done()
            t_w = time.perf_counter()
            self._prev[1].wait()
            t_done = time.perf_counter()
            t_idle += t_done - t_w
            self.stats["gpu_bound_steps"] += waited
            # the step's generation ended when the decode behind it began (codec stream): the next one starts then
            self.pacer.step_done(t_done - self._prev[1].codec_lag_s(), waited)
            live = self._collect(*self._prev)
            if tr is not None:
                tr.row("collect", self._prev[0], t_w, t_done, time.perf_counter(), live)
        else:
            self._emit_events()
        if out is None:
            self.pacer.idle()
        else:  # the host's own time this iteration (not sleeping, not waiting for the device)
            self.stats["host_s"] += time.perf_counter() - t_in - t_idle
        self._prev = (batch.step, out) if out is not None else None
        self._prev_first = out is not None and batch.first_frames

    def _await_readers(self) -> None:
        """Before a step overwrites an output-ring buffer: wait (up to reader_wait_s) for the workers
        that have not read their rows of the step it holds, so a busy worker slows the engine down
        rather than losing its streams. One that stays behind is given up on (its rows there are lost:
        its streams end with an error) until it has caught up."""
        ring = self.runner.ring
        if self._given_up:
            self._given_up = {c: s for c, s in self._given_up.items() if not ring.caught_up(c, s)}
        lagging = [c for c in ring.lagging() if c not in self._given_up]
        if not lagging:
            return
        self.stats["reader_waits"] += 1
        t0 = time.perf_counter()
        deadline = t0 + self.config.reader_wait_s
        while lagging and time.perf_counter() < deadline:
            time.sleep(2e-4)
            lagging = [c for c in ring.lagging() if c not in self._given_up]
        if lagging:
            step = ring.upcoming_step()
            log.warning("API worker(s) %s had not read step %d after %.1f s: their streams in it end with an error",
                        lagging, step, self.config.reader_wait_s)
            self._given_up.update(dict.fromkeys(lagging, step))
        self.stats["reader_wait_s"] += time.perf_counter() - t0

    def _drain(self, block: bool) -> int:
        """-> the number of messages drained."""
        msgs = self.inbox.get(block)
        if self.tracer is not None:
            self._t_drained = time.perf_counter()  # the messages in hand (a blocking get waited for them)
            self._trace_drained(msgs, self._t_drained)
        for kind, a, b in msgs:
            if kind == ADD:
                self._add(a, b)
            elif kind == ABORT:
                self._abort(a)
            elif kind == APPEND:
                self._append(a, *b)
            elif kind == CLOSE:
                req = self.scheduler.close(a)
                if req is not None:
                    self._ended(req, EV_FINAL, req.status.finish_reason, segment=max(0, req.segment - 1))
            elif kind in (LOAD, UNLOAD, ADAPTERS):
                self._adapter_call(kind, a, b)
        return len(msgs)

    # ---- EngineConfig.trace_requests (only requests that start touch Python)
    def _trace_drained(self, msgs: list[tuple], t: float) -> None:
        step = self.scheduler.last_step + 1  # the step this drain feeds
        for kind, a, _ in msgs:
            if kind == ADD:
                self._traced[a.request_id] = {"id": a.request_id, "handle": a.handle, "drained": t, "dstep": step}

    def _trace_admitted(self, batch) -> None:
        """After schedule(): stamp this batch's admissions; a request whose first frame step is in this
        batch (its prompt prefilled, or all of it cached) is written out."""
        slots = self.scheduler.slots
        for a in batch.admissions:
            req = slots[a.slot]
            rec = self._traced.get(req.request_id)
            if rec is not None:
                rec["admitted"], rec["astep"] = req.admit_time, batch.step
                self._trace_prefilling.append(req)
        if not self._trace_prefilling:
            return
        left = []
        for req in self._trace_prefilling:
            if req.status is RequestStatus.PREFILLING:
                left.append(req)
                continue
            rec = self._traced.pop(req.request_id, None)
            if rec is not None:
                if req.status is RequestStatus.RUNNING:
                    rec["fstep"] = batch.step
                self.tracer.request(rec)
        self._trace_prefilling = left

    def _adapter_call(self, kind: str, name: str | None, payload) -> None:
        fut = payload[1] if kind == LOAD else payload
        try:
            adapters = self.scheduler.adapters
            if kind == ADAPTERS:
                result = {} if adapters is None else adapters.info()
            elif adapters is None:
                raise ValueError("this engine serves no LoRA adapters: start it with max_loras >= 1 (--max-loras)")
            elif kind == LOAD:
                w = payload[0]
                result = adapters.add(name, w, w.rank, w.nbytes, w.path).info()
                log.info("adapter %r loaded: rank %d, %.1f MB, from %s", name, w.rank, w.nbytes / 2**20, w.path)
            else:
                a = adapters.remove(name)
                result = a.info()
                log.info("adapter %r unloaded (%d requests still finish with it)", name, a.refs)
        except Exception as e:  # noqa: BLE001 - the caller's error
            fut.set_exception(e)
            return
        self._refresh_adapters(time.perf_counter())
        fut.set_result(result)

    def _expire_parked(self, now: float) -> None:
        """Requests that waited max_lora_wait_s for their adapter's pool slot end with AdapterPoolFullError."""
        wait = self.config.max_lora_wait_s
        for req in self.scheduler.overdue_parked(now - wait):
            log.warning("request %s: adapter %r had no pool slot for %.0f s; refused", req.request_id, req.adapter,
                        wait)
            self._ended(req, EV_ERROR, error_payload(AdapterPoolFullError(
                f"adapter {req.adapter!r} waited {wait:g} s for a GPU slot: all {self.config.max_loras} LoRA pool "
                f"slots are held by running requests of other adapters; retry, or raise --max-loras")))

    def register_adapters(self, adapters: dict) -> None:
        """Adapters read already (name -> models/lora.py LoraAdapter: CSM's at start) served from the first step:
        on the caller's thread, before the loop runs (the engine-core process, before it says it is ready).
        ValueError / AdapterLimitError as load_adapter's."""
        for name, adapter in adapters.items():
            fut: Future = Future()
            self._adapter_call(LOAD, name, (adapter, fut))
            fut.result()

    def _refresh_adapters(self, now: float) -> None:
        self._adapter_info = self.scheduler.adapters.info() if self.scheduler.adapters is not None else {}
        self._adapter_info_t = now

    def _add(self, request: Request, local: tuple | None) -> None:
        if local is not None:  # an in-process consumer: the router delivers its chunks
            self.router.open(request.handle, request.request_id, *local)
        try:
            self.scheduler.add(request)
        except Exception as e:  # busy, or a request that cannot run (ValueError): its own error, no one else's
            self._event(request.handle, EV_ERROR, error_payload(e))
            if self.tracer is not None and request.request_id in self._traced:
                self.tracer.request({**self._traced.pop(request.request_id), "refused": type(e).__name__})
            return
        self._live.setdefault(client_of(request.handle), set()).add(request.request_id)

    def _abort(self, request_id: str) -> None:
        if self._traced:
            rec = self._traced.pop(request_id, None)  # aborted before its first frame step
            if rec is not None:
                self.tracer.request({**rec, "aborted": True})
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._ended(req, EV_FINAL, "abort", segment=req.segment)

    def abort_client(self, client: int) -> None:
        """A client went away (its process died): abort everything it had in flight."""
        for rid in list(self._live.pop(client, ())):
            self.scheduler.abort(rid)
        self._events.pop(client, None)
        self.runner.ring.forget(client)  # its reads are never waited for (ids are unique per start)

    def _append(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> None:
        try:
            self.scheduler.append_segment(request_id, tokens, mask)
        except ValueError as e:
            req = self.scheduler.abort(request_id)
            if req is not None:
                self._ended(req, EV_ERROR, error_payload(e))

    def _ended(self, req: Request, kind: int, payload: object, segment: int = 0) -> None:
        self._live.get(client_of(req.handle), set()).discard(req.request_id)
        self._event(req.handle, kind, payload, segment)

    def _event(self, handle: int, kind: int, payload: object, segment: int = 0) -> None:
        self._events.setdefault(client_of(handle), []).append(Event(handle, kind, payload, segment))

    def _collect(self, step: int, out: StepOutput) -> int:
        """-> the step's live rows."""
        codes, pcm = out.wait()
        self.stats["steps"] += 1
        rows = self.scheduler.update(step, codes)
        self.stats["frames"] += int(rows.has_frame.sum())
        for i in np.flatnonzero(rows.final):  # requests that ended: no longer live for their client
            req = rows.requests[i]
            self._live.get(client_of(req.handle), set()).discard(req.request_id)
        self._emit_rows(rows, out)
        return len(rows)

    def _emit_rows(self, rows: StepRows, out: StepOutput | None) -> None:
        stats = self.engine_stats()
        if self.emit is None:  # in-process: every row and event goes to the local router
            step = _engine_step(rows, out, slice(None), [e for evs in self._events.values() for e in evs], stats)
            self._events.clear()
            codes = pcm = None
            if out is not None and len(rows):
                _, p = out.wait()
                codes, pcm = rows.codes, (None if p is None else p[rows.rows])  # copies: the buffer is reused
            self.router.deliver(step, codes, pcm)
            return
        clients = rows.handles >> CLIENT_SHIFT
        with_rows = np.unique(clients).tolist()
        if out is not None:
            self.runner.ring.readers[out.ring] = tuple(with_rows)  # who must read it before its reuse
        for c in set(with_rows) | set(self._events):
            step = _engine_step(rows, out, clients == c, self._events.pop(c, []), stats)
            if self.tracer is not None:  # handed to the client's connection (it may read it before emit returns)
                self.tracer.row("emit", rows.step, c, time.perf_counter())
            self.emit(c, step, out)

    def _emit_events(self) -> None:
        if self._events:
            from csmserve.engine.scheduler import empty_rows

            self._emit_rows(empty_rows(0, self.num_codebooks), None)

    def _reconcile_prefixes(self) -> None:
        """After a failed step: the prefix cache's index and the runner's stored KV agree again (a key the step
        reserved but never stored would be a hit whose copy fails every later step that takes it; entries it
        evicted but never dropped would hold their memory)."""
        pc, stored = self.prefix_cache, getattr(self.runner, "prefix_kv", None)
        if pc is None or stored is None:
            return
        for key in pc.keys():
            if key not in stored:
                pc.discard(key)
        for key in [k for k in stored if k not in pc]:
            del stored[key]
        pc.take_evicted()

    def _fail_all(self, error: Exception) -> None:
        """After a failed step: every request it may have touched (each holding a slot) ends with the
        error; the ones still queued were not in it and stay queued (after a lost device they are refused)."""
        queued = self.scheduler.queued_ids() if self.fatal is None and not device_lost(error) else set()
        payload = error_payload(RuntimeError(f"engine step failed: {error}"))
        for client, rids in list(self._live.items()):
            for rid in list(rids):
                if rid in queued:
                    continue
                req = self.scheduler.abort(rid)
                rids.discard(rid)
                if req is not None:
                    self._event(req.handle, EV_ERROR, payload)


def _engine_step(rows: StepRows, out: StepOutput | None, m, events: list[Event], stats: EngineStats) -> EngineStep:
    """The rows `m` (a client's mask, or slice(None): all) of a step, with the events and counters for their client."""
    return EngineStep(rows.step, -1 if out is None else out.ring, rows.rows[m], rows.handles[m], rows.frame_start[m],
                      rows.segment[m], rows.has_frame[m], rows.end[m], rows.final[m], events, stats)


def build_engine(model, mimi, config: EngineConfig, start: bool = True, emit: Emit | None = None,
                 inbox: Inbox | None = None, ring_path: str | None = None, ring_slots: int = 2) -> Engine:
    """The engine for a loaded model (and codec): slots sized from free memory unless config.max_slots,
    the runner (graphs on CUDA), the output ring (in a shared-memory file when ring_path is given)."""
    import dataclasses

    from csmserve.engine.output_ring import OutputRing
    from csmserve.engine.prefix_cache import default_prefix_cache_bytes
    from csmserve.engine.slots import size_slots

    device = next(model.parameters()).device
    cfg = config
    if cfg.max_slots is None:  # as many slots as fit beside the prefix cache and the LoRA pool
        cache = cfg.prefix_cache_bytes
        cache = default_prefix_cache_bytes(device.type) if cache is None else cache
        if cfg.max_loras:
            from csmserve.models.lora import LoraLayout

            layout, size = LoraLayout(model.cfg), next(model.parameters()).element_size()
            cache += cfg.max_loras * cfg.max_lora_rank * layout.width * size
            if cfg.lora_merge and cfg.weights == "bf16":  # the base copy of the weights a merge keeps
                cache += sum(t.n * t.k for t in layout.targets) * size
        cfg = dataclasses.replace(cfg, max_slots=size_slots(model, mimi, cfg.max_seq_len, reserve_bytes=cache))
    fs = mimi.cfg.frame_size if mimi is not None else 0
    ring = OutputRing(ring_slots, cfg.max_slots, model.cfg.num_codebooks, fs, cuda=device.type == "cuda",
                      path=ring_path)
    runner = ModelRunner(model, cfg.max_slots, cfg.max_seq_len, mimi=mimi,
                         max_prefill_tokens=cfg.prefill_token_budget, output_ring=ring,
                         weights=cfg.weights, codec_stream=cfg.codec_stream, max_loras=cfg.max_loras,
                         max_lora_rank=cfg.max_lora_rank, lora_merge=cfg.lora_merge)
    return Engine(runner, cfg, start=start, emit=emit, inbox=inbox)
