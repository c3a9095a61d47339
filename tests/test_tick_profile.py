"""experiments/tick_profile's reducer: on a hand-written HLO module and traces in both formats (GPU
kernels, CPU thunks), and on the committed H200 trace, which it reduces again to the committed
rows."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from experiments.tick_profile import reduce as reduce_lib

HLO = """HloModule jit_tick, entry_computation_layout={(f32[8,64]{1,0})->f32[8,64]{1,0}}

FileNames
1 "/elsewhere/repo/voicechat_jax/step.py"
2 "/elsewhere/repo/voicechat_jax/model/nano.py"
3 "/elsewhere/repo/voicechat_jax/model/gemma.py"

FunctionNames
1 "tick"
2 "_mamba_step"
3 "forward"
4 "init"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=2 end_line=2 column=1 end_column=9}
3 {file_name_id=3 function_name_id=3 line=2 end_line=3 column=1 end_column=9}
4 {file_name_id=2 function_name_id=4 line=1 end_line=1 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}
4 {file_location_id=4 parent_frame_id=3}


%fused_dus (p0: f32[8,1024], p1: f32[8,1], p2: s32[]) -> f32[8,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = f32[8,1]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c0 = s32[] constant(0)
  ROOT %dus = f32[8,1024]{1,0} dynamic-update-slice(%p0, %p1, %c0, %p2), metadata={op_name="jit(tick)/dynamic_update_slice" stack_frame_id=3}
}

%fused_read (p0.1: f32[8,1024], p1.1: s32[]) -> f32[8,16] {
  %p0.1 = f32[8,1024]{1,0} parameter(0)
  %p1.1 = s32[] parameter(1)
  %c1 = s32[] constant(0)
  %ds = f32[8,16]{1,0} dynamic-slice(%p0.1, %c1, %p1.1), dynamic_slice_sizes={8,16}
  ROOT %neg = f32[8,16]{1,0} negate(%ds), metadata={op_name="jit(tick)/neg" stack_frame_id=3}
}

%fused_mul (p0.2: f32[8,64], p1.2: f32[64,32]) -> f32[8,32] {
  %p0.2 = f32[8,64]{1,0} parameter(0)
  %p1.2 = f32[64,32]{1,0} parameter(1)
  ROOT %d = f32[8,32]{1,0} dot(%p0.2, %p1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.1 (x: f32[8,64], w: f32[64,32], cache: f32[8,1024], u: f32[8,1], i: s32[]) -> (f32[8,32], f32[8,1024], f32[8,64], f32[8,16], f32[8,32]) {
  %x = f32[8,64]{1,0} parameter(0), metadata={op_name="x"}
  %w = f32[64,32]{1,0} parameter(1), metadata={op_name="w"}
  %cache = f32[8,1024]{1,0} parameter(2), metadata={op_name="cache"}
  %u = f32[8,1]{1,0} parameter(3), metadata={op_name="u"}
  %i = s32[] parameter(4), metadata={op_name="i"}
  %gemm = (f32[8,32]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(tick)/dot_general" stack_frame_id=2}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %gte = f32[8,32]{1,0} get-tuple-element(%gemm), index=0
  %upd = f32[8,1024]{1,0} fusion(%cache, %u, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(tick)/dynamic_update_slice" stack_frame_id=3}
  %rd = f32[8,16]{1,0} fusion(%upd, %i), kind=kLoop, calls=%fused_read
  %stale = f32[8,64]{1,0} add(%x, %x), metadata={op_name="jit(tick)/add" stack_frame_id=4}
  %cp = f32[8,64]{1,0} copy(%stale)
  %mm = f32[8,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_mul, metadata={op_name="jit(tick)/dot_general" stack_frame_id=2}
  ROOT %t = (f32[8,32]{1,0}, f32[8,1024]{1,0}, f32[8,64]{1,0}, f32[8,16]{1,0}, f32[8,32]{1,0}) tuple(%gte, %upd, %cp, %rd, %mm)
}
"""  # noqa: E501 (HLO as XLA prints it)


GEMM_FUSION = """

%fused_gemm (p0: f32[8,64], p1: f32[64,32]) -> f32[8,32] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = f32[64,32]{1,0} parameter(1)
  %d = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(tick)/dot_general" stack_frame_id=2}
  ROOT %n = f32[8,32]{1,0} negate(%d), metadata={op_name="jit(tick)/neg" stack_frame_id=3}
}

ENTRY %main.2 (x: f32[8,64], w: f32[64,32]) -> f32[8,32] {
  %x = f32[8,64]{1,0} parameter(0), metadata={op_name="x"}
  %w = f32[64,32]{1,0} parameter(1), metadata={op_name="w"}
  ROOT %g = f32[8,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_gemm, metadata={op_name="jit(tick)/neg" stack_frame_id=3}
}
"""  # noqa: E501 (HLO as XLA prints it): a GEMM fusion whose root is not its product


@pytest.fixture
def sources(tmp_path):
    """A repository whose gemma.py line 2-3 is an attention call and nano.py a projection."""
    model = tmp_path / "voicechat_jax" / "model"
    model.mkdir(parents=True)
    (model / "gemma.py").write_text("def forward():\n    a = attend(\n        q)\n")
    (model / "nano.py").write_text("def init():\n    zxbcdt = matmul(h, p.in_proj)\n")
    return reduce_lib.Sources(str(tmp_path))


@pytest.fixture
def hlo():
    return reduce_lib.parse_hlo(HLO)


def test_parse(hlo):
    assert hlo.module == "jit_tick"
    assert hlo.instrs["gemm"].opcode == "custom-call"
    assert hlo.instrs["upd"].calls == "fused_dus"
    assert hlo.roots["fused_dus"] == "dus"
    # The printed parent of frame 2 is "2": one above the real parent, frame 1.
    assert [f.function for f in hlo.stack(2)] == ["tick", "_mamba_step"]


def test_foreign_tail_is_cut(hlo):
    # Frame 4 is nano.init, reached below _mamba_step: a reused trace of the random init.
    assert [f.function for f in hlo.stack(4)] == ["tick", "_mamba_step"]


def test_classify(hlo, sources):
    def comp(name):
        return reduce_lib.classify(reduce_lib.instr_stack(hlo, hlo.instrs[name]), sources)

    assert comp("gemm") == "LLM Mamba"
    assert comp("upd") == "TTS backbone attention"  # gemma.forward at the attend() line
    assert comp("rd") == "TTS backbone attention"  # no metadata of its own: its root's
    assert comp("stale") == "LLM Mamba"
    assert comp("cp") == "LLM Mamba"  # added by XLA: its operand's stack


def test_codec_in_attention_is_classified(sources):
    """With ``codec_in_attention``: the one launch of attention and product is its own
    component; the codec's code resumed inside the speech decoder, and XLA's products for it,
    are the codec's."""
    R = "/elsewhere/repo/"

    def at(path, function, line=2):
        return reduce_lib.Frame(R + path, function, line, line)

    forward = at("voicechat_jax/model/gemma.py", "forward")  # the attend() line
    attend = at("voicechat_jax/model/beside.py", "Beside.attend")
    fused = at("pallas_kernels/attention_product.py", "attention_and_product")
    resumed = at("voicechat_jax/model/codec.py", "decode_step_products")
    by_xla = at("voicechat_jax/model/beside.py", "xla_product")
    classify = reduce_lib.classify
    assert classify([forward, attend, fused], sources) == "TTS attention + codec products"
    assert classify([forward, attend, resumed], sources) == "codec"
    assert classify([forward, attend, by_xla], sources) == "codec"
    assert classify([forward], sources) == "TTS backbone attention"


def test_a_gemm_fusion_is_its_products(sources):
    """A fusion that holds a product is classified by the product, not by its root: a fused
    q|k|v's kernel whose root is the split of its columns, or a norm fused before a product."""
    h = reduce_lib.parse_hlo(HLO.split("\n\n%fused_dus")[0] + GEMM_FUSION)
    stack = reduce_lib.instr_stack(h, h.instrs["g"])
    assert reduce_lib.classify(stack, sources) == "LLM Mamba"  # the dot's; the root's is gemma's


def test_bytes_and_flops(hlo):
    b = reduce_lib.instr_bytes
    assert b(hlo, hlo.instrs["gemm"]) == 8 * 64 * 4 + 64 * 32 * 4 + 8 * 32 * 4  # no workspace
    assert reduce_lib.instr_flops(hlo, hlo.instrs["gemm"]) == 2 * 8 * 32 * 64
    assert reduce_lib.instr_flops(hlo, hlo.instrs["mm"]) == 2 * 8 * 32 * 64  # a dot inside a fusion
    # In place: the cache is neither read nor written whole, only the [8, 1] update.
    assert b(hlo, hlo.instrs["upd"]) == (8 * 4 + 4) + 8 * 4
    # Sliced: the fusion reads the [8, 16] slice of the cache, not all of it.
    assert b(hlo, hlo.instrs["rd"]) == (8 * 16 * 4 + 4) + 8 * 16 * 4
    assert b(hlo, hlo.instrs["gte"]) == 0


def _meta(pid, tid, process, thread):
    return [
        {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process}},
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}},
    ]


def _x(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def gpu_trace() -> dict:
    ev = _meta(1, 7, "/device:GPU:0", "Stream #7(Compute)") + _meta(701, 1, "/host:CPU", "py")
    ev += [{"ph": "M", "pid": 1, "tid": 200, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    for k, t0 in enumerate((0.0, 200.0)):
        ev.append(_x(701, 1, f"tick {k}", t0, 100.0))
        graph = {"hlo_op": "command_buffer_1", "hlo_module": "jit_tick"}  # a CUDA graph's
        ev += [
            _x(1, 7, "sm90_xmma_gemm_part1", t0 + 10, 5, **graph),  # cuBLAS: found by kind
            _x(1, 7, "sm90_xmma_gemm_part2", t0 + 15, 5, **graph),
            _x(1, 7, "upd", t0 + 30, 10, hlo_op="upd", hlo_module="jit_tick"),
            _x(1, 7, "stale", t0 + 50, 5, **graph),  # a fusion's kernel: found by its name
            _x(1, 7, "memcpy128", t0 + 55, 5, **graph),  # the copy after it
            _x(1, 200, "upd", t0 + 30, 60, hlo_op="upd"),  # a derived line: not a kernel
        ]
    return {"traceEvents": ev}


def test_gpu_trace(hlo, sources):
    trace = gpu_trace()
    events, kind, lines, _ = reduce_lib.device_events(trace, [hlo])
    assert kind == "gpu"
    assert lines == ["Stream #7(Compute)"]
    assert [e.hlo_op for e in events[:5]] == ["gemm", "gemm", "upd", "stale", "cp"]
    red = reduce_lib.reduce_window(events, [hlo], sources, reduce_lib.windows(trace, "tick "))
    mamba = red["components"]["LLM Mamba"]
    assert mamba.us == pytest.approx(20.0)  # gemm 10 + add 5 + copy 5, per tick
    assert mamba.launches == 4
    assert mamba.executions == 3  # the gemm's two kernels are one execution
    assert mamba.memcpy_us == pytest.approx(5.0)  # the memcpy node
    assert mamba.flops == 2 * 8 * 32 * 64
    assert red["components"]["TTS backbone attention"].us == pytest.approx(10.0)
    # By operation: the component's kernels grouped by what they compute, scopes stripped.
    ops = {(o["component"], o["op"]): o for o in red["ops"]}
    assert sum(o["us_per_span"] for o in red["ops"]) == pytest.approx(
        sum(c.us for name, c in red["components"].items() if name != "other")
    )
    gemm = ops[("LLM Mamba", "dot_general")]
    assert gemm["flops_per_span"] == mamba.flops
    assert reduce_lib.op_label("jit(tick)/while/body/eval_jaxpr/bkgts,bksh->bkgth/dot_general",
                               "fusion") == "bkgts,bksh->bkgth/dot_general"  # fmt: skip
    assert reduce_lib.op_label("", "copy") == "copy"
    span = red["spans"][0]
    assert span["busy_us"] == pytest.approx(30.0)
    assert span["kernel_span_us"] == pytest.approx(50.0)
    assert span["idle_us"] == pytest.approx(20.0)
    assert span["wall_us"] == pytest.approx(100.0)


REUSE = """HloModule jit_tick, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fx (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}

%fy (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  ROOT %m = f32[8]{0} negate(%q)
}

ENTRY %main (x: f32[8], w: f32[8,8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %a = f32[8]{0} fusion(%x), kind=kLoop, calls=%fx
  %g1 = (f32[8]{0}, s8[4]{0}) custom-call(%a, %w), custom_call_target="__cublas$gemm"
  %t1 = f32[8]{0} get-tuple-element(%g1), index=0
  %b = f32[8]{0} fusion(%t1), kind=kLoop, calls=%fy
  %g2 = (f32[8]{0}, s8[4]{0}) custom-call(%b, %w), custom_call_target="__cublas$gemm"
  ROOT %t2 = f32[8]{0} get-tuple-element(%g2), index=0
}
"""


def test_command_buffer_alignment():
    """In a CUDA graph: fusion b reuses a's kernel (same body and shapes), so both run as
    kernel "a"; the cuBLAS kernels between are matched to the products scheduled there."""
    hlo = reduce_lib.parse_hlo(REUSE)
    graph = {"hlo_op": "command_buffer_3", "hlo_module": "jit_tick", "cuda_graph_id": "9"}
    ev = _meta(1, 7, "/device:GPU:0", "Stream #7(Compute)")
    for i, name in enumerate(("a", "sm90_xmma_gemm", "a", "nvjet_sm90_tss")):
        ev.append(_x(1, 7, name, 10.0 * i, 5, cuda_graph_node_id=str(i), **graph))
    events, _, _, how = reduce_lib.device_events({"traceEvents": ev}, [hlo])
    assert [e.hlo_op for e in events] == ["a", "g1", "b", "g2"]
    assert how["jit_tick"] == {"by name": 2, "between anchors": 2}


def test_cpu_trace(hlo, sources):
    hlo.instrs["loop"] = reduce_lib.Instr("loop", "f32[8,64]", "while", [], "", "main.1")
    ev = _meta(701, 3, "/host:CPU", "tf_XLAPjRtCpuClient/1")
    ev += [
        _x(701, 3, "tick 0", 0.0, 100.0),
        _x(701, 3, "loop", 5, 50, hlo_op="loop", hlo_module="jit_tick"),  # holds the next two
        _x(701, 3, "gemm", 10, 20, hlo_op="gemm", hlo_module="jit_tick"),
        _x(701, 3, "end: gemm", 30, 1),
        _x(701, 3, "upd", 40, 10, hlo_op="upd", hlo_module="jit_tick"),
    ]
    trace = {"traceEvents": ev}
    events, kind, _, _ = reduce_lib.device_events(trace, [hlo])
    assert kind == "cpu"
    assert [e.hlo_op for e in events] == ["gemm", "upd"]
    red = reduce_lib.reduce_window(events, [hlo], sources, reduce_lib.windows(trace, "tick "))
    assert red["components"]["LLM Mamba"].us == pytest.approx(20.0)
    assert red["spans"][0]["busy_us"] == pytest.approx(30.0)


def test_function_at(tmp_path):
    (tmp_path / "voicechat_jax").mkdir()
    (tmp_path / "voicechat_jax" / "m.py").write_text(
        "def outer():\n    def inner():\n        return 1\n    return inner\n"
    )
    src = reduce_lib.Sources(str(tmp_path))
    assert src.function_at("/x/voicechat_jax/m.py", 3) == "outer.<locals>.inner"
    assert src.function_at("/x/voicechat_jax/m.py", 4) == "outer"


def test_assign_by_gaps_when_clocks_differ():
    ev = [reduce_lib.Event("k", t, 1.0, 1, 1, None, None) for t in (1e6, 1e6 + 2, 1e6 + 50)]
    runs = reduce_lib.assign(ev, [(0.0, 10.0), (20.0, 30.0)])  # no event inside either span
    assert [len(r) for r in runs] == [2, 1]


def test_union():
    assert reduce_lib.union_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert reduce_lib.union_us([]) == 0


RESULTS = (
    pathlib.Path(__file__).resolve().parent.parent / "experiments" / "tick_profile" / "results"
)


def test_the_committed_h200_trace_reduces_to_the_committed_rows(tmp_path):
    """``run.py --reduce_only`` on the committed H200 traces and HLO (72 and 112 slots) gives the
    committed components, to the microsecond; every component of the tick appears, 'other' is
    small, and the components add up to the tick's kernels."""
    run = shutil.copytree(RESULTS / "h200_call1", tmp_path / "h200_call1")
    committed = [json.loads(x) for x in (run / "reduced.jsonl").read_text().splitlines()]
    env = {**os.environ, "PYTHONPATH": str(RESULTS.parents[2])}
    script = RESULTS.parent / "run.py"
    subprocess.run([sys.executable, str(script), f"--reduce_only={run}"], check=True, env=env,
                   capture_output=True, timeout=120)  # fmt: skip
    again = [json.loads(x) for x in (run / "reduced.jsonl").read_text().splitlines()]
    again = again[len(committed) :]

    def components(rows):
        return {
            (r["slots"], r["component"]): (round(r["ms"], 3), r["launches"])
            for r in rows
            if r["kind"] == "component"
        }

    assert components(again) == components(committed)
    for slots in (72, 112):
        comps = {
            r["component"]: r for r in again if r["kind"] == "component" and r["slots"] == slots
        }
        tick = next(r for r in again if r["kind"] == "tick" and r["slots"] == slots)
        assert tick["trace_kind"] == "gpu"
        assert {"encoder", "LLM Mamba", "LLM MLP", "TTS backbone attention", "MoG head",
                "codec"} <= set(comps)  # fmt: skip
        total = sum(r["ms"] for r in comps.values())
        assert total == pytest.approx(tick["kernel_sum_ms"], rel=0.01)
        # the device's idle time, each gap charged to the component whose kernel came next
        idle = sum(r["idle_before_ms"] for r in comps.values())
        spans = [t["idle_us"] / 1e3 for t in tick["per_tick"]]
        assert idle == pytest.approx(sum(spans) / len(spans), rel=1e-6)
        assert comps.get("other", {"ms": 0})["ms"] < 0.05 * total
