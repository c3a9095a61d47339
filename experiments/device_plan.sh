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
# every cache held full (issue 33's setting); the streamed codec (--codec_stream) is not
# queued: on an H100 at 40 slots it gave the same outputs 4 % slower (2026-12-06, 4f89c42)
full="--hold_full=true --slots=$slots"
if ((h200)); then  # an H200 (2026-12-05, a6cb770: 80 faithful and 112 bf16 held, dispatch)
  # issue 30: the resident loop at the target's count (cut off on 2026-12-05), to choose the
  # default loop; then issue 33's tick and products, then the aims on the dispatch
  # loop, whose pickup now copies one packed array.
  cmds=("$cap --sessions=80 --policies=reference --loops=resident $log")
  # issue 33: full-fp32 products in our own Triton kernel against cuBLAS at the tick's rows
  fp32="python3 experiments/fp32_products/run.py --out=$R/fp32_products.jsonl --slots=$slots"
  # issue 30's host bound on the dispatch loop: the call's launches with XLA's default command
  # buffers, and with every kind of thunk the flag names in them, no minimum graph size
  dc="python3 experiments/dispatch_cost/run.py --model=voicechat_11b --context_frames=1500"
  dc="$dc --slots=16 --ticks=50 --out=$R/dispatch_cost.jsonl"
  graph="--xla_gpu_enable_command_buffer=+CUSTOM_CALL,+WHILE,+CONDITIONAL"
  graph="$graph --xla_gpu_graph_min_graph_size=1"
  # issue 33 at the target's 96 slots: the reference tick, the products alone, and three TF32
  # passes for the speech decoder and codec (on an H100 at 40 they paid only in the codec)
  last=("$prof $full --out_dir=/tmp/tp_ref_96 $log; $(keep_profile ref_96)"
    # the products alone: cuBLAS's full fp32 against our Triton kernel's (TF32 pairs were
    # measured on an H100 on 2026-12-06: 5-9x less exact than full fp32, not queued again)
    # the codec's products under three TF32 passes against full fp32, each against float64:
    # the measurement that would let them stand in for the faithful ones
    "$fp32 --shapes=codec --algorithms=float32,TF32_TF32_F32_X3 $log"
    "$prof $full --policy=tf32x3_tts_codec --out_dir=/tmp/tp_x3_96 $log; $(keep_profile x3_96)"
    # issue 30: the roll-over beats with the pack ahead of the lanes (b264dcd)
    "$cap --sessions=96 --policies=reference --loops=dispatch $log"
    "$fp32 --algorithms=float32,pallas_float32 $log"
    "$dc --label=default $log"
    "XLA_FLAGS='$graph' $dc --label=whole_graph $log"
    "$cap --sessions=128 --policies=bf16_tts_kv_tf32x3_codec --loops=dispatch $log"
    # issue 33's second target (135 ms at 112), which the memory plan admits since 2710080
    "$prof --hold_full=true --slots=112 --out_dir=/tmp/tp_112 $log; $(keep_profile 112)")
else  # an H100 (2026-12-05, d4d68c4: 48 faithful held; 2026-12-06, 0ced39c: 84 bf16 held, 52
  # faithful did not compile, the autotuner short of memory: the plan keeps room for it since
  # then and admits 51)
  # issue 33 first (a few minutes, and it decides what the CPU work does next): the codec's
  # products under three TF32 passes against full fp32, each against float64, at the H200's
  # target rows (the error does not depend on the card's size: an H200 has the same tensor cores)
  fp32="python3 experiments/fp32_products/run.py --out=$R/fp32_products.jsonl --slots=96"
  cmds=("$fp32 --shapes=codec --algorithms=float32,TF32_TF32_F32_X3 $log")
  # issue 30: the roll-over beats with the pack ahead of the lanes (b264dcd), then the loops
  cmds+=("$cap --sessions=51 --policies=reference --loops=dispatch $log")
  cmds+=("$cap --sessions=51 --policies=reference --loops=resident $log")
  last=()
fi
cmds+=("${last[@]}")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
experiments/device_queue.sh start "${cmds[@]}"
