"use strict";
// voicebot browser client. Signalling and events follow OpenAI's Realtime WebRTC flow:
// POST the SDP offer to /v1/realtime/calls, read the answer from the body, exchange
// Realtime events on the "oai-events" data channel; audio travels as Opus tracks.

const CALLS_URL = "/v1/realtime/calls";
const SPEECH_DB = -45;   // mic RMS above this counts as the user speaking
const AUDIBLE_DB = -40;  // remote RMS above this counts as reply audio reaching the speaker
const METER_MS = 20;
const ICE_GATHER_MS = 2000;  // no trickle ICE: the offer carries its candidates
const RETRY_MS = [1000, 2000, 4000, 8000, 15000];
const MAX_EVENTS = 500;  // window.voicebot.events keeps the latest few only
const MAX_TURNS = 200;
const MAX_BUBBLES = 200;  // older messages leave the page: a long call must not grow it forever
const FINAL_CODES = new Set(["idle_timeout"]);  // the server ended the call on purpose: no retry

const $ = (id) => document.getElementById(id);
const ui = {
  body: document.body, statusText: $("status-text"),
  banner: $("banner"), bannerTitle: $("banner-title"), bannerText: $("banner-text"), retry: $("retry"),
  log: $("conversation"), empty: $("empty"), connect: $("connect"), hangup: $("hangup"),
  meterFill: $("meter-fill"), micLevel: $("mic-level"),
  voice: $("voice"), prompt: $("prompt"), access: $("access"), key: $("api-key"),
  median: $("median"), turns: $("turns"), audio: $("remote-audio"),
};

// State the page exposes for tests and for the curious (read-only by convention).
const vb = (window.voicebot = {
  state: "idle",
  states: [],   // state history, newest last
  events: [],   // Realtime events received, newest last: {t, ...event}
  turns: [],    // {n, item_id, latency_ms, end_source, audio_source}
  mic: { db: -Infinity },
  remote: { db: -Infinity, max_db: -Infinity, audible_frames: 0 },
});

let call = null;   // {pc, dc, remote: AnalyserNode|null}
let mic = null;    // {stream, analyser}, kept across reconnects, released on hang-up
let audioCtx = null;
let meterTimer = null;
let retry = { attempt: 0, timer: null };
let dialling = 0;  // bumped by each connect/hang-up: a stale attempt sees it moved on
let lastVoiceAt = 0;        // last time the local mic was above SPEECH_DB
let pendingTurn = null;     // waiting for its first reply audio
let replyId = null;         // the response whose text is streaming
const bubbles = new Map();  // item_id / response_id -> {li, text, partial}

// ---------------------------------------------------------------- states

const PHASE_TEXT = { listening: "Listening", user: "Hearing you", thinking: "Thinking…", bot: "Speaking" };
const STATE_TEXT = {
  idle: "Offline", connecting: "Connecting…", "no-mic": "No microphone", auth: "Access key needed",
  capacity: "Server busy", lost: "Reconnecting…", error: "Error",
};

function setState(state, banner = null) {
  vb.state = state;
  vb.states.push(state);
  if (vb.states.length > 50) vb.states.shift();
  ui.body.dataset.state = state;
  // While a retry is scheduled, Hang up cancels it and the banner offers "Reconnect now".
  const busy = state === "connected" || state === "connecting" || retry.timer !== null;
  ui.connect.hidden = busy;
  ui.hangup.hidden = !busy;
  ui.hangup.textContent = state === "connected" ? "Hang up" : "Cancel";
  ui.connect.textContent = state === "idle" ? "Connect" : "Try again";
  ui.banner.hidden = !banner;
  if (banner) {
    ui.bannerTitle.textContent = banner.title;
    ui.bannerText.textContent = banner.text;
  }
  ui.retry.hidden = retry.timer === null;
  if (state !== "connected") setPhase("off");
  else renderStatus();
}

function setPhase(phase) {
  ui.body.dataset.phase = phase;
  renderStatus();
}

function renderStatus() {
  const s = vb.state;
  ui.statusText.textContent = s === "connected" ? PHASE_TEXT[ui.body.dataset.phase] || "Connected" : STATE_TEXT[s];
}

// ---------------------------------------------------------------- call lifecycle

async function connect() {
  const attempt = ++dialling;
  clearTimeout(retry.timer);
  retry.timer = null;
  closeCall();
  setState("connecting");
  try {
    mic = mic || (await openMic());
  } catch (err) {
    return attempt === dialling && micFailed(err);
  }
  if (attempt !== dialling) return;  // hung up while the permission prompt was open
  const c = openCall();
  try {
    await negotiate(c);
  } catch (err) {
    if (c !== call) return;  // hung up (or restarted) meanwhile
    closeCall();
    signallingFailed(err);
  }
}

function hangUp() {
  dialling++;
  clearTimeout(retry.timer);
  retry = { attempt: 0, timer: null };
  closeCall();
  if (mic) mic.stream.getTracks().forEach((t) => t.stop());
  mic = null;
  clearInterval(meterTimer);
  meterTimer = null;
  showLevel(-Infinity);
  setState("idle");
}

async function openMic() {
  if (!navigator.mediaDevices?.getUserMedia) {
    throw Object.assign(new Error("insecure context"), { name: "InsecureContextError" });
  }
  const stream = await navigator.mediaDevices.getUserMedia({
    audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
  });
  audioCtx = audioCtx || new AudioContext();
  await audioCtx.resume();
  if (!meterTimer) meterTimer = setInterval(tick, METER_MS);
  return { stream, analyser: analyserFor(stream) };
}

function openCall() {
  const pc = new RTCPeerConnection();
  const track = mic.stream.getAudioTracks()[0];
  pc.addTrack(track, mic.stream);
  const dc = pc.createDataChannel("oai-events");
  const c = (call = { pc, dc, remote: null, final: null });
  pc.ontrack = (e) => {
    const stream = e.streams[0] || new MediaStream([e.track]);
    // Chromium only feeds a remote stream into WebAudio while a media element plays it.
    ui.audio.srcObject = stream;
    ui.audio.play().catch((err) => console.warn("reply audio blocked until the page is clicked:", err.message));
    c.remote = analyserFor(stream);
  };
  pc.onconnectionstatechange = () => {
    if (c !== call) return;
    if (pc.connectionState === "failed") lost("The network path to the server failed.");
    if (pc.connectionState === "disconnected") {
      setTimeout(() => c === call && pc.connectionState === "disconnected" && lost("The server stopped answering."), 2000);
    }
  };
  dc.onopen = () => {
    if (c !== call) return;
    retry.attempt = 0;
    setState("connected");
    setPhase("listening");
    sendSessionUpdate();
  };
  dc.onmessage = (e) => c === call && onEvent(e.data);
  dc.onclose = () => c === call && (c.final ? ended(c.final) : lost("The server closed the call."));
  return c;
}

async function negotiate(c) {
  await c.pc.setLocalDescription(await c.pc.createOffer());
  await iceGathered(c.pc);
  const headers = { "Content-Type": "application/sdp" };
  const key = ui.key.value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  const res = await fetch(CALLS_URL, { method: "POST", body: c.pc.localDescription.sdp, headers });
  if (!res.ok) throw await httpError(res);
  const sdp = await res.text();
  if (c === call) await c.pc.setRemoteDescription({ type: "answer", sdp });
}

function iceGathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => pc.iceGatheringState === "complete" && resolve();
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, ICE_GATHER_MS);
  });
}

async function httpError(res) {
  let detail = {};
  try {
    detail = (await res.json()).error || {};
  } catch { /* not JSON: the status says enough */ }
  const err = new Error(detail.message || `${res.status} ${res.statusText}`);
  return Object.assign(err, { status: res.status, code: detail.code });
}

function closeCall() {
  const c = call;
  call = null;
  pendingTurn = null;
  replyId = null;
  for (const [key, b] of bubbles) if (b.li.classList.contains("pending")) removeBubble(key);
  if (!c) return;
  c.dc.close();
  c.pc.close();
  ui.audio.srcObject = null;
  vb.remote.db = -Infinity;
}

// ---------------------------------------------------------------- failures

function micFailed(err) {
  const text = {
    NotAllowedError: "Microphone access was blocked. Allow it in the browser's site settings, then try again.",
    SecurityError: "Microphone access was blocked. Allow it in the browser's site settings, then try again.",
    NotFoundError: "No microphone was found. Plug one in, then try again.",
    NotReadableError: "The microphone is in use by another application.",
    InsecureContextError: "The browser only allows the microphone on https:// or localhost pages.",
  }[err.name] || `The microphone could not be opened (${err.message}).`;
  setState("no-mic", { title: "Microphone unavailable.", text });
}

function signallingFailed(err) {
  if (err.status === 401 || err.status === 403) {
    ui.access.open = true;
    ui.key.focus();
    setState("auth", {
      title: "Access key needed.",
      text: ui.key.value.trim()
        ? "The server did not accept this key. Check it and try again."
        : "This server requires an API key or ephemeral token. Enter it under Access key.",
    });
  } else if (err.status === 429 || err.status === 503) {
    const starting = err.code === "not_ready";
    scheduleRetry("capacity", starting ? "Server starting." : "Server busy.",
      starting ? "The models are still loading." : "All conversation slots are taken.");
  } else if (err.status) {
    setState("error", { title: "Could not connect.", text: err.message });
  } else {
    scheduleRetry("lost", "Can't reach the server.", "Check that it is running.");
  }
}

function ended(reason) {
  closeCall();
  setState("idle", { title: "Call ended.", text: reason });
}

function lost(reason) {
  closeCall();
  scheduleRetry("lost", "Connection lost.", reason);
}

function scheduleRetry(state, title, text) {
  if (retry.attempt >= RETRY_MS.length) {
    retry.timer = null;
    return setState(state, { title, text: `${text} Stopped retrying.` });
  }
  const delay = RETRY_MS[retry.attempt++];
  retry.timer = setTimeout(connect, delay);
  setState(state, { title, text: `${text} Retrying in ${Math.round(delay / 1000)} s…` });
}

// ---------------------------------------------------------------- events

function send(event) {
  if (call?.dc.readyState === "open") call.dc.send(JSON.stringify(event));
}

function sendSessionUpdate() {
  const session = {
    type: "realtime",
    audio: { input: { turn_detection: { type: "server_vad", create_response: true, interrupt_response: true } } },
  };
  const instructions = ui.prompt.value.trim();
  if (instructions) session.instructions = instructions;
  if (ui.voice.value) session.audio.output = { voice: ui.voice.value };
  send({ type: "session.update", session });
}

function onEvent(data) {
  let e;
  try {
    e = JSON.parse(data);
  } catch {
    return console.warn("ignored a malformed event");
  }
  vb.events.push({ t: Math.round(performance.now()), ...e });
  if (vb.events.length > MAX_EVENTS) vb.events.shift();
  const now = performance.now();

  switch (e.type) {
    case "input_audio_buffer.speech_started":
      pendingTurn = null;  // the user went on talking: no reply is due yet
      userBubble(e.item_id);
      setPhase("user");
      break;
    case "input_audio_buffer.speech_stopped":
      startTurn(e.item_id, now);
      setPhase("thinking");
      break;
    case "conversation.item.input_audio_transcription.delta": {
      const b = userBubble(e.item_id);
      b.partial += e.delta || "";
      render(b, b.partial, true);
      break;
    }
    case "conversation.item.input_audio_transcription.completed": {
      const b = userBubble(e.item_id);
      const text = (e.transcript || "").trim();
      if (text) render(b, text, false);
      else removeBubble(e.item_id);
      break;
    }
    case "response.created":
      replyId = e.response?.id ?? null;
      if (!pendingTurn) startTurn(null, now);  // a server that sends no speech_stopped
      break;
    case "response.output_audio_transcript.delta":
      if (e.response_id === replyId) {
        const b = botBubble(e.response_id);
        b.text += e.delta || "";
        render(b, b.text, true);
      }
      break;
    case "response.output_audio_transcript.done":
      if (e.response_id === replyId && e.transcript) render(botBubble(e.response_id), e.transcript, false);
      break;
    case "output_audio_buffer.started":
      if (pendingTurn) pendingTurn.started = now;
      setPhase("bot");
      break;
    case "output_audio_buffer.stopped":
      if (pendingTurn?.started) finishTurn(pendingTurn.started, "playback-event");
      setPhase("listening");
      break;
    case "output_audio_buffer.cleared":  // barge-in: the server flushed the reply
      interrupted(e.response_id || replyId);
      replyId = null;
      setPhase("user");
      break;
    case "response.done": {
      const r = e.response || {};
      if (r.status && r.status !== "completed") interrupted(r.id);
      else if (bubbles.has(r.id)) render(bubbles.get(r.id), bubbles.get(r.id).text, false);
      if (r.id === replyId) replyId = null;
      if (ui.body.dataset.phase === "thinking") setPhase("listening");
      break;
    }
    case "error":
      if (e.error?.param?.endsWith("voice")) {
        ui.voice.value = "";  // the server does not offer it; its default voice stays
        systemNote("This server does not offer that voice; using its default voice.");
      } else {
        systemNote(e.error?.message || "The server reported an error.");
      }
      if (FINAL_CODES.has(e.error?.code)) call.final = e.error.message || e.error.code;
      break;
  }
}

// ---------------------------------------------------------------- conversation view

function bubble(key, who) {
  let b = bubbles.get(key);
  if (!b) {
    const li = document.createElement("li");
    li.className = `msg ${who} pending`;
    li.dataset.item = key;
    li.innerHTML = `<span class="who">${who === "user" ? "You" : "Assistant"}</span><p class="text"></p>`;
    b = { li, text: "", partial: "" };
    append(li);
    bubbles.set(key, b);
    ui.empty.hidden = true;
    scrollDown();
  }
  return b;
}

const userBubble = (id) => bubble(id, "user");
const botBubble = (id) => bubble(id, "bot");

function render(b, text, partial) {
  b.li.querySelector(".text").textContent = text;
  b.li.classList.toggle("partial", partial);
  b.li.classList.remove("pending");
  if (!partial) b.li.dataset.final = "true";
  scrollDown();
}

function removeBubble(key) {
  bubbles.get(key)?.li.remove();
  bubbles.delete(key);
}

function interrupted(key) {
  const b = bubbles.get(key);
  if (!b) return;
  if (!b.text) return removeBubble(key);
  b.li.classList.add("interrupted");
  render(b, b.text, false);
}

function systemNote(text) {
  const li = document.createElement("li");
  li.className = "msg system";
  li.textContent = text;
  append(li);
  ui.empty.hidden = true;
  scrollDown();
}

function append(li) {
  ui.log.append(li);
  while (ui.log.children.length > MAX_BUBBLES + 1) {  // + the hidden empty-state item
    const old = ui.empty.nextElementSibling;
    if (old.dataset.item) bubbles.delete(old.dataset.item);
    old.remove();
  }
}

function scrollDown() {
  ui.log.scrollTop = ui.log.scrollHeight;
}

// ---------------------------------------------------------------- levels and latency

function analyserFor(stream) {
  const node = audioCtx.createAnalyser();
  node.fftSize = 1024;
  audioCtx.createMediaStreamSource(stream).connect(node);
  return node;
}

const samples = new Float32Array(1024);
function levelDb(analyser) {
  analyser.getFloatTimeDomainData(samples);
  let sum = 0;
  for (const s of samples) sum += s * s;
  return 10 * Math.log10(sum / samples.length + 1e-12);
}

function tick() {
  const now = performance.now();
  if (mic) {
    const db = levelDb(mic.analyser);
    vb.mic.db = db;
    if (db > SPEECH_DB) lastVoiceAt = now;
    showLevel(db);
  }
  if (call?.remote) {
    const db = levelDb(call.remote);
    vb.remote.db = db;
    vb.remote.max_db = Math.max(vb.remote.max_db, db);
    if (db > AUDIBLE_DB) {
      vb.remote.audible_frames++;
      if (pendingTurn) finishTurn(now, "audio-level");
    }
  }
}

function showLevel(db) {
  const frac = Math.min(1, Math.max(0, (db + 60) / 60));
  ui.meterFill.style.transform = `scaleX(${frac})`;
  ui.micLevel.value = Math.max(-60, db);
}

function startTurn(itemId, now) {
  // Prefer the mic's own silence onset: speech_stopped arrives after the server's VAD hangover.
  const fromMic = lastVoiceAt && now - lastVoiceAt < 3000;
  pendingTurn = { item_id: itemId, end: fromMic ? lastVoiceAt : now, end_source: fromMic ? "mic" : "vad" };
}

function finishTurn(at, source) {
  const t = pendingTurn;
  pendingTurn = null;
  const turn = {
    n: vb.turns.length + 1, item_id: t.item_id, latency_ms: Math.round(at - t.end),
    end_source: t.end_source, audio_source: source,
  };
  vb.turns.push(turn);
  if (vb.turns.length > MAX_TURNS) vb.turns.shift();
  const li = document.createElement("li");
  li.innerHTML = `<span>Turn ${turn.n}</span><span class="bar"><i></i></span><span class="ms"></span>`;
  li.querySelector(".ms").textContent = `${turn.latency_ms} ms`;
  li.querySelector("i").style.width = `${Math.min(100, turn.latency_ms / 30)}%`;  // 3 s = full bar
  ui.turns.prepend(li);
  const sorted = vb.turns.map((x) => x.latency_ms).sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  ui.median.classList.remove("none");
  ui.median.textContent = sorted.length % 2 ? sorted[mid] : Math.round((sorted[mid - 1] + sorted[mid]) / 2);
}

// The server's own voice list, where /healthz offers one; else the page's short list stays.
async function loadVoices() {
  try {
    const { voices } = await (await fetch("/healthz")).json();
    if (!Array.isArray(voices) || !voices.length) return;
    const options = voices.slice(0, 50).map((v) => new Option(v, v));
    ui.voice.replaceChildren(new Option("Server default", ""), ...options);
  } catch { /* no list: keep the defaults */ }
}

// ---------------------------------------------------------------- wiring

loadVoices();

$("access-form").addEventListener("submit", (e) => {
  e.preventDefault();  // Enter in the key field: connect with it
  if (!call) ui.connect.click();
});
ui.connect.addEventListener("click", () => {
  retry.attempt = 0;
  connect();
});
ui.retry.addEventListener("click", connect);
ui.hangup.addEventListener("click", hangUp);
ui.voice.addEventListener("change", sendSessionUpdate);
ui.prompt.addEventListener("change", sendSessionUpdate);
window.addEventListener("pagehide", hangUp);
