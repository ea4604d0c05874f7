// Talk mode: your microphone turn -> an OpenAI-compatible transcription endpoint -> an OpenAI-compatible
// chat endpoint (streamed) -> each token into the WebSocket as it arrives, so CSM speaks while the LLM
// writes; the whole conversation (your recordings, CSM's replies as played) is the context of each reply.
// Speaking again while CSM speaks barges in: its audio stops and its turn is cut at what was played.
// The endpoints are called from the browser: they must allow CORS (see docs/talk.md).
// window.csm.talk exposes each turn's latency split and what was sent (for tests).
"use strict";

csm.talk = { turns: [], errors: [], history: [], busy: () => !!talking };
const talkEl = (id) => document.getElementById(id);
for (const id of ["talk-asr", "talk-llm", "talk-model"]) {
  const saved = localStorage.getItem("csmserve." + id);
  if (saved) talkEl(id).value = saved;
  talkEl(id).addEventListener("change", () => localStorage.setItem("csmserve." + id, talkEl(id).value.trim()));
}
const talkUrl = (base, path) => {
  base = base.trim().replace(/\/+$/, "");
  return base.endsWith(path) ? base : (base.endsWith("/v1") ? base + path : base + "/v1" + path);
};
let talking = null; // the reply in progress: {rec, abort, turn, firstPlayAt, textSoFar}

async function transcribeBlob(blob) {
  const url = talkUrl(talkEl("talk-asr").value, "/audio/transcriptions");
  const fd = new FormData();
  fd.append("file", blob, `speech.${blob.type.includes("wav") ? "wav" : ext(blob)}`);
  fd.append("model", "whisper-1");
  let r;
  try { r = await fetch(url, { method: "POST", body: fd }); }
  catch (e) { throw new Error(`ASR endpoint ${url} is unreachable (or does not allow CORS)`); }
  if (!r.ok) throw new Error(`ASR endpoint ${url} failed: HTTP ${r.status}: ${(await r.text()).slice(0, 200)}`);
  const body = await r.json();
  return String(body.text || "").trim();
}

async function* llmPieces(messages, signal, rec) {
  const url = talkUrl(talkEl("talk-llm").value, "/chat/completions");
  let r;
  try {
    r = await fetch(url, { method: "POST", signal, headers: { "Content-Type": "application/json" },
                           body: JSON.stringify({ model: talkEl("talk-model").value.trim() || "default", messages, stream: true }) });
  } catch (e) {
    if (signal.aborted) return;
    throw new Error(`LLM endpoint ${url} is unreachable (or does not allow CORS)`);
  }
  if (!r.ok) throw new Error(`LLM endpoint ${url} failed: HTTP ${r.status}: ${(await r.text()).slice(0, 200)}`);
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = "", event = []; // an event's data lines, joined with "\n" (the SSE spec)
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, i).trim(); buf = buf.slice(i + 1);
        if (!line.startsWith("data:")) {
          if (!line && event.length) throw new Error(`LLM endpoint ${url} sent an event that is not JSON`);
          continue;
        }
        event.push(line.slice(5).trim());
        const data = event.join("\n");
        if (data === "[DONE]") return;
        let msg;
        try { msg = JSON.parse(data); } catch { continue; } // its JSON goes on in the next data line
        event = [];
        const piece = msg.choices?.[0]?.delta?.content || "";
        if (piece) { const now = performance.now(); rec.firstTokenAt ??= now; rec.lastTokenAt = now; yield piece; }
      }
    }
  } catch (e) { if (!signal.aborted) throw e; }
}

function talkPlayed(t) {
  // seconds of this reply whose playback time has passed
  if (t.firstPlayAt == null || !csm.audioContext) return 0;
  return Math.max(0, csm.audioContext.currentTime - t.firstPlayAt);
}

function bargeIn() {
  const t = talking;
  if (!t) return;
  talking = null;
  t.abort.abort();
  const received = t.turn.pcm.reduce((a, c) => a + c.length, 0);
  const keep = Math.min(received, Math.floor(talkPlayed(t) * SR / 1920) * 1920); // whole frames played
  // the sentences heard: those whose first frame played (the server's segment messages), else all that came
  const heard = t.segments.length ? t.segments.filter((g) => g.frame < keep / 1920).map((g) => g.text).join(" ")
    : t.textSoFar;
  if (current && current.turn === t.turn) { // still generating: stop it; later audio is dropped
    if (ws) ws.send(JSON.stringify({ context_id: contextId, cancel: true }));
    current = null; csm.busy = false; $("speak").disabled = false; $("stop").disabled = true;
    newContextId();
  }
  stopPlayback();
  const all = new Float32Array(received);
  let o = 0; for (const c of t.turn.pcm) { all.set(c, o); o += c.length; }
  t.turn.pcm = keep ? [all.slice(0, keep)] : [];
  t.turn.text = heard; t.turn.done = true; t.turn.finish = "barge-in";
  t.rec.interrupted = true; t.rec.playedSamples = keep; t.rec.receivedSamples = received; t.rec.heard = heard;
  // the LLM's history: only what was heard (the whole reply went in if the LLM had finished)
  if (t.historyEntry) csm.talk.history = csm.talk.history.filter((x) => x !== t.historyEntry);
  if (!keep) { csm.turns = csm.turns.filter((x) => x !== t.turn); t.turn.el?.remove(); }
  else csm.talk.history.push({ role: "assistant", content: heard });
  renderTurn(t.turn);
}

function showLatency(rec) {
  const f = (v) => (v == null ? "–" : `${v.toFixed(0)} ms`);
  talkEl("talk-latency").textContent = `end of speech → first audio ${f(rec.total)} (transcription ${f(rec.asr)}, ` +
    `LLM first token ${f(rec.llm)}, CSM first audio ${f(rec.csm)})`;
}

async function talkTurn(blob) {
  const t0 = performance.now();
  bargeIn(); // (the recording already stopped the reply when it started; this catches a late one)
  const rec = { t0, asr: null, llm: null, csm: null, total: null, interrupted: false, sent: [] };
  csm.talk.turns.push(rec);
  setStatus("talk-status", "transcribing…");
  let text;
  try { text = await transcribeBlob(blob); }
  catch (e) { rec.error = String(e.message || e); csm.talk.errors.push(rec.error); setStatus("talk-status", rec.error + " — try again", "err"); return; }
  const tAsr = performance.now(); rec.asr = tAsr - t0; rec.text = text;
  if (!text) { setStatus("talk-status", "nothing heard", "err"); return; }
  addTurn({ role: "you", text, speaker: 1, blob, done: true, pcm: [] });
  csm.talk.history.push({ role: "user", content: text });
  const turn = { role: "csm", text: "", speaker: voiceSpeaker(), pcm: [], done: false, ttfaMs: null, rtf: null };
  const t = { rec, turn, abort: new AbortController(), firstPlayAt: null, textSoFar: "", segments: [] };
  talking = t;
  setStatus("talk-status", "thinking…");
  try {
    await connect();
    newContextId(); // a fresh context_id whose context is the whole conversation as played, in order
    const first = { context_id: contextId, voice: $("voice-select").value || "alloy", context: await contextTurns(), ...settings() };
    contextFresh = false;
    let started = false;
    const messages = [{ role: "system", content: talkEl("talk-system").value }, ...csm.talk.history];
    for await (const piece of llmPieces(messages, t.abort.signal, rec)) {
      if (talking !== t) return;
      t.textSoFar += piece;
      const msg = started ? { context_id: contextId, text: piece } : { ...first, text: piece };
      if (!started) {
        rec.llm = rec.firstTokenAt - tAsr; rec.sentContext = first.context.map((c) => ({ speaker: c.speaker, text: c.text, audioBytes: c.audio ? atob(c.audio).length : 0 }));
        addTurn(turn);
        current = { turn, sentAt: performance.now(), firstAt: null, samples: 0, talk: t };
        csm.busy = true; started = true;
      }
      ws.send(JSON.stringify(msg));
    }
    if (talking !== t) return;
    if (!started) throw new Error("the LLM's reply was empty");
    turn.text = t.textSoFar;
    ws.send(JSON.stringify({ context_id: contextId, flush: true }));
    t.historyEntry = { role: "assistant", content: t.textSoFar };
    csm.talk.history.push(t.historyEntry);
    setStatus("talk-status", "speaking… (speak again to interrupt)");
  } catch (e) {
    if (talking === t) talking = null;
    rec.error = String(e.message || e); csm.talk.errors.push(rec.error);
    setStatus("talk-status", rec.error + " — the conversation goes on", "err");
    if (current && current.turn === turn && ws) ws.send(JSON.stringify({ context_id: contextId, flush: true }));
  }
}

// first audio of a talk reply: latency, and where its playback starts (for the cut at barge-in)
const talkOnAudio = onAudio;
onAudio = function (samples) { // eslint-disable-line no-func-assign
  const c = current;
  const first = c && c.talk && c.firstAt === null;
  talkOnAudio(samples);
  if (first) {
    const rec = c.talk.rec, now = performance.now();
    rec.firstAudioAt = now; rec.total = now - rec.t0; rec.csm = now - rec.firstTokenAt;
    c.talk.firstPlayAt = playHead - samples.length / SR;
    showLatency(rec);
  }
};
onSegment = function (m) { // eslint-disable-line no-func-assign
  const c = current;
  if (c && c.talk && m.context_id === contextId) c.talk.segments.push({ frame: m.frame_start, text: m.text });
};
const talkFinish = finishUtterance;
finishUtterance = function (reason, m) { // eslint-disable-line no-func-assign
  const c = current;
  talkFinish(reason, m);
  if (c && c.talk) {
    c.talk.rec.finish = reason;
    if (talking === c.talk && reason !== "eos" && reason !== "length") talking = null;
    if (reason === "error") { // the server refused the reply (its message went to the Speak panel's status too)
      const error = (m && m.error && m.error.message) || "the server refused the reply";
      c.talk.rec.error = error; csm.talk.errors.push(error);
      setStatus("talk-status", error + " — the conversation goes on", "err");
    } else if (!c.talk.rec.interrupted) {
      setStatus("talk-status", `replied: ${(c.samples / SR).toFixed(2)} s of audio`, "ok");
    }
  }
};
// the reply is "in progress" until its audio has played: a new recording then barges in
setInterval(() => {
  if (talking && !current && talking.turn.done && csm.audioContext && playHead <= csm.audioContext.currentTime) talking = null;
}, 100);

// the Talk button: press to speak (interrupts CSM), press again when done
(function () {
  const button = talkEl("talk-rec");
  let mr = null, chunks = [];
  button.addEventListener("click", async () => {
    if (mr) { mr.stop(); return; }
    audioContext();
    bargeIn();
    try {
      const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
      mr = new MediaRecorder(stream); chunks = [];
      mr.ondataavailable = (e) => e.data.size && chunks.push(e.data);
      mr.onstop = () => {
        stream.getTracks().forEach((x) => x.stop());
        const blob = new Blob(chunks, { type: mr.mimeType || "audio/webm" });
        mr = null; button.classList.remove("rec"); button.textContent = "● Talk";
        talkTurn(blob);
      };
      mr.start(); button.classList.add("rec"); button.textContent = "■ Done speaking";
    } catch (e) { fail("talk-status", new Error("microphone: " + (e.message || e))); }
  });
})();
