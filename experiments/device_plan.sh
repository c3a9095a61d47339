#!/usr/bin/env bash
# Queues docs/roadmap.md's next device call on the machine that came, in the roadmap's order:
# the most needed figures first, so that a call cut short by the device time keeps them.
#
#   EXPERIMENTS_COMMIT=<short HEAD here> experiments/device_plan.sh   # then: device_queue.sh wait N
#
# The slot counts follow the card, read from nvidia-smi: an H200 (over 100 GB) takes the
# issues' targets, an H100 the points its memory holds and its rows of 2026-12-05 left open
# (docs/roadmap.md). Every command appends
# its output to one log and its rows to one file per experiment under $QUEUE_ROWS, so that a
# `wait` brings back at most 8 files (the device tool's limit). Run it from the repository root,
# after the wheels are installed (experiments/device_wheels.sh).
set -euo pipefail
: "${EXPERIMENTS_COMMIT:?set EXPERIMENTS_COMMIT to the commit sent (git rev-parse --short HEAD)}"
# The device's copy of the tree keeps the git metadata of an older commit: a commit read there
# names that one, not the tree sent (2026-12-06: rows of 69f4165 written as 0ced39c).
if [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] &&
  [[ "$EXPERIMENTS_COMMIT" == "$(git rev-parse --short HEAD 2>/dev/null)" ]]; then
  echo "EXPERIMENTS_COMMIT=$EXPERIMENTS_COMMIT is this copy's stale HEAD: pass the commit sent" >&2
  exit 2
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
R='$QUEUE_ROWS'  # expanded by the queue, which exports it
log=">> $R/logs.txt 2>&1"
cap="python3 experiments/capacity/serve.py --out=$R/capacity.jsonl"
profile="python3 experiments/tick_profile/run.py --ticks=1 --probe_ticks=5 --commit=$EXPERIMENTS_COMMIT"
unbuffered="--xla_enable_command_buffers_during_profiling=false"
prof="XLA_FLAGS=$unbuffered $profile"
keep_profile() {  # the profile's rows and table, appended to one file each (rows name the run)
  echo "cat /tmp/tp_$1/rows.jsonl >> $R/tick_profile.jsonl; cat /tmp/tp_$1/table.md >> $R/tick_profile.md"
}
h200=$((mem > 100000))
slots=$((h200 ? 96 : 40))  # issue 33's target on an H200; what an H100 holds
# Measured out on an H100 on 2026-12-06 (1f16f00) and no longer queued: XLA's stream annotation
# hides nothing of the codec beside the speech decoder (experiments/stream_overlap), and
# whole-graph command buffers do not shorten the dispatch loop's call (experiments/dispatch_cost).
# every cache held full (issue 33's setting); the streamed codec (--codec_stream) is not
# queued: on an H100 at 40 slots it gave the same outputs 4 % slower (2026-12-06, 4f89c42)
full="--hold_full=true --slots=$slots"
# experiments/role_split (stand-ins of the two kinds of work in one launch) ran on an H100 at
# ad5eda7 and is no longer queued: attention_product below measures the same with the tick's
# own attention kernel and products.
# issue 33, step 4 with the tick's own attention kernel: the speech decoder's attention at 96
# sessions beside each of the first frame's codec products and the backbone's, in one launch
# (experiments/attention_product, added 2026-12-06; a few minutes; on either card: the first
# GPU rows of pallas_kernels/attention_product.py)
# (and, after the tick profiles, the largest products again at 2 stages: compiled for sm_90a here, one launch at the
# 64 x 64 x 32 product tile takes 188 registers a thread at 2 stages and 130 at 3, the launch's
# default, against the attention's 134 alone; README)
fused="python3 experiments/attention_product/run.py --slots=96 --out=$R/attention_product.jsonl \
$log"
stages2="python3 experiments/attention_product/run.py --slots=96 --num_stages=2 \
--products=codec_pw1_3_half,codec_pw2_3_half,codec_pw1_2,tts_gate_up --label=stages2 \
--out=$R/attention_product.jsonl $log"
# Measured out on an H100 on 2026-12-07 (b42282b) and no longer queued: pallas_kernels.matmul's
# 'tf32x3' (three TF32 passes a D step, the steps summed on the FMA units) is more exact than full
# fp32 on every fp32 product of the 96-slot tick but 0.24-0.66x its speed (1.04x on one), at any
# row block or step (experiments/fp32_products/results/h100_k3_96.jsonl), and the tick under
# --policy=pallas_tf32x3 took 137.6 ms against 103.5 at 40 slots (experiments/tick_profile).
# issue 33, step 2 (added 2026-12-07, 21:50 UTC): XLA's three-pass TF32 preset was less exact
# than full fp32 on the codec's shapes (2026-12-06) and our own compensated kernel, exact, was
# 0.24-0.66x its speed (above). The same sums through cuBLAS: each contraction cut into steps of
# 128 or 256 rows, each step under the preset in one batched dot, the steps added by a Kahan sum
# in fp32 (experiments/fp32_products, <algorithm>_c<N>). Exact where the preset was not, and
# faster than full fp32? About 4 minutes; on either card.
chunked="python3 experiments/fp32_products/run.py --slots=96 --shapes=tts,mog,enc,codec \
--algorithms=float32,TF32_TF32_F32_X3_c128,TF32_TF32_F32_X3_c256 \
--out=$R/fp32_products.jsonl $log"
# issue 33, step 4 in the tick: the reference tick, then the codec's products in the speech
# decoder's attention launches a frame behind (codec_in_attention, 2026-12-06, and
# codec_frame_behind, 2026-12-07: 56 fused launches at 11B, the audio 80 ms later), every cache
# full, on the same machine. On an H100 at 40 slots (2026-12-07, b42282b) neither form hid the
# codec: kernels 84.4 ms (in attention) and 82.5 (a frame behind) busy against 85.2, the tick
# 110.8 and 101.6 ms (probes 97.7-108.2) against 103.5; the H200's 96 slots, where the attention
# is longer, are what is left to ask. The fused launch needs the speech decoder's G = 1 kernel,
# the auto choice from 56 slots: below that (40 on an H100) both profiles ask for it, so that
# they differ in the codec's place only (without it, 0 fused launches at 40:
# experiments/lower_for_cuda.py).
g1=$((slots >= 56 ? 0 : 1))
if ((g1)); then full+=" --tts_attention=pallas_mha"; fi
reference="$prof $full --out_dir=/tmp/tp_ref_$slots $log; $(keep_profile ref_$slots)"
beside="$reference; \
$prof $full --codec_in_attention --codec_frame_behind --out_dir=/tmp/tp_cfb_$slots $log; \
$(keep_profile cfb_$slots)"
# then the tick under tf32x3_steps (added 2026-12-07, 22:35 UTC): the encoder's, the speech
# decoder's and the codec's fp32 products as the chunked products above, in steps of up to 256
# rows (common.dense_in_steps), against the reference tick on the same machine; its digests say
# whether the tokens and codes move. Worth reading only if the products above were as exact as
# full fp32 on every shape. (On an H100 the reference tick runs alone first.)
steps="$prof $full --policy=tf32x3_steps --out_dir=/tmp/tp_steps_$slots $log; \
$(keep_profile steps_$slots)"
if ((h200)); then  # an H200 (2026-12-05, a6cb770: 80 faithful and 112 bf16 held, dispatch)
  # issue 30 first: the resident loop (the default on one device since fa8f3ea, chosen on
  # H100s) at the target's count, against the dispatch loop's 127.0 ms p99 of 2026-12-05; then
  # issue 33's overlap in the tick and at the kernel (on an H100 at 40 slots, 2026-12-07, it hid
  # nothing: above); then the aims (96 faithful, 128 bf16) on the default loop, and issue 33's
  # tick at 112.
  cmds=("$cap --sessions=80 --policies=reference --loops=resident $log" "$chunked" "$beside")
  cmds+=("$steps" "$fused")
  cmds+=("$stages2")
  # a second start of the same point: its resident loop loaded from the cache (callback_cache,
  # 88f9fa3) instead of compiled; the row's compile_s says how long the load took (4 s of
  # serving: the row holds nothing, by --min_ticks)
  cmds+=("$cap --sessions=80 --policies=reference --loops=resident --seconds=4 $log")
  # issue 30's aims on the default loop, then issue 33's tick at 112 (the products' candidates
  # were measured on an H100 on 2026-12-06 and are not queued: three TF32 passes are less exact
  # than full fp32 on the codec's shapes; experiments/fp32_products)
  last=("$cap --sessions=96 --policies=reference --loops=resident $log"
    "$cap --sessions=128 --policies=bf16_tts_kv_tf32x3_codec --loops=resident $log"
    # issue 33's second target (135 ms at 112), which the memory plan admits since 2710080
    "$prof --hold_full=true --slots=112 --out_dir=/tmp/tp_112 $log; $(keep_profile 112)")
else  # an H100 (2026-12-06: 84 bf16 held on the resident loop at ad5eda7, p99 118.4, and on the
  # dispatch loop at 0ced39c on another machine, p99 134.7; 51 faithful on both loops at
  # 94d43d0; its second start loaded the resident loop in 13.2 s; 92 bf16 do not fit, 85 do)
  # the 84-session bf16 pair on one machine, which the rows lack: dispatch, then resident
  cmds=("$chunked" "$reference" "$steps" "$fused" "$stages2")
  cmds+=("$cap --sessions=84 --policies=bf16_tts_kv_tf32x3_codec --loops=dispatch $log")
  cmds+=("$cap --sessions=84 --policies=bf16_tts_kv_tf32x3_codec --loops=resident $log")
  last=()
fi
cmds+=("${last[@]}")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
experiments/device_queue.sh start "${cmds[@]}"
