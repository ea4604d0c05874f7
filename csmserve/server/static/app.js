// csmserve's page: voices (upload or record), a conversation whose turns are context for the next,
// PCM over the WebSocket (binary float32 frames) into Web Audio as it is generated.
// No build step. window.csm exposes counters for tests (samplesReceived, playbackTime(), ...).
"use strict";

const SR = 24000;
const $ = (id) => document.getElementById(id);

const csm = (window.csm = {
  samplesReceived: 0, // every PCM sample that arrived over the WebSocket, all turns
  chunksReceived: 0,
  ttfaMs: null, // of the current/last utterance
  rtf: null, // wall time / audio time of the current/last utterance (< 1: faster than real time)
  busy: false,
  utterances: 0, // finished utterances
  errors: [],
  audioContext: null,
  playbackTime: () => (csm.audioContext ? csm.audioContext.currentTime : 0),
  playedSeconds: 0, // seconds of received audio whose playback time has passed
  turns: [],
});

// ------------------------------------------------------------------ HTTP helpers
function apiKey() { return $("api-key").value.trim(); }
function authHeaders() { const k = apiKey(); return k ? { Authorization: "Bearer " + k } : {}; }
async function api(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: { ...(opts.headers || {}), ...authHeaders() } });
  const body = r.headers.get("content-type")?.includes("json") ? await r.json() : await r.text();
  if (!r.ok) throw new Error(body?.error?.message || `${r.status} ${r.statusText}`);
  return body;
}
function setStatus(id, msg, kind = "") { const el = $(id); el.textContent = msg; el.className = "status " + kind; }
function fail(id, e) { csm.errors.push(String(e.message || e)); setStatus(id, String(e.message || e), "err"); }

// ------------------------------------------------------------------ voices
async function loadVoices(selectId) {
  const sel = $("voice-select");
  const keep = selectId || sel.value;
  const body = await api("/v1/audio/voices");
  sel.innerHTML = "";
  const stored = body.voices.filter((v) => v.type !== "alias");
  const aliases = body.voices.filter((v) => v.type === "alias");
  const group = (label, list, fmt) => {
    if (!list.length) return;
    const g = document.createElement("optgroup"); g.label = label;
    for (const v of list) {
      const o = document.createElement("option");
      o.value = v.id; o.textContent = fmt(v); o.dataset.speaker = v.speaker ?? 0; o.dataset.type = v.type;
      g.appendChild(o);
    }
    sel.appendChild(g);
  };
  group("Your voices", stored, (v) => `${v.name} (${(v.duration_s ?? 0).toFixed(1)} s clip` +
    (v.adapter ? `, fine-tune ${v.adapter})` : ")"));
  for (const o of sel.querySelectorAll("option")) {
    const v = stored.find((x) => x.id === o.value);
    if (v && v.adapter) o.dataset.adapter = v.adapter;
  }
  group("Built-in (no clip: CSM draws a voice)", aliases, (v) => v.name || v.id);
  if (keep && [...sel.options].some((o) => o.value === keep)) sel.value = keep;
  $("voice-delete").disabled = sel.selectedOptions[0]?.dataset.type === "alias";
  showVoiceAdapter();
}

// ------------------------------------------------------------------ fine-tunes (LoRA adapters: /v1/models' entries
// with a parent); the request's `model`: "" is the base, or the selected voice's fine-tune when it is bound to one
async function loadModels() {
  const models = await api("/v1/models");
  csm.models = models.data || [];
  const base = csm.models.find((m) => !m.parent)?.id || "?";
  const adapters = csm.models.filter((m) => m.parent).map((m) => m.id);
  $("model").textContent = "model: " + base + (adapters.length ? ` + ${adapters.length} fine-tune${adapters.length > 1 ? "s" : ""}` : "");
  for (const [id, first] of [["model-select", "none (the voice's, if bound)"], ["voice-adapter", "none (the base model)"]]) {
    const sel = $(id), keep = sel.value;
    sel.innerHTML = "";
    for (const [value, text] of [["", first], ...adapters.map((a) => [a, a])]) {
      const o = document.createElement("option"); o.value = value; o.textContent = text; sel.appendChild(o);
    }
    if ([...sel.options].some((o) => o.value === keep)) sel.value = keep;
    sel.disabled = !adapters.length;
  }
}
function showVoiceAdapter() {
  const bound = $("voice-select").selectedOptions[0]?.dataset.adapter;
  $("model-select").options[0] && ($("model-select").options[0].textContent = bound ? `the voice's: ${bound}` : "none (the base model)");
}
$("model-select").addEventListener("change", () => newConversation()); // the session's model is set when it starts

let voiceClip = null; // {blob, name}
$("voice-file").addEventListener("change", () => {
  const f = $("voice-file").files[0];
  if (f) { voiceClip = { blob: f, name: f.name }; $("voice-clip-info").textContent = `${f.name} (${(f.size / 1024).toFixed(0)} KiB)`; }
});

$("voice-create-btn").addEventListener("click", async () => {
  const name = $("voice-name").value.trim() || (voiceClip ? voiceClip.name.replace(/\.[^.]*$/, "") : "");
  if (!voiceClip) return setStatus("voice-status", "choose a file or record a clip first", "err");
  if (!name) return setStatus("voice-status", "give the voice a name", "err");
  const form = new FormData();
  form.append("name", name);
  form.append("transcript", $("voice-transcript").value.trim());
  form.append("speaker", String(parseInt($("voice-speaker").value || "0", 10)));
  if ($("voice-adapter").value) form.append("adapter", $("voice-adapter").value);
  form.append("audio_sample", voiceClip.blob, voiceClip.name);
  setStatus("voice-status", "encoding the clip with Mimi…");
  try {
    const v = await api("/v1/audio/voices", { method: "POST", body: form });
    await loadVoices(v.id);
    setStatus("voice-status", `created “${v.name}”: ${v.duration_s.toFixed(2)} s, ${v.num_frames} frames`, "ok");
    csm.createdVoice = v;
    newConversation(); // a new voice starts a new conversation context
  } catch (e) { fail("voice-status", e); }
});

$("voice-delete").addEventListener("click", async () => {
  const id = $("voice-select").value;
  if (!id || !confirm("Delete this voice?")) return;
  try { await api(`/v1/audio/voices/${encodeURIComponent(id)}`, { method: "DELETE" }); await loadVoices(); }
  catch (e) { fail("voice-status", e); }
});
$("voice-select").addEventListener("change", () => {
  $("voice-delete").disabled = $("voice-select").selectedOptions[0]?.dataset.type === "alias";
  showVoiceAdapter();
  newConversation();
});

// ------------------------------------------------------------------ microphone
function recorder(button, onDone) {
  let rec = null, chunks = [];
  button.addEventListener("click", async () => {
    if (rec) { rec.stop(); return; }
    try {
      const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
      rec = new MediaRecorder(stream);
      chunks = [];
      rec.ondataavailable = (e) => e.data.size && chunks.push(e.data);
      rec.onstop = () => {
        stream.getTracks().forEach((t) => t.stop());
        const blob = new Blob(chunks, { type: rec.mimeType || "audio/webm" });
        rec = null; button.classList.remove("rec"); button.textContent = button.dataset.label;
        onDone(blob);
      };
      button.dataset.label ||= button.textContent;
      rec.start(); button.classList.add("rec"); button.textContent = "■ Stop recording";
    } catch (e) { fail("status", new Error("microphone: " + (e.message || e))); }
  });
}
const ext = (blob) => (blob.type.includes("ogg") ? "ogg" : blob.type.includes("mp4") ? "m4a" : "webm");
recorder($("voice-record"), (blob) => {
  voiceClip = { blob, name: `recording.${ext(blob)}` };
  $("voice-clip-info").textContent = `recorded ${(blob.size / 1024).toFixed(0)} KiB`;
});
let userClip = null;
recorder($("turn-record"), (blob) => { userClip = blob; $("turn-add").disabled = false; });

// ------------------------------------------------------------------ audio out
function audioContext() {
  if (!csm.audioContext) {
    const AC = window.AudioContext || window.webkitAudioContext;
    try { csm.audioContext = new AC({ sampleRate: SR, latencyHint: "interactive" }); }
    catch { csm.audioContext = new AC(); } // the buffer's 24 kHz is resampled by Web Audio
  }
  if (csm.audioContext.state === "suspended") csm.audioContext.resume();
  return csm.audioContext;
}
let playHead = 0; // the AudioContext time where the next chunk starts
const sources = new Set();
function play(samples) {
  const ac = audioContext();
  const buf = ac.createBuffer(1, samples.length, SR);
  buf.copyToChannel(samples, 0);
  const src = ac.createBufferSource();
  src.buffer = buf; src.connect(ac.destination);
  playHead = Math.max(playHead, ac.currentTime + 0.05); // a small lead absorbs jitter between chunks
  src.start(playHead);
  const end = playHead + buf.duration;
  playHead = end;
  sources.add(src);
  src.onended = () => { sources.delete(src); csm.playedSeconds += buf.duration; };
  return end;
}
function stopPlayback() { for (const s of sources) { try { s.stop(); } catch {} } sources.clear(); playHead = 0; }

function wavBlob(chunks) {
  const n = chunks.reduce((a, c) => a + c.length, 0);
  const buf = new ArrayBuffer(44 + 2 * n), v = new DataView(buf);
  const str = (o, s) => [...s].forEach((c, i) => v.setUint8(o + i, c.charCodeAt(0)));
  str(0, "RIFF"); v.setUint32(4, 36 + 2 * n, true); str(8, "WAVE"); str(12, "fmt ");
  v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true); v.setUint32(24, SR, true);
  v.setUint32(28, 2 * SR, true); v.setUint16(32, 2, true); v.setUint16(34, 16, true); str(36, "data");
  v.setUint32(40, 2 * n, true);
  let o = 44;
  for (const c of chunks) for (let i = 0; i < c.length; i++, o += 2) v.setInt16(o, Math.max(-1, Math.min(1, c[i])) * 32767, true);
  return new Blob([buf], { type: "audio/wav" });
}
const b64 = (blob) => new Promise((ok, err) => {
  const r = new FileReader(); r.onload = () => ok(String(r.result).split(",")[1]); r.onerror = err; r.readAsDataURL(blob);
});

// ------------------------------------------------------------------ the WebSocket
let ws = null, wsReady = null;
let contextId = null, contextFresh = true, convCounter = 0;
let current = null; // the utterance being generated: {turn, sentAt, firstAt, samples}

function connect() {
  if (ws && ws.readyState <= 1) return wsReady;
  const proto = location.protocol === "https:" ? "wss" : "ws";
  const key = apiKey() ? `&api_key=${encodeURIComponent(apiKey())}` : "";
  ws = new WebSocket(`${proto}://${location.host}/v1/audio/speech/stream?binary=1&progress=1${key}`);
  ws.binaryType = "arraybuffer";
  wsReady = new Promise((ok, err) => {
    ws.onopen = () => { setConn("connected"); ok(); };
    ws.onerror = () => err(new Error("WebSocket failed"));
  });
  ws.onclose = (e) => {
    setConn(e.code === 1000 || e.code === 1005 ? "idle" : `closed (${e.code})`);
    if (current) finishUtterance("closed");
    ws = null;
  };
  ws.onmessage = (e) => {
    if (typeof e.data !== "string") return onAudio(new Float32Array(e.data));
    const m = JSON.parse(e.data);
    if (m.type === "flush_done") finishUtterance(m.finish_reason, m);
    else if (m.type === "error") {
      fail("status", new Error(m.error.message));
      if (current && (m.context_id === contextId || m.context_id == null)) finishUtterance("error", m);
    } else if (m.type === "cancelled") { if (current) finishUtterance("cancelled"); }
    else if (m.type === "segment") onSegment(m);
  };
  return wsReady;
}
function setConn(s) { $("conn").textContent = s; $("conn").className = "pill " + (s === "connected" ? "on" : ""); }

// a segment's first frame and text (progress=1), before its audio (the Talk panel keeps what was heard)
function onSegment(m) {} // eslint-disable-line no-unused-vars

function onAudio(samples) {
  if (!current) return;
  const now = performance.now();
  if (current.firstAt === null) {
    current.firstAt = now;
    csm.ttfaMs = now - current.sentAt;
    current.turn.ttfaMs = csm.ttfaMs;
  }
  csm.samplesReceived += samples.length;
  csm.chunksReceived += 1;
  current.samples += samples.length;
  current.turn.pcm.push(samples);
  play(samples);
  updateStats();
  renderTurn(current.turn);
}

function updateStats() {
  if (current) {
    const wall = (performance.now() - current.sentAt) / 1000, audio = current.samples / SR;
    csm.rtf = audio > 0 ? wall / audio : null;
    current.turn.rtf = csm.rtf;
  }
  $("stat-ttfa").textContent = csm.ttfaMs == null ? "–" : `${csm.ttfaMs.toFixed(0)} ms`;
  $("stat-rtf").textContent = csm.rtf == null ? "–" : `${csm.rtf.toFixed(2)} · ${(1 / csm.rtf).toFixed(1)}× real time`;
  $("stat-audio").textContent = `${(csm.samplesReceived / SR).toFixed(2)} s · ${csm.chunksReceived} chunks`;
  const ac = csm.audioContext;
  $("stat-play").textContent = ac ? `${Math.max(0, playHead - ac.currentTime).toFixed(2)} s queued · t=${ac.currentTime.toFixed(2)} s` : "–";
}
setInterval(updateStats, 200);

function settings() {
  const s = { temperature: parseFloat($("temperature").value || "0.9"), top_k: parseInt($("top-k").value || "50", 10),
              max_segment_length_ms: parseInt($("max-ms").value || "20000", 10), output_format: "pcm_f32le" };
  if ($("seed").value !== "") s.seed = parseInt($("seed").value, 10);
  return s;
}
function voiceSpeaker() { return parseInt($("voice-select").selectedOptions[0]?.dataset.speaker || "0", 10); }

// The conversation: CSM's turns continue one context_id (the server keeps their codes: exact
// continuation). A recorded turn of yours starts a new context_id whose `context` is the whole
// conversation so far in order (generated turns as WAV of the audio we received, yours as recorded).
async function contextTurns() {
  const out = [];
  for (const t of csm.turns.slice(-16)) {
    if (t.role === "csm" && t.pcm.length && t.done) out.push({ speaker: t.speaker, text: t.text, audio: await b64(wavBlob(t.pcm)) });
    else if (t.role === "you") out.push({ speaker: t.speaker, text: t.text, audio: await b64(t.blob) });
  }
  return out;
}
function newContextId() { contextId = `page-${Date.now().toString(36)}-${++convCounter}`; contextFresh = true; }

async function speak() {
  const text = $("text").value.trim();
  if (!text || csm.busy) return;
  audioContext(); // inside the click: browsers only start audio on a user gesture
  csm.busy = true; $("speak").disabled = true; $("stop").disabled = false;
  setStatus("status", "generating…");
  try {
    await connect();
    const turn = { role: "csm", text, speaker: voiceSpeaker(), pcm: [], done: false, ttfaMs: null, rtf: null };
    const msg = { context_id: contextId, text, flush: true, ...settings() };
    if (contextFresh) {
      msg.voice = $("voice-select").value || "alloy";
      if ($("model-select").value) msg.model = $("model-select").value;
      msg.context = await contextTurns();
      contextFresh = false;
    }
    addTurn(turn);
    $("text").value = "";
    current = { turn, sentAt: performance.now(), firstAt: null, samples: 0 };
    csm.ttfaMs = null; csm.rtf = null;
    ws.send(JSON.stringify(msg));
  } catch (e) { fail("status", e); csm.busy = false; $("speak").disabled = false; $("stop").disabled = true; }
}

function finishUtterance(reason, m) {
  const c = current;
  current = null;
  csm.busy = false; $("speak").disabled = false; $("stop").disabled = true;
  if (!c) return;
  c.turn.done = true; c.turn.finish = reason;
  if (reason === "eos" || reason === "length") {
    csm.utterances += 1;
    setStatus("status", `${(c.samples / SR).toFixed(2)} s of audio (${reason})` +
      (c.turn.ttfaMs != null ? `, first audio after ${c.turn.ttfaMs.toFixed(0)} ms` : ""), "ok");
  } else if (reason !== "error") setStatus("status", reason);
  if (!c.samples) { csm.turns = csm.turns.filter((t) => t !== c.turn); c.turn.el?.remove(); }
  if (reason !== "eos" && reason !== "length") newContextId(); // the server's context may be partial
  updateStats(); renderTurn(c.turn);
}

$("speak").addEventListener("click", speak);
$("text").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) speak(); });
$("stop").addEventListener("click", () => {
  if (ws && current) ws.send(JSON.stringify({ context_id: contextId, cancel: true }));
  stopPlayback();
});
$("turn-add").addEventListener("click", () => {
  if (!userClip) return;
  const speaker = voiceSpeaker() === 0 ? 1 : 0;
  addTurn({ role: "you", text: $("turn-transcript").value.trim(), speaker, blob: userClip, done: true, pcm: [] });
  userClip = null; $("turn-add").disabled = true; $("turn-transcript").value = "";
  newContextId(); // the next CSM turn hears the whole conversation, this turn included, in order
});
function newConversation() {
  csm.turns = []; $("turns").innerHTML = ""; $("empty-hint").hidden = false; newContextId();
}
$("reset").addEventListener("click", () => { stopPlayback(); newConversation(); setStatus("status", ""); });

// ------------------------------------------------------------------ the conversation view
function addTurn(t) {
  csm.turns.push(t);
  $("empty-hint").hidden = true;
  t.el = document.createElement("li");
  t.el.className = "turn " + t.role;
  $("turns").appendChild(t.el);
  renderTurn(t);
}
function renderTurn(t) {
  if (!t.el) return;
  const secs = t.role === "csm" ? t.pcm.reduce((a, c) => a + c.length, 0) / SR : null;
  const meta = [];
  if (secs != null) meta.push(`${secs.toFixed(2)} s`);
  if (t.ttfaMs != null) meta.push(`TTFA ${t.ttfaMs.toFixed(0)} ms`);
  if (t.rtf != null) meta.push(`RTF ${t.rtf.toFixed(2)}`);
  if (t.role === "csm" && !t.done) meta.push("streaming…");
  if (t.finish && t.finish !== "eos") meta.push(t.finish);
  t.el.innerHTML = "";
  const who = document.createElement("div"); who.className = "who";
  who.textContent = t.role === "csm" ? `CSM · speaker ${t.speaker}` : `You · speaker ${t.speaker}`;
  const text = document.createElement("div"); text.className = "text"; text.textContent = t.text || "(no transcript)";
  const m = document.createElement("div"); m.className = "meta"; m.textContent = meta.join(" · ");
  t.el.append(who, text, m);
  if (t.done) {
    const b = document.createElement("button"); b.className = "quiet"; b.textContent = "▶ replay";
    b.onclick = () => { const url = URL.createObjectURL(t.role === "csm" ? wavBlob(t.pcm) : t.blob); new Audio(url).play(); };
    m.appendChild(b);
  }
  t.el.scrollIntoView({ block: "nearest" });
}

// ------------------------------------------------------------------ start
$("api-key").value = localStorage.getItem("csmserve.apiKey") || "";
$("api-key").addEventListener("change", () => { localStorage.setItem("csmserve.apiKey", apiKey()); if (ws) ws.close(); init(); });
async function init() {
  try {
    await loadModels();
    await loadVoices();
    setStatus("status", "");
  } catch (e) { fail("status", e); }
}
newContextId();
init();
