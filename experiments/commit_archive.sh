#!/usr/bin/env bash
# Archives the code of earlier commits beside the tree, so that one device call can time them
# against the current one on the same machine (a baseline rerun where it is measured).
#
#   experiments/commit_archive.sh COMMIT [COMMIT ...]
#
# Each commit's voicechat_jax/, pallas_kernels/ and experiments/ (without result rows) go to
# .base/<short commit>/ (git-ignored, ~5 MiB each). The device call carries .base and runs, e.g.,
#   (cd .base/9b10800 && PYTHONPATH=$PWD:/tmp/site python3 experiments/tick_profile/run.py ... \
#     --commit=9b10800)
# with the persistent compilation cache shared (experiments/device_queue.sh sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
for c in "$@"; do
  short=$(git rev-parse --short "$c")
  rm -rf ".base/$short" && mkdir -p ".base/$short"
  git archive "$short" voicechat_jax pallas_kernels experiments | tar -x -C ".base/$short"
  rm -rf ".base/$short"/experiments/*/results
  echo ".base/$short: $(du -sh ".base/$short" | cut -f1)"
done
