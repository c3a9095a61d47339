#!/usr/bin/env bash
# Downloads, here, the wheels of the serving packages that the lent H200 image lacks (the device
# tool's package list says which), for its Python 3.12 on x86-64, into .whl/ (git-ignored).
#
#   experiments/device_wheels.sh
#
# A device call that needs them carries the folder (carry=[".whl"]) and starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# before experiments/device_queue.sh start (the queue puts the repository in front of it; a command
# run directly needs PYTHONPATH=$PWD:/tmp/site).
# (experiments/network_load and the live server need them: soxr resamples, websockets is the
# load client's). Versions: the ones pyproject.toml accepts, as installed here.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
for pkg in "soxr==$(python3 -c 'import importlib.metadata as m; print(m.version("soxr"))')" \
  "websockets==$(python3 -c 'import importlib.metadata as m; print(m.version("websockets"))')"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
ls -l .whl
