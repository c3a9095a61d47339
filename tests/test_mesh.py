"""The tick over a fake 4-device CPU mesh (``voicechat_jax.mesh``): same outputs, no collective.

The mesh runs in a subprocess (``tests/mesh_worker.py``, started with
``--xla_force_host_platform_device_count=4``) so that this process, and the rest of the suite,
keeps its one device; the tests assert on what the worker wrote. Measured there (tiny model,
fp32, 8 slots, 2 per device): tokens and codes are bit-for-bit those of one device stepping all 8
slots; the wav is within 1e-6 of it (XLA's CPU kernels round differently at batch 8 than at
batch 2, ~2e-7 at most) and bit-for-bit that of one device stepping the same 2 slots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh

from tests import mesh_worker as w
from voicechat_jax import mesh as mesh_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAV_ATOL = 1e-6  # one device at batch 8 against 4 devices at batch 2 (measured <= 2.4e-7)


def _run_worker(out_dir, *args: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={w.DEVICES}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "tests.mesh_worker", str(out_dir), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out_dir, "result.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    result = _run_worker(out)
    with np.load(os.path.join(out, "arrays.npz")) as a:
        arrays = dict(a)
    return result, arrays


def _admitted_slots() -> set[int]:
    return {b for admit, _ in w.SCRIPT.values() for b in admit}


def test_worker_ran_on_four_devices(worker):
    result, _ = worker
    assert result["devices"] == w.DEVICES


def test_sessions_join_on_every_device(worker):
    """The script admits into slots of all 4 devices, and those slots ran there."""
    _, a = worker
    per_device = w.SLOTS // w.DEVICES
    assert {b // per_device for b in _admitted_slots()} == set(range(w.DEVICES))
    ran = np.any([a[f"beat{k}/mesh/ran"] for k in range(w.BEATS)], axis=0)
    assert set(np.flatnonzero(ran)) == _admitted_slots()
    assert a[f"beat{w.RESEED[0]}/mesh/reseeded"][w.RESEED[1]]
    assert not a[f"beat{w.HOLD[0]}/mesh/ran"][w.HOLD[1]]


def test_sharded_tick_equals_one_device(worker):
    """Tokens and codes bit for bit, wav within WAV_ATOL, every beat, every slot that ran."""
    _, a = worker
    for k in range(w.BEATS):
        for name in ("ran", "active", "frame", "reseeded"):
            np.testing.assert_array_equal(a[f"beat{k}/mesh/{name}"], a[f"beat{k}/one/{name}"])
        ran = a[f"beat{k}/one/ran"]
        assert ran.any()
        for name in ("text", "function", "codes"):
            np.testing.assert_array_equal(
                a[f"beat{k}/mesh/{name}"][ran], a[f"beat{k}/one/{name}"][ran], err_msg=f"{k} {name}"
            )
        wav_one, wav_mesh = a[f"beat{k}/one/wav"][ran], a[f"beat{k}/mesh/wav"][ran]
        assert np.abs(wav_one).max() > 1e-2  # real audio, not silence on both sides
        np.testing.assert_allclose(wav_mesh, wav_one, rtol=0, atol=WAV_ATOL, err_msg=str(k))


def test_each_device_bit_equal_to_one_device_on_its_slots(worker):
    """A device's rows are exactly what one device stepping only those slots gives."""
    _, a = worker
    per_device = w.SLOTS // w.DEVICES
    for d in range(w.DEVICES):
        rows = slice(d * per_device, (d + 1) * per_device)
        for k in range(w.BEATS):
            ran = a[f"beat{k}/local{d}/ran"]
            np.testing.assert_array_equal(ran, a[f"beat{k}/mesh/ran"][rows])
            for name in w.FIELDS:
                np.testing.assert_array_equal(
                    a[f"beat{k}/mesh/{name}"][rows][ran],
                    a[f"beat{k}/local{d}/{name}"][ran],
                    err_msg=f"device {d} beat {k} {name}",
                )


def test_no_collective_in_the_compiled_tick(worker):
    result, _ = worker
    assert result["probe_collectives"] == {"all-reduce": 1, "all-gather": 1}  # the counter works
    assert result["collectives"] == {}


def test_state_stays_sharded_and_donated(worker):
    result, _ = worker
    assert result["params_specs"] == ["P()"]
    assert result["params_devices"] == [w.DEVICES]
    assert result["output_specs"] == ["data"]
    assert result["state_specs"] == [["data"]] * w.BEATS  # every leaf, after every tick
    assert result["donated"] == [True] * w.BEATS  # the previous state's buffers were consumed
    assert result["alias_bytes"] >= result["state_bytes_per_device"] > 0


def test_one_compile(worker):
    """One compilation of the mesh tick for all the engine's beats and two server runs."""
    result, _ = worker
    assert result["compiles"] == 1


def test_server_churn_across_devices_equals_one_device(worker):
    """The unchanged ``Server`` over the mesh engine: each session as over one device."""
    result, a = worker
    assert result["server_one_failures"] == result["server_mesh_failures"] == {}
    sessions = [sid for sid, _, _ in w.PLANS]
    assert result["server_sessions"] == {"one": sessions, "mesh": sessions}
    for sid in sessions:
        for name in ("text", "function", "codes"):
            np.testing.assert_array_equal(
                a[f"session/{sid}/mesh/{name}"], a[f"session/{sid}/one/{name}"], err_msg=sid
            )
        assert a[f"session/{sid}/mesh/text"].size > 0
        np.testing.assert_allclose(
            a[f"session/{sid}/mesh/wav"], a[f"session/{sid}/one/wav"], rtol=0, atol=WAV_ATOL
        )


def test_resident_loop_refused_on_a_mesh(worker):
    result, _ = worker
    assert "on a mesh use the dispatch loop" in result["resident_refused"]


def test_restore_onto_the_mesh(nemo_tiny, tiny_cfg, tmp_path_factory):
    """``checkpoint.restore(sharding=replicated)``: every leaf on all 4 devices, same values."""
    from tests.reference import nemo_ref
    from voicechat_jax import convert
    from voicechat_jax.precision import Precision

    root = tmp_path_factory.mktemp("mesh_ckpt")
    nemo_ref.save_release(nemo_tiny, tiny_cfg, root / "release")
    llm_dir = nemo_tiny.release_cfg["model"]["stt"]["model"]["pretrained_llm"]
    convert.convert(
        root / "release",
        root / "tiny",
        llm_config=os.path.join(llm_dir, "config.json"),
        tokenizer=os.path.join(llm_dir, "tokenizer.json"),
        precision=Precision.fp32(),
    )
    out = root / "out"
    out.mkdir()
    result = _run_worker(out, "--checkpoint", str(root / "tiny"))
    assert result["leaves"] > 0
    assert result["replicated_on_mesh"] == result["leaves"]
    assert result["equal_to_one_device"]


# ---- one device (this process) ---------------------------------------------------------------


def test_collectives_counts_opcodes_not_names():
    hlo = "\n".join(
        [
            "  %all-reduce.3 = f32[4]{0} all-reduce(f32[4]{0} %p), to_apply=%add",
            "  %ags = (f32[2]{0}, f32[8]{0}) all-gather-start(f32[2]{0} %x), dimensions={0}",
            "  %agd = f32[8]{0} all-gather-done((f32[2]{0}, f32[8]{0}) %ags)",
            "  %fusion.all-gather-like = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop",
            "  %cp = f32[4]{0} collective-permute(f32[4]{0} %p), source_target_pairs={{0,1}}",
        ]
    )
    assert mesh_lib.collectives(hlo) == {"all-reduce": 1, "all-gather": 1, "collective-permute": 1}


def test_slots_must_split_evenly():
    four = AbstractMesh((4,), (mesh_lib.DATA,))
    assert mesh_lib.check_slots(8, four) == 2
    with pytest.raises(ValueError, match="6 slots do not split evenly over 4 devices"):
        mesh_lib.check_slots(6, four)


def test_make_mesh_counts_local_devices():
    mesh = mesh_lib.make_mesh(1)
    assert isinstance(mesh, Mesh)
    assert mesh.shape[mesh_lib.DATA] == 1
    with pytest.raises(ValueError, match="this process has 1"):
        mesh_lib.make_mesh(2)


def _serve(out_dir, devices: int, cache_dir) -> subprocess.Popen:
    """``voicechat-serve --devices=N`` on the fake 4-device CPU mesh: 4 sessions, 2 joining late
    and leaving early (churn), 5 beats on the offline clock, fp32, deterministic sampler."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={w.DEVICES}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    # The second run takes the model's compiles (all but the tick's) from the first's cache.
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    flags = [
        f"--devices={devices}",
        f"--slots={w.DEVICES}",
        f"--sessions={w.DEVICES}",
        "--churn",
        "--seconds=0.8",
        "--clock=offline",
        "--precision=fp32",
        "--speech_sampling=deterministic",
        f"--output_dir={out_dir}",
    ]
    cmd = [sys.executable, "-m", "voicechat_jax.cli.serve", *flags]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_serve_cli_on_four_devices_equals_one(tmp_path):
    """``voicechat-serve --devices=4`` writes, session by session, the frames (text, function,
    codes, transcript ids) that ``--devices=1`` writes (the same flags but the device count; one
    run after the other, the second from the first's compilation cache)."""
    for n in (1, w.DEVICES):
        proc = _serve(tmp_path / f"d{n}", n, tmp_path / "jax_cache")
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"--devices={n}: {err.decode()[-3000:]}"
    sessions = sorted(p.name for p in (tmp_path / "d1").iterdir() if p.is_dir())
    assert len(sessions) == w.DEVICES
    total = 0
    for sid in sessions:
        rows = {
            n: [json.loads(line) for line in (tmp_path / f"d{n}" / sid / "frames.jsonl").open()]
            for n in (1, w.DEVICES)
        }
        assert rows[w.DEVICES] == rows[1], sid
        total += len(rows[1])
    assert total >= 2 * w.DEVICES  # every session ran at least one beat
