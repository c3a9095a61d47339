#!/usr/bin/env bash
# Regenerates speech_16k.wav, the server's embedded default input: a short English utterance
# synthesised with espeak-ng, resampled to 16 kHz mono PCM16 with sox (no dither, so a rerun with
# the same tool versions gives the same bytes).
#
# Needs: espeak-ng and sox (Debian/Ubuntu: apt-get install -y espeak-ng sox).
# Usage: voicechat_jax/assets/make_speech.sh [output.wav]    (default: speech_16k.wav beside this script)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/speech_16k.wav}"
text="Hello, can you hear me? I would like to book a table for two tomorrow evening."

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

espeak-ng -v en-us -s 165 -p 50 -a 120 -w "$tmp/raw.wav" "$text"
sox "$tmp/raw.wav" -D -r 16000 -c 1 -b 16 -e signed-integer "$out" norm -3
soxi "$out"
