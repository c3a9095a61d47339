r"""Peak host memory and time of ``voicechat-convert`` on a full-size synthetic release.

Writes a synthetic ``model.safetensors`` with the real release's 1,632 names, shapes and dtypes
(NeMo's ``NemotronVoiceChat`` on the meta device, ``tests.reference.nemo_ref``) and non-zero
finite values, piece by piece (header, then each tensor's bytes from a random pool), plus
``config_to_release(voicechat_11b())`` as its ``config.json``; converts it with the CLI in a child
process while sampling the child's resident memory; spot-checks a few converted leaves against
the source; deletes everything unless ``--keep``. The run's row (JSON lines, with its provenance)
goes to ``results/cpu_11b_synthetic.jsonl``.

  python -m experiments.convert_memory.run --workdir=/tmp/vc_convert_memory
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "/tmp/vc_convert_memory", "Where the release and output go.")
flags.DEFINE_string("precision", "reference", "Passed to voicechat-convert.")
flags.DEFINE_bool("keep", False, "Keep the synthetic release and the checkpoint.")
flags.DEFINE_float("margin_gb", 4.0, "Free disk required beyond the release and checkpoint.")

INT_SUFFIXES = (
    "pad_tensor",
    "is_continuation",
    "special_flags",
    "_control_codes",
    "silence_tokens",
)
POOL = 64 << 20  # float32 values in the random pool (256 MB): past zstd's window, like weights


def write_release(directory: str, shapes: dict[str, tuple[int, ...]], release_cfg: dict) -> int:
    """The synthetic release; returns the size of model.safetensors."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(release_cfg, f)
    header, offset, kinds = {}, 0, {}
    for name, shape in shapes.items():
        is_int = name.endswith(INT_SUFFIXES)
        dtype, size = ("I64", 8) if is_int else ("F32", 4)
        n = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        kinds[name] = is_int
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(0)
    pool = (0.02 * rng.standard_normal(POOL, dtype=np.float32)).tobytes()
    path = os.path.join(directory, "model.safetensors")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i, (name, meta) in enumerate(header.items()):
            a, b = meta["data_offsets"]
            if kinds[name]:  # small non-negative ids and flags, not all zero
                n = (b - a) // 8
                f.write((np.arange(1, n + 1, dtype=np.int64) % 3).tobytes())
                continue
            left, at = b - a, (i * 7_919_999 * 4) % len(pool)
            while left:
                k = min(left, len(pool) - at)
                f.write(pool[at : at + k])
                left -= k
                at = 0
            if i % 200 == 0:
                logging.info(
                    "written %d / %d tensors (%.0f s)", i, len(header), time.perf_counter() - t0
                )
    logging.info(
        "wrote %s (%d bytes) in %.0f s", path, os.path.getsize(path), time.perf_counter() - t0
    )
    return os.path.getsize(path)


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


class RssSampler(threading.Thread):
    """Samples a process's resident set (anonymous + file-backed) every 0.2 s."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak, self.samples, self.done = 0, [], threading.Event()

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self.done.is_set():
            try:
                rss = self.proc.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            self.samples.append((round(time.perf_counter() - t0, 1), rss))
            time.sleep(0.2)


def spot_check(src: str, dst: str, paths: list[str]) -> dict[str, float]:
    """Max |converted - source| of layer 0 of a few leaves, read back with orbax."""
    import jax
    import orbax.checkpoint as ocp

    from voicechat_jax.config import voicechat_11b
    from voicechat_jax.convert import Release
    from voicechat_jax.keys import to_layout
    from voicechat_jax.keys.table import release_table

    index = _read_json(os.path.join(dst, "params", "index.json"))["leaves"]
    first = {}
    for r in release_table(voicechat_11b()):
        if r.param and r.index[:1] in ((), (0,)):
            first.setdefault(r.param, r)
    release = Release(os.path.join(src, "model.safetensors"))
    out = {}
    for path in paths:
        shard = index[path]["pieces"][0]["shard"]
        targets, entry = {}, None
        for leaf_path, leaf in index.items():  # orbax restores a shard whole
            for piece in leaf["pieces"]:
                if piece["shard"] != shard:
                    continue
                shape = tuple(leaf["shape"])
                if piece["start"] is not None:
                    shape = (piece["stop"] - piece["start"], *shape[1:])
                targets[piece["entry"]] = jax.ShapeDtypeStruct(
                    shape, jax.numpy.dtype(leaf["dtype"])
                )
                if leaf_path == path and entry is None:
                    entry = piece["entry"]
        got = ocp.StandardCheckpointer().restore(os.path.join(dst, "params", shard), targets)
        got = np.asarray(got[entry])
        rule = first[path]
        got = got[0] if rule.index else got
        want = to_layout(release.read(rule.release), rule.layout).astype(got.dtype)
        out[path] = float(np.max(np.abs(got.astype(np.float32) - want.astype(np.float32))))
        del got, want
    return out


def main(argv: list[str]) -> None:
    del argv
    from tests.reference.nemo_ref import nemo_full_size_key_shapes
    from voicechat_jax.config import voicechat_11b
    from voicechat_jax.release_config import config_to_release

    work = FLAGS.workdir
    src, dst = os.path.join(work, "release"), os.path.join(work, "checkpoint")
    shapes = nemo_full_size_key_shapes()
    data = sum(math.prod(s) * (8 if k.endswith(INT_SUFFIXES) else 4) for k, s in shapes.items())
    os.makedirs(work, exist_ok=True)
    free = shutil.disk_usage(work).free
    need = data + 21e9 + FLAGS.margin_gb * 1e9  # release + checkpoint (~20 GB compressed)
    if free < need:
        raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, need {need / 1e9:.1f} GB")
    result = {"tensors": len(shapes), "data_bytes": data, "disk_free_before_gb": free / 1e9}
    try:
        t = time.perf_counter()
        result["file_bytes"] = write_release(src, shapes, config_to_release(voicechat_11b())[0])
        result["generate_s"] = time.perf_counter() - t
        cmd = [
            sys.executable,
            "-m",
            "voicechat_jax.cli.convert",
            f"--src={src}",
            f"--dst={dst}",
            f"--precision={FLAGS.precision}",
            "--revision=synthetic",
        ]
        t = time.perf_counter()
        child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        sampler = RssSampler(child.pid)
        sampler.start()
        _, err = child.communicate()
        sampler.done.set()
        result["convert_s"] = time.perf_counter() - t
        result["returncode"] = child.returncode
        result["peak_rss_bytes_maxrss"] = (
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        )
        result["peak_rss_bytes_sampled"] = sampler.peak
        result["rss_timeline"] = sampler.samples[:: max(1, len(sampler.samples) // 60)]
        if child.returncode != 0:
            result["stderr_tail"] = err[-4000:]
            raise SystemExit(json.dumps(result, indent=1))
        result["checkpoint_bytes"] = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs
        )
        _save(result)
        manifest = _read_json(os.path.join(dst, "manifest.json"))
        result["manifest_sha256"] = manifest["source"]["sha256"]
        result["spot_check_max_abs_err"] = spot_check(
            src, dst, ["llm.mamba.in_proj", "llm.lm_head", "encoder.layers.ff1.up", "tts.rvq_embs"]
        )
    finally:
        if not FLAGS.keep:
            shutil.rmtree(work, ignore_errors=True)
    _save(result)
    print(json.dumps({k: v for k, v in result.items() if k != "rss_timeline"}, indent=1))


ROWS = os.path.join(os.path.dirname(__file__), "results", "cpu_11b_synthetic.jsonl")


@functools.cache
def _provenance() -> dict:
    from experiments import harness  # imports jax: only once there is a row to write

    return harness.provenance()


def _save(result: dict) -> None:
    """The run's one row, rewritten as it grows, with its provenance (``experiments.harness``)."""
    os.makedirs(os.path.dirname(ROWS), exist_ok=True)
    with open(ROWS, "w") as f:
        f.write(json.dumps({**result, **_provenance()}) + "\n")


if __name__ == "__main__":
    app.run(main)
