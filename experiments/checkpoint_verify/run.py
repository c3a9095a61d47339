r"""What verifying a converted checkpoint costs: ``Verify.FULL`` (sha256) or ``Verify.SIZES``.

Times ``checkpoint.verify_files`` in each mode on ``--checkpoint`` (the page cache warm: each mode
runs ``--repeats`` times, the median is kept), and ``checkpoint.restore`` in each mode; then
sha256 throughput over ``--hash_files`` files of ``--hash_mib`` MiB written to ``--workdir``, with
1, 2, ... ``--threads`` hashing threads (``file_digests``, the function verification uses), from
which it estimates full verification of ``--estimate_gb`` GB (the 11B checkpoint: ~21 GB). The
rows go to ``--rows`` (rewritten) as they are measured, each with its provenance
(``experiments.harness``).

  python -m experiments.checkpoint_verify.run --checkpoint=checkpoints/tiny --rows=/tmp/rows.jsonl
"""

from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import time

from absl import app, flags

from experiments import harness
from voicechat_jax import checkpoint as ckpt
from voicechat_jax.precision import Precision

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "A converted checkpoint to verify.", required=True)
flags.DEFINE_string("rows", None, "Where the raw rows go (JSON lines).", required=True)
flags.DEFINE_string("workdir", "/tmp/vc_checkpoint_verify", "Scratch for the hashing files.")
flags.DEFINE_integer("repeats", 5, "Runs of each verification mode.")
flags.DEFINE_integer("hash_files", 4, "Files hashed for the throughput.")
flags.DEFINE_integer("hash_mib", 256, "Size of each of them (MiB).")
flags.DEFINE_integer("threads", os.cpu_count() or 1, "Most hashing threads tried.")
flags.DEFINE_float("estimate_gb", 21.0, "Checkpoint size of the estimate (GB).")
flags.DEFINE_bool("restore", True, "Also time restore() in each mode.")


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    del argv
    pathlib.Path(FLAGS.rows).unlink(missing_ok=True)
    log = harness.RowLog(FLAGS.rows)
    listing = ckpt.verify_files(os.path.abspath(FLAGS.checkpoint), ckpt.Verify.SIZES)
    n_bytes = sum(f["bytes"] for f in listing.values())
    for verify in ckpt.Verify:
        seconds = _median_seconds(
            lambda v=verify: ckpt.verify_files(os.path.abspath(FLAGS.checkpoint), v),
            FLAGS.repeats,
        )
        log.write(
            {
                "what": "verify_files",
                "verify": verify.value,
                "files": len(listing),
                "bytes": n_bytes,
                "seconds": seconds,
            }
        )
    if FLAGS.restore:
        ckpt.restore(FLAGS.checkpoint, Precision.fp32())  # compiles, fills the page cache
        times: dict[ckpt.Verify, list[float]] = {v: [] for v in ckpt.Verify}
        for _ in range(FLAGS.repeats):  # the modes interleaved: a busy machine slows both alike
            for verify in ckpt.Verify:
                t0 = time.perf_counter()
                ckpt.restore(FLAGS.checkpoint, Precision.fp32(), verify=verify)
                times[verify].append(time.perf_counter() - t0)
        for verify, seconds in times.items():
            log.write(
                {"what": "restore", "verify": verify.value, "seconds": statistics.median(seconds)}
            )

    os.makedirs(FLAGS.workdir, exist_ok=True)
    names = [f"blob_{i}" for i in range(FLAGS.hash_files)]
    try:
        for name in names:
            with open(os.path.join(FLAGS.workdir, name), "wb") as f:
                for _ in range(FLAGS.hash_mib):
                    f.write(os.urandom(1 << 20))
        total = FLAGS.hash_files * FLAGS.hash_mib << 20
        ckpt.file_digests(FLAGS.workdir, names)  # page cache warm
        for threads in range(1, FLAGS.threads + 1):
            seconds = _median_seconds(
                lambda t=threads: ckpt.file_digests(FLAGS.workdir, names, workers=t), 3
            )
            log.write(
                {
                    "what": "sha256",
                    "threads": threads,
                    "bytes": total,
                    "seconds": seconds,
                    "gb_per_s": total / seconds / 1e9,
                }
            )
    finally:
        shutil.rmtree(FLAGS.workdir, ignore_errors=True)

    rows = log.rows
    print(f"checkpoint {FLAGS.checkpoint}: {len(listing)} files, {n_bytes:,} bytes")
    print(f"{'measured':<34} {'seconds':>9}")
    for row in rows:
        if row["what"] == "sha256":
            label = f"sha256, {row['threads']} threads ({row['gb_per_s']:.2f} GB/s)"
        else:
            label = f"{row['what']} verify={row['verify']}"
        print(f"{label:<34} {row['seconds']:>9.4f}")
    for row in rows:
        if row["what"] == "sha256":
            estimate = FLAGS.estimate_gb / row["gb_per_s"]
            print(
                f"estimate: full verify of {FLAGS.estimate_gb:g} GB with {row['threads']} "
                f"threads, files in the page cache: {estimate:.1f} s"
            )


if __name__ == "__main__":
    app.run(main)
