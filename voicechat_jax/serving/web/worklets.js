// AudioWorklet processors of the browser page (see app.js).
//
// "capture": the microphone, cut into 80 ms frames (at the context's rate) and posted to the page,
// which sends each as one input_audio_buffer.append. The audio clock paces the frames.
//
// "playback": a jitter buffer. Received audio is queued; playback starts once `prebufferMs` of
// audio is there, and an empty buffer while playing is an underrun: silence is played and the
// buffer fills to `prebufferMs` again before playing resumes. Stats are posted every 250 ms.

class Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.frame = new Float32Array(options.processorOptions.frameSamples);
    this.n = 0;
  }

  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (input) {
      let i = 0;
      while (i < input.length) {
        const k = Math.min(input.length - i, this.frame.length - this.n);
        this.frame.set(input.subarray(i, i + k), this.n);
        this.n += k;
        i += k;
        if (this.n === this.frame.length) {
          this.port.postMessage(this.frame.slice());
          this.n = 0;
        }
      }
    }
    return true;
  }
}

class Playback extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const rate = options.processorOptions.sampleRate;
    this.prebuffer = Math.round((options.processorOptions.prebufferMs / 1000) * rate);
    this.ring = new Float32Array(rate * 4); // 4 s: a bound on what a burst can queue
    this.read = 0;
    this.size = 0;
    this.playing = false;
    this.underruns = 0;
    this.overflow = 0;
    this.sinceStats = 0;
    this.rate = rate;
    this.port.onmessage = (e) => this.push(e.data);
  }

  push(chunk) {
    for (let i = 0; i < chunk.length; i++) {
      if (this.size === this.ring.length) {
        this.read = (this.read + 1) % this.ring.length; // full: drop the oldest
        this.size--;
        this.overflow++;
      }
      this.ring[(this.read + this.size) % this.ring.length] = chunk[i];
      this.size++;
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing && this.size >= this.prebuffer) this.playing = true;
    for (let i = 0; i < out.length; i++) {
      if (this.playing && this.size > 0) {
        out[i] = this.ring[this.read];
        this.read = (this.read + 1) % this.ring.length;
        this.size--;
      } else {
        if (this.playing) {
          this.playing = false;
          this.underruns++;
        }
        out[i] = 0;
      }
    }
    this.sinceStats += out.length;
    if (this.sinceStats >= this.rate / 4) {
      this.sinceStats = 0;
      this.port.postMessage({
        bufferedMs: (1000 * this.size) / this.rate,
        underruns: this.underruns,
        overflow: this.overflow,
        playing: this.playing,
      });
    }
    return true;
  }
}

registerProcessor("capture", Capture);
registerProcessor("playback", Playback);
