// The page's Dialogue panel: a [S1]/[S2] script as ONE POST /v1/audio/speech (SSE, pcm, add_timestamps),
// its PCM played as it arrives, each line shown as a caption when its audio plays (speech.audio.segment
// events: exact start/end from frame counts). window.csm.dialogue exposes counters for tests.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const d = (window.csm.dialogue = { busy: false, samples: 0, segments: [], errors: [], done: null });
  let abort = null;

  function fillVoices() {  // the page's voice list, once loaded
    const src = $("voice-select");
    for (const [id, pick] of [["dialogue-s1", 0], ["dialogue-s2", 1]]) {
      const sel = $(id), keep = sel.value;
      sel.innerHTML = "";
      const none = document.createElement("option"); none.value = ""; none.textContent = "(no clip)"; sel.appendChild(none);
      for (const o of src.querySelectorAll("option")) {
        if (o.dataset.type === "alias") continue;
        const c = document.createElement("option"); c.value = o.value; c.textContent = o.textContent; sel.appendChild(c);
      }
      sel.value = [...sel.options].some((o) => o.value === keep) ? keep : "";
    }
  }
  new MutationObserver(fillVoices).observe($("voice-select"), { childList: true, subtree: true });
  fillVoices();  // app.js may have loaded the list before this script ran: no mutation would come then

  function caption(seg, startAt) {  // shown while its audio plays: the timestamps say when
    const ac = window.csm.audioContext;
    const show = () => {
      const el = $("dialogue-caption");
      el.innerHTML = "";
      const who = document.createElement("span"); who.className = "who"; who.textContent = `S${seg.speaker + 1}`;
      el.append(who, document.createTextNode(seg.text));
    };
    const wait = startAt + seg.audio_start_ms / 1000 - ac.currentTime;
    setTimeout(show, Math.max(0, wait * 1000));
  }

  async function playDialogue() {
    if (d.busy) return;
    const script = $("dialogue-script").value.trim();
    if (!script) return;
    audioContext();  // inside the click: audio may start
    d.busy = true; d.samples = 0; d.segments = []; d.done = null;
    $("dialogue-play").disabled = true; $("dialogue-stop").disabled = false;
    $("dialogue-status").textContent = "generating…"; $("dialogue-status").className = "status";
    abort = new AbortController();
    const voices = [$("dialogue-s1").value || null, $("dialogue-s2").value || null];
    const body = { model: "tts-1", voice: "alloy", input: script, voices, response_format: "pcm", stream_format: "sse",
                   add_timestamps: true, ...settings() };
    delete body.output_format;
    let startAt = null, carry = "", odd = new Uint8Array(0);
    try {
      const r = await fetch("/v1/audio/speech", { method: "POST", signal: abort.signal,
        headers: { "Content-Type": "application/json", ...authHeaders() }, body: JSON.stringify(body) });
      if (!r.ok) throw new Error((await r.json()).error?.message || `${r.status}`);
      const reader = r.body.getReader(), dec = new TextDecoder();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        carry += dec.decode(value, { stream: true });
        let i;
        while ((i = carry.indexOf("\n\n")) >= 0) {
          const line = carry.slice(0, i); carry = carry.slice(i + 2);
          if (!line.startsWith("data: ")) continue;
          const ev = JSON.parse(line.slice(6));
          if (ev.type === "speech.audio.delta") {
            const raw = Uint8Array.from(atob(ev.audio), (c) => c.charCodeAt(0));
            const bytes = new Uint8Array(odd.length + raw.length); bytes.set(odd); bytes.set(raw, odd.length);
            const n = bytes.length >> 1; odd = bytes.slice(2 * n);
            const view = new DataView(bytes.buffer), pcm = new Float32Array(n);
            for (let k = 0; k < n; k++) pcm[k] = view.getInt16(2 * k, true) / 32767;
            if (n) {
              const end = play(pcm);
              if (startAt === null) startAt = end - pcm.length / 24000;
              d.samples += n;
            }
          } else if (ev.type === "speech.audio.segment") {
            d.segments.push(ev);
            if (startAt !== null) caption(ev, startAt);
          } else if (ev.type === "speech.audio.done") d.done = ev;
          else if (ev.type === "error") throw new Error(ev.error.message);
        }
      }
      $("dialogue-status").textContent = `${(d.samples / 24000).toFixed(2)} s of audio, ${d.segments.length} segments`;
      $("dialogue-status").className = "status ok";
    } catch (e) {
      if (e.name !== "AbortError") { d.errors.push(String(e.message || e)); $("dialogue-status").textContent = String(e.message || e); $("dialogue-status").className = "status err"; }
    } finally {
      d.busy = false; abort = null; $("dialogue-play").disabled = false; $("dialogue-stop").disabled = true;
    }
  }
  $("dialogue-play").addEventListener("click", playDialogue);
  $("dialogue-stop").addEventListener("click", () => { if (abort) abort.abort(); stopPlayback(); });
})();
