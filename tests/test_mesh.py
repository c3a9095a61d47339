"""Every check on a fake 4-device CPU mesh: the slot axis over a ``data`` mesh
(``voicechat_jax.mesh``: same outputs, no collective) and the LLM over a ``model`` axis (tensor
parallelism), a checkpoint restored onto the mesh, and ``voicechat-serve --devices=N``.

The mesh runs in one subprocess (``tests/multidevice_worker.py``, started with
``--xla_force_host_platform_device_count=4``) so that this process, and the rest of the suite,
keeps its one device; the tests assert on what the worker wrote. Measured there (tiny model,
fp32, 8 slots, 2 per device): tokens and codes are bit-for-bit those of one device stepping all 8
slots; the wav is within 1e-6 of it (XLA's CPU kernels round differently at batch 8 than at
batch 2, ~2e-7 at most) and bit-for-bit that of one device stepping the same 2 slots.

The worker compiles, as every process of the suite does, with ``tests/conftest.py``'s fast CPU
code generation flags (the same for the one-device reference), inherited through ``XLA_FLAGS``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh

from tests import mesh_worker as w
from tests import tp_worker as tw
from voicechat_jax import mesh as mesh_lib
from voicechat_jax.config import LLMConfig, ServeConfig, tiny
from voicechat_jax.model import llm_shard, nano, nano_tp
from voicechat_jax.precision import Precision

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAV_ATOL = 1e-6  # one device at batch 8 against 4 devices at batch 2 (measured <= 2.4e-7)


# voicechat-serve's refusals of device layouts it cannot serve, checked in the worker
# (``cli.serve.main`` with 4 devices): flags, the message's start.
SERVE_REFUSALS = [
    ("--model_parallel=2", "--model_parallel=2 does not divide --devices=1"),
    ("--devices=4 --model_parallel=3", "--model_parallel=3 does not divide --devices=4"),
    (
        "--devices=4 --model_parallel=2 --slots=3",
        "--slots=3 does not split evenly over the 2 groups of --model_parallel=2 devices",
    ),
    (
        "--devices=3 --model_parallel=3 --slots=3",
        "--model_parallel=3: model_parallel=3 does not divide the LLM's n_heads=4",
    ),
    ("--devices=5 --slots=5", "--devices=5: this process has 4 cpu device(s)"),
]


@pytest.fixture(scope="module")
def multidevice(nemo_tiny, tiny_cfg, tmp_path_factory) -> pathlib.Path:
    """One run of ``tests/multidevice_worker.py`` on 4 fake CPU devices: every check of this file
    that needs them (the data mesh, a checkpoint restored onto it, tensor parallelism, the
    server's runs and refusals); returns its output directory."""
    from tests.reference import nemo_ref
    from voicechat_jax import convert
    from voicechat_jax.precision import Precision

    root = tmp_path_factory.mktemp("multidevice")
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
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={w.DEVICES}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    refusals = json.dumps(
        [[f"--output_dir={out / 'refused'}", *f.split()] for f, _ in SERVE_REFUSALS]
    )
    cmd = [sys.executable, "-m", "tests.multidevice_worker", str(out),
           "--checkpoint", str(root / "tiny"), "--serve_flags", refusals]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _results(out_dir: pathlib.Path) -> tuple[dict, dict]:
    with open(out_dir / "result.json") as f:
        result = json.load(f)
    arrays = {}
    if (out_dir / "arrays.npz").exists():
        with np.load(out_dir / "arrays.npz") as a:
            arrays = dict(a)
    return result, arrays


@pytest.fixture(scope="module")
def worker(multidevice):
    return _results(multidevice / "mesh")


@pytest.fixture(scope="module")
def tp(multidevice):
    return _results(multidevice / "tp")


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


def test_a_roll_over_from_a_lane_on_another_device(worker):
    """Slot 4's capsule, asked a beat ahead, was prefilled on the mesh as on one device and swapped
    in at the roll-over (the outputs of every beat are compared in the test below)."""
    result, a = worker
    assert result["prefilled"] == {"one": [w.LANE[1]], "mesh": [w.LANE[1]]}
    assert a[f"beat{w.LANE[0]}/mesh/reseeded"][w.LANE[1]]
    assert a[f"beat{w.LANE[0]}/one/reseeded"][w.LANE[1]]


def _same_beats(a: dict, beats: int, got, want, wav_atol: float) -> None:
    """Every beat, every slot that ran: the slot flags equal, text, function and codes bit for
    bit, the wav (real audio, not silence) within ``wav_atol``; ``got(k, name)`` and
    ``want(k, name)`` are the keys of beat ``k``'s two arrays."""
    for k in range(beats):
        for name in ("ran", "active", "frame", "reseeded"):
            np.testing.assert_array_equal(a[got(k, name)], a[want(k, name)])
        ran = a[want(k, "ran")]
        assert ran.any()
        for name in ("text", "function", "codes"):
            np.testing.assert_array_equal(
                a[got(k, name)][ran], a[want(k, name)][ran], err_msg=f"{k} {name}"
            )
        wav = a[want(k, "wav")][ran]
        assert np.abs(wav).max() > 1e-2  # real audio on both sides, not silence
        np.testing.assert_allclose(
            a[got(k, "wav")][ran], wav, rtol=0, atol=wav_atol, err_msg=str(k)
        )


def test_sharded_tick_equals_one_device(worker):
    """Tokens and codes bit for bit, wav within WAV_ATOL, every beat, every slot that ran."""
    _, a = worker
    _same_beats(a, w.BEATS, lambda k, n: f"beat{k}/mesh/{n}", lambda k, n: f"beat{k}/one/{n}",
                WAV_ATOL)  # fmt: skip


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


def test_restore_onto_the_mesh(multidevice):
    """``checkpoint.restore(sharding=replicated)``: every leaf on all 4 devices, same values."""
    result, _ = _results(multidevice / "restore")
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


def test_serve_on_four_devices_equals_one(multidevice):
    """The run ``voicechat-serve --devices=4`` makes writes, session by session, the frames (text,
    function, codes, transcript ids) that ``--devices=1`` writes (the same options but the device
    count: 4 sessions, 2 joining late and leaving early, 5 offline beats, the mesh checks' 8 slots,
    fp32, NeMo's sampler, a 64-frame cap)."""
    out = multidevice / "serve"
    sessions = sorted(p.name for p in (out / "d1").iterdir() if p.is_dir())
    assert len(sessions) == w.DEVICES
    total = 0
    for sid in sessions:
        rows = {
            n: [json.loads(line) for line in (out / f"d{n}" / sid / "frames.jsonl").open()]
            for n in (1, w.DEVICES)
        }
        assert rows[w.DEVICES] == rows[1], sid
        total += len(rows[1])
    assert total >= 2 * w.DEVICES  # every session ran at least one beat


@pytest.mark.parametrize(("flags", "message"), SERVE_REFUSALS, ids=[f for f, _ in SERVE_REFUSALS])
def test_serve_refuses_a_layout_it_cannot_serve(multidevice, flags, message):
    """``voicechat-serve`` refuses in one line (exit 2) before building anything."""
    rows = json.loads((multidevice / "flags.json").read_text())
    (row,) = [r for r in rows if r["argv"][1:] == flags.split()]
    assert row["code"] == 2, row["stderr"][-3000:]
    lines = row["stderr"].strip().splitlines()
    assert len(lines) == 1, row["stderr"]
    assert lines[0].startswith("voicechat-serve: ")
    assert message in lines[0]
    assert not (multidevice / "refused" / "metrics.jsonl").exists()


# ---- tensor parallelism of the LLM over a ``model`` axis (``tests/tp_worker.py``) -----------
#
# Layouts ``(data=2, model=2)`` and ``(data=1, model=4)`` (the tiny preset's 2 KV heads and 2 Mamba
# groups are then each held by 2 devices, and each gated-norm group spans 2) against one device
# stepping the same 4 slots, fp32 policy, over a script with late admission, a release, a
# roll-over with a capsule (the tick's prefill path) and a held slot.
#
# Tolerances. Tokens and codes must be bit for bit. The continuous values TP changes are the
# LLM's: each row-parallel product is summed as m partial sums added by an all-reduce, a different
# summation order than one device's dot, so the LLM state differs by rounding: measured at most
# 1.9e-6 (values up to ~4) after 4 beats; ``STATE_ATOL`` is 1e-5. The wav depends on the LLM only
# through the tokens; it differs only where the per-device batch does (XLA's CPU kernels round
# differently at batch 2 than at 4: measured 1.6e-7 at (2, 2), 0 at (1, 4)): ``TP_WAV_ATOL``.

STATE_ATOL = 1e-5  # LLM state after 4 beats, TP against one device (measured <= 1.9e-6)
TP_WAV_ATOL = 1e-6  # per-device batch 2 against 4 (measured <= 1.6e-7)
LAYOUTS = [f"d{d}m{m}" for d, m in tw.LAYOUTS]


def _model(layout: str) -> int:
    return int(layout.split("m")[1])


def _data(layout: str) -> int:
    return int(layout[1 : layout.index("m")])


def test_tp_worker_ran_on_four_devices(tp):
    result, _ = tp
    assert result["devices"] == tw.DEVICES
    assert {k: tuple(v["mesh_shape"].values()) for k, v in result.items() if k in LAYOUTS} == {
        f"d{d}m{m}": (d, m) for d, m in tw.LAYOUTS
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_tokens_and_codes_as_one_device(tp, layout):
    """Every beat, every slot that ran: text, function and codes bit for bit; wav to rounding."""
    _, a = tp
    _same_beats(a, tw.BEATS, lambda k, n: f"{layout}/beat{k}/{n}", lambda k, n: f"one/beat{k}/{n}",
                TP_WAV_ATOL)  # fmt: skip
    ran = a[f"one/beat{tw.BEATS - 1}/ran"]
    # the script did what it says: a roll-over (prefill in the tick), a held slot, a late joiner
    assert a[f"one/beat{tw.RESEED[0]}/reseeded"][tw.RESEED[1]]
    assert not a[f"one/beat{tw.HOLD[0]}/ran"][tw.HOLD[1]]
    assert len({tuple(a[f"one/beat{k}/text"][ran].ravel()) for k in range(tw.BEATS)}) > 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llm_state_equals_one_device_to_rounding(tp, layout):
    """The final LLM state, back in the one-device layout (``nano_tp.state_from_tensor_parallel``:
    each channel and KV head from its first holder), equals one device's within STATE_ATOL."""
    _, a = tp
    n = sum(k.startswith("one/llm_state/") for k in a)
    assert n == len(jax.tree_util.tree_leaves(nano.init_state(tw.CFG.llm, 1, 2, tw.PREC)))
    one = [a[f"one/llm_state/{i}"] for i in range(n)]
    tp = [a[f"{layout}/llm_state/{i}"] for i in range(n)]
    chex.assert_trees_all_equal_shapes_and_dtypes(tp, one)
    chex.assert_trees_all_close(tp, one, rtol=0, atol=STATE_ATOL)
    assert one[-1].min() > tw.TEMPLATE_LENGTH  # length: the slots advanced past the template


def _per_step(layout: str) -> int:
    """All-reduces of one LLM frame step: one per layer (its row-parallel product), plus one per
    Mamba layer for the gated norm when a B/C group spans devices."""
    llm = tw.CFG.llm
    norm_ranks = llm_shard.shard_config(llm, _model(layout)).norm_ranks
    return len(llm.pattern) + (norm_ranks > 1) * len(llm.layers_of("M"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_all_reduces_over_the_model_axis(tp, layout):
    """The staged tick's only collectives are all-reduces within the ``model`` groups, one LLM
    frame step's (``_per_step``, inside the frame loop); the roll-over's prefill, its own program,
    has the same less the last layer's product (the prefill's hidden state is dropped, so XLA
    removes that product and its all-reduce; the tiny pattern ends with an attention layer)."""
    result, _ = tp
    r = result[layout]
    assert tw.CFG.llm.pattern[-1] == "*"
    model_groups = [list(g) for g in r["model_groups"]]
    assert len(model_groups) == _data(layout)
    for key, expected in (("", _per_step(layout)), ("reseed_", _per_step(layout) - 1)):
        assert r[f"{key}collectives"] == {"all-reduce": expected}, key
        assert r[f"{key}all_reduce_groups"] == [[model_groups, expected]], key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llm_state_sharded_over_model(tp, layout):
    """Each device keeps its slots' share of the heads: SSM state and KV caches split on their
    head axis, the conv state on its channels; everything else split by slot only."""
    result, _ = tp
    r, llm = result[layout], tw.CFG.llm
    m, slots = _model(layout), tw.SLOTS // _data(layout)
    local = llm_shard.shard_config(llm, m)
    S = tw.TEMPLATE_LENGTH + tw.SERVE.context_frames
    assert r["state"] == {
        "ssm": {
            "spec": ["data", "model"],
            "shard": [slots, llm.mamba_heads // m, llm.mamba_head_dim, llm.ssm_state],
        },
        "conv": {
            "spec": ["data", None, "model"],
            "shard": [slots, llm.conv_kernel - 1, local.conv_dim],
        },
        "k": {"spec": ["data", "model"], "shard": [slots, local.n_kv_heads, S, llm.head_dim]},
        "v": {"spec": ["data", "model"], "shard": [slots, local.n_kv_heads, S, llm.head_dim]},
        "length": {"spec": ["data"], "shard": [slots]},
    }
    assert r["state_leaves_sharded_over_model"] == r["state_leaves_llm"] - 1  # all but length
    assert r["other_state_specs"] == ["['data']"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llm_weights_sharded_megatron_style(tp, layout):
    result, _ = tp
    r, llm = result[layout], tw.CFG.llm
    m = _model(layout)
    local = llm_shard.shard_config(llm, m)
    L_m, L_f, L_a = (len(llm.layers_of(c)) for c in "M-*")
    D, NH = llm.d_model, llm.d_inner
    # The products are served one leaf per layer (voicechat.serving_layout): a 2-D spec each.
    column, row, head = [None, "model"], ["model", None], [None, "model"]
    assert r["params"] == {
        "in_proj": {"layers": L_m, "spec": column, "shard": [D, local.in_proj_dim]},
        "conv_w": {"spec": [None, None, "model"], "shard": [L_m, llm.conv_kernel, local.conv_dim]},
        "A_log": {"spec": head, "shard": [L_m, llm.mamba_heads // m]},
        "gate_norm": {"spec": head, "shard": [L_m, NH // m]},
        "out_proj": {"layers": L_m, "spec": row, "shard": [NH // m, D]},
        "q": {"layers": L_a, "spec": column, "shard": [D, llm.n_heads * llm.head_dim // m]},
        "k": {"layers": L_a, "spec": column, "shard": [D, local.n_kv_heads * llm.head_dim]},
        "o": {"layers": L_a, "spec": row, "shard": [llm.n_heads * llm.head_dim // m, D]},
        "up": {"layers": L_f, "spec": column, "shard": [D, llm.mlp_dim // m]},
        "down": {"layers": L_f, "spec": row, "shard": [llm.mlp_dim // m, D]},
        "embed": {"spec": [], "shard": [llm.vocab_size, D]},
        "lm_head": {"spec": [], "shard": [D, llm.vocab_size]},
        "norm_f": {"spec": [], "shard": [D]},
    }
    assert r["other_params_specs"] == ["[]"]  # encoder, RNNT, speech decoder, codec replicated


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_compile_and_the_state_donated(tp, layout):
    """One compilation of the tick for two runs of the script (a reset between), and every beat
    consumed the previous state's buffers."""
    result, _ = tp
    assert result[layout]["compiles"] == 1
    assert result[layout]["donated"] == [True] * tw.BEATS


@pytest.mark.parametrize("m", [1, 2, 4])
def test_tensor_parallel_layout_round_trip(m):
    """The layout's index covers every one-device channel and KV head (a permutation where m
    divides the groups and KV heads); a state there and back is unchanged."""
    llm = tw.CFG.llm
    idx = nano_tp.tensor_parallel_index(llm, m)
    local = llm_shard.shard_config(llm, m)
    assert len(idx["in_proj"]) == m * local.in_proj_dim
    assert len(idx["conv"]) == m * local.conv_dim
    assert set(idx["in_proj"]) == set(range(llm.in_proj_dim))
    assert set(idx["conv"]) == set(range(llm.conv_dim))
    assert set(idx["kv"].ravel()) == set(range(llm.n_kv_heads))
    if llm.n_groups % m == 0 and llm.n_kv_heads % m == 0:
        assert sorted(idx["in_proj"]) == list(range(llm.in_proj_dim))
    rng = np.random.default_rng(m)
    state = jax.tree_util.tree_map(
        lambda x: rng.standard_normal(x.shape).astype(x.dtype),
        jax.eval_shape(lambda: nano.init_state(llm, 2, 5, tw.PREC)),
    )
    back = nano_tp.state_from_tensor_parallel(
        nano_tp.state_to_tensor_parallel(state, llm, m), llm, m
    )
    chex.assert_trees_all_equal(back, state)


def test_indivisible_sizes_are_one_line_errors():
    llm = tw.CFG.llm  # n_heads 4, n_kv_heads 2, mamba_heads 8, n_groups 2, mlp_dim 96
    with pytest.raises(ValueError, match=r"^model_parallel=3 does not divide the LLM's n_heads=4$"):
        llm_shard.shard_config(llm, 3)
    odd_groups = LLMConfig(**{**_fields(llm), "mamba_heads": 12, "n_groups": 3})
    with pytest.raises(ValueError, match="model_parallel=2 and the LLM's n_groups=3: neither"):
        llm_shard.shard_config(odd_groups, 2)
    wide = LLMConfig(**{**_fields(llm), "mlp_dim": 90})
    with pytest.raises(ValueError, match="does not divide the LLM's mlp_dim=90"):
        llm_shard.shard_config(wide, 4)
    serve = ServeConfig(slots=4, precision=Precision.fp32(), ssm_kernel="fused")
    four = AbstractMesh((1, 4), (mesh_lib.DATA, mesh_lib.MODEL))
    with pytest.raises(ValueError, match="ssm_kernel='fused' needs the LLM's n_groups=2"):
        mesh_lib.local_config(tiny(), serve, four)
    two = AbstractMesh((2, 2), (mesh_lib.DATA, mesh_lib.MODEL))
    assert mesh_lib.local_config(tiny(), serve, two).llm.n_groups == 1  # fused is fine here
    with pytest.raises(ValueError, match="model_parallel=2 does not divide the 1 devices"):
        mesh_lib.make_mesh(1, model_parallel=2)


def _fields(cfg: LLMConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_one_device_and_data_meshes_are_unchanged():
    """Without a ``model`` axis: the same config, params and 1-D mesh as before."""
    cfg = tiny()
    serve = ServeConfig(slots=4, precision=Precision.fp32())
    data = AbstractMesh((4,), (mesh_lib.DATA,))
    assert mesh_lib.local_config(cfg, serve, data) is cfg
    assert llm_shard.shard_config(cfg.llm, 1) is cfg.llm
    assert mesh_lib.make_mesh(1).axis_names == (mesh_lib.DATA,)
    assert mesh_lib.make_mesh(1, model_parallel=1).axis_names == (mesh_lib.DATA, mesh_lib.MODEL)
    assert mesh_lib.param_specs(cfg, data) == mesh_lib.P()


def test_all_reduce_groups_reads_listed_and_iota_groups():
    hlo = "\n".join(
        [
            "  %a = f32[4]{0} all-reduce(f32[4]{0} %p), replica_groups={{0,1},{2,3}}",
            "  %b = f32[4]{0} all-reduce-start(f32[4]{0} %p), replica_groups=[2,2]<=[4]",
            "  %c = f32[4]{0} all-reduce-done(f32[4]{0} %b)",
            "  %d = f32[4]{0} all-reduce(f32[4]{0} %p), replica_groups=[2,2]<=[2,2]T(1,0)",
            "  %all-reduce.9 = f32[4]{0} add(f32[4]{0} %p, f32[4]{0} %p)",
        ]
    )
    rows = frozenset({(0, 1), (2, 3)})
    assert mesh_lib.all_reduce_groups(hlo) == {rows: 2, frozenset({(0, 2), (1, 3)}): 1}
