#!/usr/bin/env bash
# Runs benchmark commands on a lent device machine past one call's 10-minute limit.
#
#   experiments/device_queue.sh start CMD [CMD ...]   queue the commands, run them one after
#                                                       another, detached from the call (setsid)
#   experiments/device_queue.sh wait SECONDS            wait for the queue (at most SECONDS), then
#                                                       copy its log and rows to $OUT
#
# The queue survives the call that starts it (setsid detaches it), so a later call, made
# while the machine is still warm, picks up where it stands. Every command runs in the repository
# root with the persistent compilation cache set; it should write its rows under $QUEUE_ROWS
# (exported to it), which `wait` copies back. State lives outside the repository, which each call
# copies over again: $DEVICE_QUEUE_DIR, by default /tmp/device_queue. The device's copy of the
# checkout keeps older git metadata: export EXPERIMENTS_COMMIT (the commit sent) before `start`. How to plan calls around
# it (idle release, machines lost between calls, compile costs): docs/gpu-notes.md.
set -u
dir=${DEVICE_QUEUE_DIR:-/tmp/device_queue}
case "${1:-}" in
  start)
    shift
    mkdir -p "$dir/rows"
    # the queue file, the pid file and the runner's next read change under one lock, so that a
    # command added while the runner finishes is run, by it or by a new one, and run once
    exec 9>"$dir/lock"
    flock 9
    printf '%s\n' "$@" >>"$dir/queue"
    if [[ -f $dir/pid ]] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
      echo "queue running (pid $(cat "$dir/pid")): $# command(s) added"
      exit 0
    fi
    export JAX_COMPILATION_CACHE_DIR=$PWD/.jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=2
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QUEUE_ROWS=$dir/rows
    # a runner started again (the last one finished) goes on after the last command started,
    # recorded in $dir/started: no queued command runs twice
    setsid bash -c '
      while true; do
        exec 9>"$0/lock"
        flock 9
        n=$(($(cat "$0/started" 2>/dev/null || echo 0) + 1))
        cmd=$(sed -n "${n}p" "$0/queue")
        if [[ -z $cmd ]]; then
          rm -f "$0/pid"
          echo "== $(date +%T) queue done"
          exit 0
        fi
        echo "$n" >"$0/started"
        flock -u 9
        echo "== $(date +%T) start $n: $cmd"
        bash -c "$cmd" 9>&-
        rc=$?
        echo "== $(date +%T) end $n: rc=$rc"
      done' "$dir" >>"$dir/log" 2>&1 </dev/null 9>&- &
    echo $! >"$dir/pid"
    echo "queue started (pid $!)"
    ;;
  wait)
    end=$((SECONDS + ${2:-540}))
    running() { [[ -f $dir/pid ]] && kill -0 "$(cat "$dir/pid" 2>/dev/null)" 2>/dev/null; }
    while running && ((SECONDS < end)); do sleep 1; done
    running && echo "queue still running" || echo "queue done"
    grep '^== ' "$dir/log"
    tail -c 6000 "$dir/log"
    cp "$dir/log" "$OUT/queue.log"
    for f in "$dir"/rows/*; do [[ -f $f ]] && cp "$f" "$OUT/"; done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null || true
    ;;
  *)
    echo "usage: $0 start CMD [CMD ...] | wait SECONDS" >&2
    exit 2
    ;;
esac
