// The browser page: live calls over /v1/realtime (docs/protocol.md), one after another.
//
// The microphone goes through the "capture" AudioWorklet in 80 ms frames of PCM16 at 24 kHz; the
// agent's audio through the "playback" worklet, a 100 ms jitter buffer. The page shows the
// caller's transcript, the agent's text, the beat latency (voicechat.beat events) and the audio
// stats. window.voicechat holds the same figures (of the current or last call) for tests.
//
// The page offers the "realtime" subprotocol and, when the key field is filled, the key as the
// subprotocol "openai-insecure-api-key.KEY" (a browser cannot set an Authorization header).

(() => {
  const RATE = 24000;
  const FRAME_SAMPLES = (RATE * 80) / 1000;
  const PREBUFFER_MS = 100;
  // The stream's audio: a response's, and between responses (the extensions on) the rest.
  const AUDIO_EVENTS = new Set(["response.output_audio.delta", "voicechat.output_audio.delta"]);
  const $ = (id) => document.getElementById(id);

  const stats = {
    state: "idle",
    calls: 0,
    sessionId: null,
    endReason: null,
    deltas: 0,
    audioSamples: 0,
    arrivals: [], // ms, performance.now() of each audio delta (the last 2000)
    beats: 0,
    latencyLastMs: null,
    latencyMaxMs: null,
    missed: 0,
    sent: 0,
    events: {},
    errors: [],
    underruns: 0,
    bufferedMs: 0,
    callerText: "",
    agentText: "",
    reset() {
      Object.assign(this, {
        sessionId: null, endReason: null, deltas: 0, audioSamples: 0, arrivals: [], beats: 0,
        latencyLastMs: null, latencyMaxMs: null, missed: 0, sent: 0, events: {}, errors: [],
        underruns: 0, bufferedMs: 0, callerText: "", agentText: "",
      });
    },
    intervals() {
      const a = this.arrivals;
      const out = [];
      for (let i = 1; i < a.length; i++) out.push(a[i] - a[i - 1]);
      return out;
    },
    snapshot() {
      const iv = this.intervals();
      const mean = iv.length ? iv.reduce((x, y) => x + y, 0) / iv.length : null;
      const dev = iv.map((x) => Math.abs(x - 80)).sort((x, y) => x - y);
      return {
        state: this.state,
        calls: this.calls,
        sessionId: this.sessionId,
        endReason: this.endReason,
        deltas: this.deltas,
        audioSamples: this.audioSamples,
        meanIntervalMs: mean,
        jitterP95Ms: dev.length ? dev[Math.floor(0.95 * (dev.length - 1))] : null,
        beats: this.beats,
        latencyLastMs: this.latencyLastMs,
        latencyMaxMs: this.latencyMaxMs,
        missed: this.missed,
        sent: this.sent,
        events: { ...this.events },
        errors: [...this.errors],
        underruns: this.underruns,
        bufferedMs: this.bufferedMs,
        callerText: this.callerText,
        agentText: this.agentText,
      };
    },
  };
  window.voicechat = stats;

  let ws = null;
  let ctx = null;
  let media = null;
  let playback = null;

  function setStatus(text) {
    $("status").textContent = text;
  }

  function log(line) {
    const div = document.createElement("div");
    div.textContent = line;
    const box = $("log");
    box.prepend(div);
    while (box.childNodes.length > 60) box.removeChild(box.lastChild);
  }

  function words(event) {
    // The decoded text; without a tokenizer on the server, the raw ids (voicechat.ids).
    if (event.delta) return event.delta;
    const ids = event.voicechat && event.voicechat.ids;
    return ids && ids.length ? `[${ids.join(" ")}] ` : "";
  }

  function toBase64(int16) {
    const bytes = new Uint8Array(int16.buffer);
    let s = "";
    for (let i = 0; i < bytes.length; i += 0x8000) {
      s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(s);
  }

  function fromBase64(b64) {
    const s = atob(b64);
    const bytes = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
    const pcm = new Int16Array(bytes.buffer);
    const out = new Float32Array(pcm.length);
    for (let i = 0; i < pcm.length; i++) out[i] = pcm[i] / 32768;
    return out;
  }

  function render() {
    const s = stats.snapshot();
    $("lat-last").textContent = s.latencyLastMs == null ? "-" : s.latencyLastMs.toFixed(1);
    $("lat-max").textContent = s.latencyMaxMs == null ? "-" : s.latencyMaxMs.toFixed(1);
    $("missed").textContent = s.missed;
    $("deltas").textContent = s.deltas;
    $("interval").textContent = s.meanIntervalMs == null ? "-" : s.meanIntervalMs.toFixed(1);
    $("jitter").textContent = s.jitterP95Ms == null ? "-" : s.jitterP95Ms.toFixed(1);
    $("buffered").textContent = s.bufferedMs.toFixed(0);
    $("underruns").textContent = s.underruns;
    $("sent").textContent = s.sent;
    show($("caller"), s.callerText);
    show($("agent"), s.agentText);
  }

  function show(box, text) {
    // Follows the newest words, unless the reader has scrolled up to read older ones.
    if (box.textContent === text) return;
    const atEnd = box.scrollTop + box.clientHeight >= box.scrollHeight - 24;
    box.textContent = text;
    if (atEnd) box.scrollTop = box.scrollHeight;
  }

  function onEvent(event) {
    const type = event.type;
    stats.events[type] = (stats.events[type] || 0) + 1;
    switch (type) {
      case "session.created":
        stats.state = "connected";
        stats.sessionId = event.session.id;
        setStatus(`connected: ${event.session.id} (slot ${event.session.voicechat.slot})`);
        log(`${type} ${event.session.id}`);
        break;
      case "response.output_audio.delta":
      case "voicechat.output_audio.delta": {
        const audio = fromBase64(event.delta);
        stats.deltas++;
        stats.audioSamples += audio.length;
        stats.arrivals.push(performance.now());
        if (stats.arrivals.length > 2000) stats.arrivals.shift();
        if (playback) playback.port.postMessage(audio, [audio.buffer]);
        break;
      }
      case "voicechat.beat":
        stats.beats++;
        stats.latencyLastMs = event.latency_ms;
        stats.latencyMaxMs = Math.max(stats.latencyMaxMs || 0, event.latency_ms);
        if (event.missed) stats.missed++;
        break;
      case "response.output_audio_transcript.delta":
        stats.agentText = (stats.agentText + words(event)).slice(-4000);
        break;
      case "conversation.item.input_audio_transcription.delta":
        stats.callerText = (stats.callerText + words(event)).slice(-4000);
        break;
      case "conversation.item.input_audio_transcription.completed":
        stats.callerText += "\n";
        log(type);
        break;
      case "response.done":
        stats.agentText += "\n";
        log(`${type} ${event.response.status}`);
        break;
      case "error":
        stats.errors.push(event.error.code);
        log(`error ${event.error.code}: ${event.error.message}`);
        break;
      case "voicechat.session.ended":
        stats.endReason = event.reason;
        log(`${type} ${event.reason}`);
        break;
      default:
        log(type);
    }
  }

  async function start() {
    $("start").disabled = true;
    stats.reset();
    stats.calls++;
    stats.state = "connecting";
    setStatus("connecting");
    ctx = new AudioContext({ sampleRate: RATE });
    await ctx.audioWorklet.addModule("/static/worklets.js");
    media = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: false },
    });
    const mic = ctx.createMediaStreamSource(media);
    const capture = new AudioWorkletNode(ctx, "capture", {
      processorOptions: { frameSamples: FRAME_SAMPLES },
    });
    playback = new AudioWorkletNode(ctx, "playback", {
      processorOptions: { sampleRate: ctx.sampleRate, prebufferMs: PREBUFFER_MS },
      outputChannelCount: [1],
    });
    playback.port.onmessage = (e) => {
      stats.underruns = e.data.underruns;
      stats.bufferedMs = e.data.bufferedMs;
    };
    playback.connect(ctx.destination);
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const key = $("key").value.trim();
    const protocols = key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"];
    ws = new WebSocket(`${scheme}://${location.host}/v1/realtime?voicechat=1`, protocols);
    ws.onmessage = (m) => onEvent(JSON.parse(m.data));
    ws.onclose = (e) => {
      const opened = stats.state !== "connecting";
      stats.state = "closed";
      const why = opened ? stats.endReason || e.reason || "closed" : "could not connect";
      setStatus(`ended (${why}, code ${e.code})`);
      capture.port.onmessage = null;
      hangUp();
    };
    ws.onopen = () => {
      const rate = ctx.sampleRate;
      ws.send(JSON.stringify({
        type: "session.update",
        session: { voicechat: { events: true, input_sample_rate: rate, output_sample_rate: rate } },
      }));
    };
    capture.port.onmessage = (e) => {
      if (!ws || ws.readyState !== WebSocket.OPEN || stats.state !== "connected") return;
      const x = e.data;
      const pcm = new Int16Array(x.length);
      for (let i = 0; i < x.length; i++) pcm[i] = Math.max(-1, Math.min(1, x[i])) * 32767;
      ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: toBase64(pcm) }));
      stats.sent++;
    };
    mic.connect(capture);
    $("stop").disabled = false;
  }

  function stop() {
    if (ws && ws.readyState === WebSocket.OPEN) {
      ws.send(JSON.stringify({ type: "voicechat.session.close" }));
    }
    if (media) media.getTracks().forEach((t) => t.stop());
  }

  function hangUp() {
    // The call's audio and microphone let go, so that the next call starts afresh.
    if (media) media.getTracks().forEach((t) => t.stop());
    if (ctx) ctx.close().catch(() => {});
    media = null;
    ctx = null;
    playback = null;
    ws = null;
    $("stop").disabled = true;
    $("start").disabled = false;
    $("start").textContent = "Start another call";
  }

  $("start").onclick = () => start().catch((e) => {
    stats.state = "error";
    stats.errors.push(String(e));
    setStatus(`error: ${e}`);
    hangUp();
  });
  $("stop").onclick = stop;
  setInterval(render, 250);
})();
