"""Which state leaves the compiled tick copies whole: a check on the CPU before device time.

The tick takes the session state donated and should update every leaf in place. When XLA cannot
order a leaf's reads before its in-place writes, it copies the whole leaf first; at the 11B's
shapes such a copy costs the GPU about 0.2 ms per GB a tick (2026-12-05: the encoder's shifted
attention caches, 2 copies of 550 MB at 40 slots on an H100, `experiments/tick_profile`). This
compiles the dispatch tick for the CPU with the weights in a GPU's serving layout (the encoder
and the RNNT's LSTM unrolled) and XLA's kernels (the Pallas ones need a GPU), and counts the
``copy`` instructions whose shape is a state leaf's. The CPU's count matched the H100's for the
encoder's attention caches; for other leaves the GPU may fuse what the CPU copies, so a count
here is a question for the next profile's ``op`` rows, not a measurement.

  PYTHONPATH=. python3 experiments/state_copies.py --model=voicechat_11b --slots=4 \
      --context_frames=1500      # about a minute on the 2-core machine

Prints one line per leaf shape that is copied (the leaves of that shape, the copies) and the
number of ``copy`` instructions in all.
"""

from __future__ import annotations

import collections
import re

import jax
from absl import app, flags

from experiments.harness import abstract_tick_args
from voicechat_jax import config as config_lib
from voicechat_jax import step as step_lib
from voicechat_jax.precision import policy

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_string("precision", "reference", "Precision policy (voicechat_jax.precision).")
flags.DEFINE_integer("slots", 4, "Slots of the tick.")
flags.DEFINE_integer("context_frames", 64, "Context cap.")
flags.DEFINE_integer("min_bytes", 1 << 16, "Count only leaves of at least this many bytes.")

_HLO_TYPE = {"float32": "f32", "bfloat16": "bf16", "int32": "s32", "float16": "f16"}
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(")


def copied_leaves(hlo: str, state, min_bytes: int) -> dict[tuple, tuple[list[str], int]]:
    """(HLO type, shape) -> (the state leaves of that shape, the copies of that shape in
    ``hlo``), for leaves of at least ``min_bytes``."""
    leaves: dict[tuple, list[str]] = collections.defaultdict(list)
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if x.size * x.dtype.itemsize >= min_bytes:
            key = (_HLO_TYPE.get(str(x.dtype), str(x.dtype)), tuple(x.shape))
            leaves[key].append(jax.tree_util.keystr(path))
    copies: collections.Counter = collections.Counter()
    for m in _COPY.finditer(hlo):
        copies[(m.group(1), tuple(int(v) for v in m.group(2).split(",") if v))] += 1
    return {k: (names, copies[k]) for k, names in leaves.items() if copies[k]}


def main(argv):
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]()
    precision = policy(FLAGS.precision)
    serve = config_lib.ServeConfig(
        slots=FLAGS.slots, context_frames=FLAGS.context_frames, precision=precision
    ).resolved("cpu")
    args = abstract_tick_args(cfg, serve)  # a GPU's weight layout; the kernels stay XLA's
    hlo = step_lib.make_tick(cfg, serve).lower(*args).compile().as_text()
    found = copied_leaves(hlo, args[1], FLAGS.min_bytes)
    for (dtype, shape), (names, n) in sorted(found.items(), key=lambda kv: -kv[1][1]):
        shown = ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
        print(f"{n:4d} copies of {dtype}{list(shape)}: {shown}")
    total = len(_COPY.findall(hlo))
    print(f"{FLAGS.model}, {FLAGS.slots} slots: {total} copy instructions in the compiled tick")


if __name__ == "__main__":
    app.run(main)
