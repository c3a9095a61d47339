"""Tensor parallelism of the LLM over a ``model`` mesh axis (``mesh.make_mesh(model_parallel=)``).

The mesh runs in a subprocess (``tests/tp_worker.py``, 4 fake CPU devices), as in ``test_mesh``;
the tests assert on what it wrote. Layouts ``(data=2, model=2)`` and ``(data=1, model=4)`` (the
tiny preset's 2 KV heads and 2 Mamba groups are then each held by 2 devices, and each gated-norm
group spans 2) against one device stepping the same 4 slots, fp32 policy, over a script with
late admission, a release, a roll-over with a capsule (the tick's prefill path) and a held slot.

Tolerances. Tokens and codes must be bit for bit. The continuous values TP changes are the LLM's:
each row-parallel product is summed as m partial sums added by an all-reduce, a different
summation order than one device's dot, so the LLM state differs by rounding: measured at most
1.9e-6 (values up to ~4) after 4 beats; ``STATE_ATOL`` is 1e-5. The wav depends on the LLM only
through the tokens; it differs only where the per-device batch does (XLA's CPU kernels round
differently at batch 2 than at 4: measured 1.6e-7 at (2, 2), 0 at (1, 4)): ``WAV_ATOL`` 1e-6, as
``test_mesh``.

The worker compiles, as every process of the suite does, with ``tests/conftest.py``'s fast CPU
code generation flags (the same for the one-device reference), inherited through ``XLA_FLAGS``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from tests import tp_worker as w
from voicechat_jax import mesh as mesh_lib
from voicechat_jax.config import LLMConfig, ServeConfig, tiny
from voicechat_jax.model import nano
from voicechat_jax.precision import Precision

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE_ATOL = 1e-5  # LLM state after 4 beats, TP against one device (measured <= 1.9e-6)
WAV_ATOL = 1e-6  # as test_mesh: per-device batch 2 against 4 (measured <= 1.6e-7)
LAYOUTS = [f"d{d}m{m}" for d, m in w.LAYOUTS]


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = f" --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + flags).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    cmd = [sys.executable, "-m", "tests.tp_worker", str(out)]
    env = _env(w.DEVICES)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "result.json") as f:
        result = json.load(f)
    with np.load(out / "arrays.npz") as a:
        arrays = dict(a)
    return result, arrays


def _model(layout: str) -> int:
    return int(layout.split("m")[1])


def _data(layout: str) -> int:
    return int(layout[1 : layout.index("m")])


def test_worker_ran_on_four_devices(worker):
    result, _ = worker
    assert result["devices"] == w.DEVICES
    assert {k: tuple(v["mesh_shape"].values()) for k, v in result.items() if k in LAYOUTS} == {
        f"d{d}m{m}": (d, m) for d, m in w.LAYOUTS
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_tokens_and_codes_as_one_device(worker, layout):
    """Every beat, every slot that ran: text, function and codes bit for bit; wav to rounding."""
    _, a = worker
    for k in range(w.BEATS):
        for f in ("ran", "active", "frame", "reseeded"):
            np.testing.assert_array_equal(a[f"{layout}/beat{k}/{f}"], a[f"one/beat{k}/{f}"])
        ran = a[f"one/beat{k}/ran"]
        assert ran.any()
        for f in ("text", "function", "codes"):
            np.testing.assert_array_equal(
                a[f"{layout}/beat{k}/{f}"][ran], a[f"one/beat{k}/{f}"][ran], err_msg=f"{k} {f}"
            )
        wav = a[f"one/beat{k}/wav"][ran]
        assert np.abs(wav).max() > 1e-2  # real audio on both sides, not silence
        np.testing.assert_allclose(a[f"{layout}/beat{k}/wav"][ran], wav, rtol=0, atol=WAV_ATOL)
    # the script did what it says: a roll-over (prefill in the tick), a held slot, a late joiner
    assert a[f"one/beat{w.RESEED[0]}/reseeded"][w.RESEED[1]]
    assert not a[f"one/beat{w.HOLD[0]}/ran"][w.HOLD[1]]
    assert len({tuple(a[f"one/beat{k}/text"][ran].ravel()) for k in range(w.BEATS)}) > 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llm_state_equals_one_device_to_rounding(worker, layout):
    """The final LLM state, back in the one-device layout (``nano.state_from_tensor_parallel``:
    each channel and KV head from its first holder), equals one device's within STATE_ATOL."""
    _, a = worker
    n = sum(k.startswith("one/llm_state/") for k in a)
    assert n == len(jax.tree_util.tree_leaves(nano.init_state(w.CFG.llm, 1, 2, w.PREC)))
    one = [a[f"one/llm_state/{i}"] for i in range(n)]
    tp = [a[f"{layout}/llm_state/{i}"] for i in range(n)]
    chex.assert_trees_all_equal_shapes_and_dtypes(tp, one)
    chex.assert_trees_all_close(tp, one, rtol=0, atol=STATE_ATOL)
    assert one[-1].min() > w.TEMPLATE_LENGTH  # length: the slots advanced past the template


def _per_step(layout: str) -> int:
    """All-reduces of one LLM frame step: one per layer (its row-parallel product), plus one per
    Mamba layer for the gated norm when a B/C group spans devices."""
    llm = w.CFG.llm
    norm_ranks = nano.shard_config(llm, _model(layout)).norm_ranks
    return len(llm.pattern) + (norm_ranks > 1) * len(llm.layers_of("M"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_all_reduces_over_the_model_axis(worker, layout):
    """The compiled tick's only collectives are all-reduces within the ``model`` groups: one LLM
    frame step's (``_per_step``, inside the frame loop) and the roll-over prefill's, which has
    the same less the last layer's product (the prefill's hidden state is dropped, so XLA removes
    that product and its all-reduce; the tiny pattern ends with an attention layer)."""
    result, _ = worker
    r = result[layout]
    assert w.CFG.llm.pattern[-1] == "*"
    expected = _per_step(layout) + (_per_step(layout) - 1)
    assert r["collectives"] == {"all-reduce": expected}
    model_groups = [list(g) for g in r["model_groups"]]
    assert len(model_groups) == _data(layout)
    assert r["all_reduce_groups"] == [[model_groups, expected]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llm_state_sharded_over_model(worker, layout):
    """Each device keeps its slots' share of the heads: SSM state and KV caches split on their
    head axis, the conv state on its channels; everything else split by slot only."""
    result, _ = worker
    r, llm = result[layout], w.CFG.llm
    m, slots = _model(layout), w.SLOTS // _data(layout)
    local = nano.shard_config(llm, m)
    S = w.TEMPLATE_LENGTH + w.SERVE.context_frames
    assert r["state"] == {
        "ssm": {
            "spec": ["data", "model"],
            "shard": [slots, llm.mamba_heads // m, llm.mamba_head_dim, llm.ssm_state],
        },
        "conv": {
            "spec": ["data", None, None, "model"],
            "shard": [slots, len(llm.layers_of("M")), llm.conv_kernel - 1, local.conv_dim],
        },
        "k": {"spec": ["data", "model"], "shard": [slots, local.n_kv_heads, S, llm.head_dim]},
        "v": {"spec": ["data", "model"], "shard": [slots, local.n_kv_heads, S, llm.head_dim]},
        "length": {"spec": ["data"], "shard": [slots]},
    }
    assert r["state_leaves_sharded_over_model"] == r["state_leaves_llm"] - 1  # all but length
    assert r["other_state_specs"] == ["['data']"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llm_weights_sharded_megatron_style(worker, layout):
    result, _ = worker
    r, llm = result[layout], w.CFG.llm
    m = _model(layout)
    local = nano.shard_config(llm, m)
    L_m, L_f, L_a = (len(llm.layers_of(c)) for c in "M-*")
    D, NH = llm.d_model, llm.d_inner
    column, row, head = [None, None, "model"], [None, "model", None], [None, "model"]
    assert r["params"] == {
        "in_proj": {"spec": column, "shard": [L_m, D, local.in_proj_dim]},
        "conv_w": {"spec": column, "shard": [L_m, llm.conv_kernel, local.conv_dim]},
        "A_log": {"spec": head, "shard": [L_m, llm.mamba_heads // m]},
        "gate_norm": {"spec": head, "shard": [L_m, NH // m]},
        "out_proj": {"spec": row, "shard": [L_m, NH // m, D]},
        "q": {"spec": column, "shard": [L_a, D, llm.n_heads * llm.head_dim // m]},
        "k": {"spec": column, "shard": [L_a, D, local.n_kv_heads * llm.head_dim]},
        "o": {"spec": row, "shard": [L_a, llm.n_heads * llm.head_dim // m, D]},
        "up": {"spec": column, "shard": [L_f, D, llm.mlp_dim // m]},
        "down": {"spec": row, "shard": [L_f, llm.mlp_dim // m, D]},
        "embed": {"spec": [], "shard": [llm.vocab_size, D]},
        "lm_head": {"spec": [], "shard": [D, llm.vocab_size]},
        "norm_f": {"spec": [], "shard": [D]},
    }
    assert r["other_params_specs"] == ["[]"]  # encoder, RNNT, speech decoder, codec replicated


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_compile_and_the_state_donated(worker, layout):
    """One compilation of the tick for two runs of the script (a reset between), and every beat
    consumed the previous state's buffers."""
    result, _ = worker
    assert result[layout]["compiles"] == 1
    assert result[layout]["donated"] == [True] * w.BEATS


# ---- one device (this process) ---------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 4])
def test_tensor_parallel_layout_round_trip(m):
    """The layout's index covers every one-device channel and KV head (a permutation where m
    divides the groups and KV heads); a state there and back is unchanged."""
    llm = w.CFG.llm
    idx = nano.tensor_parallel_index(llm, m)
    local = nano.shard_config(llm, m)
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
        jax.eval_shape(lambda: nano.init_state(llm, 2, 5, w.PREC)),
    )
    back = nano.state_from_tensor_parallel(nano.state_to_tensor_parallel(state, llm, m), llm, m)
    chex.assert_trees_all_equal(back, state)


def test_indivisible_sizes_are_one_line_errors():
    llm = w.CFG.llm  # n_heads 4, n_kv_heads 2, mamba_heads 8, n_groups 2, mlp_dim 96
    with pytest.raises(ValueError, match=r"^model_parallel=3 does not divide the LLM's n_heads=4$"):
        nano.shard_config(llm, 3)
    odd_groups = LLMConfig(**{**_fields(llm), "mamba_heads": 12, "n_groups": 3})
    with pytest.raises(ValueError, match="model_parallel=2 and the LLM's n_groups=3: neither"):
        nano.shard_config(odd_groups, 2)
    wide = LLMConfig(**{**_fields(llm), "mlp_dim": 90})
    with pytest.raises(ValueError, match="does not divide the LLM's mlp_dim=90"):
        nano.shard_config(wide, 4)
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
    assert nano.shard_config(cfg.llm, 1) is cfg.llm
    assert mesh_lib.make_mesh(1).axis_names == (mesh_lib.DATA,)
    assert mesh_lib.make_mesh(1, model_parallel=1).axis_names == (mesh_lib.DATA, mesh_lib.MODEL)
    assert mesh_lib.param_specs(data) == mesh_lib.P()


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


BAD_FLAGS = [
    ("--model_parallel=2", 1, "--model_parallel=2 does not divide --devices=1"),
    ("--devices=4 --model_parallel=3", 4, "--model_parallel=3 does not divide --devices=4"),
    (
        "--devices=4 --model_parallel=2 --slots=3",
        4,
        "--slots=3 does not split evenly over the 2 groups of --model_parallel=2 devices",
    ),
    (
        "--devices=3 --model_parallel=3 --slots=3",
        4,
        "--model_parallel=3: model_parallel=3 does not divide the LLM's n_heads=4",
    ),
]


@pytest.mark.parametrize(("flags", "devices", "message"), BAD_FLAGS, ids=[f for f, *_ in BAD_FLAGS])
def test_serve_refuses_a_model_parallel_it_cannot_serve(tmp_path, flags, devices, message):
    """``voicechat-serve`` refuses in one line (exit 2) before building anything."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "voicechat_jax.cli.serve", f"--output_dir={out}", *flags.split()]
    proc = subprocess.run(cmd, env=_env(devices), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("voicechat-serve: ")
    assert message in lines[0]
    assert not (out / "metrics.jsonl").exists()
