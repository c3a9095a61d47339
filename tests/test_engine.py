"""The session engine on the tiny random model: docs/serving.md §5's gates, both loops, the tick.

Every run here uses the offline clock (beats back to back), so outputs are reproducible; the
real-time clock is exercised by the CLI test.
"""

from __future__ import annotations

import functools
import json
import struct
import wave

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import shared
from tests.test_staged_tick import mirror_agrees
from voicechat_jax import callback_cache
from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import Kernels, ServeConfig, tiny
from voicechat_jax.model import codec as codec_lib
from voicechat_jax.model import conformer, ear_tts, rnnt, voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving import runner
from voicechat_jax.serving.server import Engine, Server, SessionPlan, session_key
from voicechat_jax.slot_rule import SlotRule

CFG = tiny()
PREC = Precision.fp32()
SPF = 1280
BEAT = 2 * SPF


@pytest.fixture(scope="module")
def params():
    return shared.params(PREC)


@pytest.fixture(scope="module")
def engine(params):
    """One engine (template + compiled tick) shared by the runs; ``reset`` before each."""
    return shared.engine(ServeConfig(slots=3, frames_per_tick=2, context_frames=64, precision=PREC))


def _speech(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    tone = np.sin(2 * np.pi * (150 + 100 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 2 * t))
    return (0.3 * tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _serve(engine, plans, n_ticks, *, loop="dispatch", warmup_ticks=2) -> Server:
    engine.reset()
    server = Server(engine, clock="offline", loop=loop, warmup_ticks=warmup_ticks, seed=7)
    server.run(plans, n_ticks)
    return server


def _out(server, sid) -> dict[str, np.ndarray]:
    return server.logs[sid].arrays()


def _same(a: dict, b: dict) -> None:
    for k in ("text", "function", "codes", "wav"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_capacity_refuses_n_plus_one(engine):
    plans = [SessionPlan(id=f"c{i}", audio=_speech(1, i)) for i in range(4)]
    server = _serve(engine, plans, 4)
    assert sorted(server.logs) == ["c0", "c1", "c2"]
    assert "server full: 3 of 3 slots in use; session c3 refused" in server.failures["c3"]
    assert server.metrics.summary()["events"]["refused"] == 1


def test_reused_slot_equals_fresh_server(engine):
    """A session in a slot another session just left gives exactly its fresh-server output."""
    a = SessionPlan(id="a", audio=_speech(2, 1), join=0, leave=5)
    b = SessionPlan(id="b", audio=_speech(2, 2), join=5)
    c = SessionPlan(id="c", audio=_speech(2, 3), join=0)  # a neighbour, live throughout
    reused = _serve(engine, [a, c, b], 12)
    assert reused.logs["b"].arrays()["text"].size == 7 * 2
    fresh = _serve(engine, [SessionPlan(id="b", audio=_speech(2, 2), join=0)], 7)
    _same(_out(reused, "b"), _out(fresh, "b"))


def test_churn_every_tick_compiles_once(params):
    """Sessions join and leave on every tick at full load; each program compiles exactly once."""
    events, recording = [], [True]

    def listener(event, duration, **kw):
        if recording[0] and event == "/jax/core/compile/backend_compile_duration":
            events.append(kw.get("fun_name"))

    serve = ServeConfig(slots=2, frames_per_tick=2, context_frames=64, precision=PREC)
    engine = Engine(params, CFG, serve)
    plans = []
    for k in range(10):  # each tick one session leaves and another joins its slot
        plans.append(SessionPlan(id=f"j{k}", audio=_speech(1, k), join=k, leave=k + 2))
    jax.monitoring.register_event_duration_secs_listener(listener)
    with step_lib.CompileCounter("tick") as compiles:
        server = Server(engine, clock="offline", loop="dispatch", warmup_ticks=0)
        server.run(plans, 12)
    recording[0] = False
    assert compiles.count == 1
    assert engine.staged
    # The tick and its staged admission, three roll-over programs (a capsule prefilled in the
    # beat, none, one prefilled a beat ahead) and the capsule prefill, once each; the outputs'
    # packing (``Engine.pack``, one program for every engine of these shapes) at most once.
    packing = events.count("jit(pack_output)")
    assert len(events) - packing == 6
    assert packing <= 1
    summary = server.metrics.summary()
    assert summary["events"]["admitted"] == 10
    assert summary["events"].get("refused", 0) == 0
    # An engine built again for the same configuration (a restart, the app run again in one
    # process) compiles nothing: its template, tick and staged programs are the process's
    # (``step.PROGRAMS_KEPT``).
    events.clear()
    recording[0] = True
    again = Engine(params, CFG, serve)
    Server(again, clock="offline", loop="dispatch", warmup_ticks=0).run(plans, 12)
    recording[0] = False
    assert events == []


def test_late_input_is_silence_plus_underrun(engine):
    """Audio that misses its beat becomes silence and one underrun; it is played a beat late."""
    x = _speech(2, 4)
    late = _serve(engine, [SessionPlan(id="l", audio=x, late=frozenset({3}))], 8)
    assert late.queues.underruns == 1
    shifted = np.concatenate([x[: 3 * BEAT], np.zeros(BEAT, np.float32), x[3 * BEAT :]])
    ref = _serve(engine, [SessionPlan(id="l", audio=shifted)], 8)
    assert ref.queues.underruns == 0
    _same(_out(late, "l"), _out(ref, "l"))


def test_warmup_reported_apart(engine):
    server = _serve(engine, [SessionPlan(id="w", audio=_speech(1, 5))], 6, warmup_ticks=2)
    summary = server.metrics.summary()
    assert summary["warmup"]["ticks"] == 2
    assert summary["ticks"] == 4
    assert "tick" in summary["compile_s"]


def test_bad_input_fails_only_that_session(engine):
    """NaN audio mid-call fails that session alone; the others' outputs do not change."""
    good = [SessionPlan(id=f"g{i}", audio=_speech(2, 10 + i)) for i in range(2)]
    bad_audio = _speech(2, 12)
    bad_audio[3 * BEAT + 100] = np.nan
    with_bad = _serve(engine, [*good, SessionPlan(id="bad", audio=bad_audio)], 8)
    assert "NaN" in with_bad.failures["bad"] or "nan" in with_bad.failures["bad"].lower()
    assert with_bad.ended["bad"].startswith("failed")
    alone = _serve(engine, good, 8)
    for p in good:
        _same(_out(with_bad, p.id), _out(alone, p.id))


def test_resident_equals_dispatch_and_loads_in_a_new_engine(params, engine):
    """The two loops serve the same frames; and the resident loop, kept beside the suite's
    compilation cache (``callback_cache``), loads in a second engine of the configuration (a new
    process's, in effect) instead of compiling, bound to that engine's server's callbacks."""
    plans = [
        SessionPlan(id="r0", audio=_speech(2, 20)),
        SessionPlan(id="r1", audio=_speech(2, 21), join=2, leave=6),
    ]
    resident = _serve(engine, plans, 8, loop="resident")
    dispatch = _serve(engine, plans, 8, loop="dispatch")
    before = callback_cache.stats()
    fresh = Engine(params, CFG, engine.serve, template=shared.template(engine.serve))
    loaded = _serve(fresh, plans, 8, loop="resident")
    assert callback_cache.stats()["loaded"] == before["loaded"] + 1
    for p in plans:
        _same(_out(resident, p.id), _out(dispatch, p.id))
        _same(_out(resident, p.id), _out(loaded, p.id))


def test_resident_warm_up_runs_one_iteration_aside_from_the_host(engine):
    """``warm_resident`` runs the compiled loop once without calling the host's callbacks and
    leaves every slot fresh; the callbacks are the loop's again afterwards."""
    calls = []

    def next_beat(i):
        calls.append(("next", i))
        return engine.empty_beat(), np.asarray(True)

    engine.reset()
    fresh = jax.tree.map(np.asarray, engine.state)
    compiled = engine.compile_resident(next_beat, lambda i, out: calls.append(("deliver", i)))
    assert engine.warm_resident(compiled) > 0
    assert calls == []
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, engine.state), fresh)
    engine.run_resident(compiled, engine.empty_beat())
    assert calls == [("deliver", 0), ("next", 0)]


def test_served_frames_equal_the_model_alone(engine, params):
    """A served session's frames equal ``voicechat.advance`` on its audio alone, frame by frame;
    and so do the frames of ``advance`` with the codec on a second stream or in the speech
    decoder's attention launches."""
    x = _speech(2, 30)
    server = _serve(engine, [SessionPlan(id="m", audio=x)], 6)
    served = _out(server, "m")
    template = shared.template(engine.serve)  # the served sessions' own fresh state
    advance = jax.jit(
        functools.partial(voicechat.advance, cfg=CFG, precision=PREC, deterministic=False)
    )
    key = jnp.asarray(session_key(7, "m"))[None]
    state, text, codes, wav = template, [], [], []
    for t in range(6):
        state, out = advance(params, state, jnp.asarray(x[None, t * BEAT : (t + 1) * BEAT]), key)
        text.append(np.asarray(out.text[0]))
        codes.append(np.asarray(out.codes[0]))
        wav.append(np.asarray(out.wav[0]))
    np.testing.assert_array_equal(served["text"], np.concatenate(text))
    np.testing.assert_array_equal(served["codes"], np.concatenate(codes))
    # The waveform is computed in a batch of 3 slots vs 1: XLA's CPU kernels may round differently
    # per batch size (seen: 2e-7 absolute), never the tokens or codes.
    np.testing.assert_allclose(served["wav"], np.concatenate(wav), rtol=0, atol=1e-5)

    # The beat's frames unrolled and each frame's codes decoded apart: on a second stream
    # (``codec_stream``, program order off a GPU), or as products handed to the next frame's
    # speech-decoder attention (``codec_in_attention``; XLA's attention here, so XLA's products
    # at those places): the same tokens, codes and state; the waveform, decoded a frame at a
    # time, to fp32 rounding.
    for kernels in (Kernels(codec_stream=True), Kernels(codec_in_attention=True)):
        streamed = jax.jit(
            functools.partial(
                voicechat.advance, cfg=CFG, precision=PREC, deterministic=False, kernels=kernels
            )
        )
        other = template
        for t in range(6):
            beat = jnp.asarray(x[None, t * BEAT : (t + 1) * BEAT])
            other, out = streamed(params, other, beat, key)
            np.testing.assert_array_equal(out.text[0], text[t])
            np.testing.assert_array_equal(out.codes[0], codes[t])
            np.testing.assert_allclose(out.wav[0], wav[t], rtol=0, atol=1e-5)
        chex.assert_trees_all_close(other, state, atol=1e-5, rtol=0)

    # The codec a frame behind (``codec_frame_behind``), beside a slot that does not run and
    # holds a pending frame of its own: the same tokens and codes; the waveform one frame later,
    # led by a frame of silence; the last frame's codes pending, and decoding them gives its
    # audio and the codec state of the codec in time. The slot that does not run is unchanged.
    behind = jax.jit(
        functools.partial(
            voicechat.advance,
            cfg=CFG,
            precision=PREC,
            deterministic=False,
            kernels=Kernels(codec_in_attention=True, codec_frame_behind=True),
        )
    )
    fresh = shared.initial_state(
        params, cfg=CFG, precision=PREC, max_len=64, codec_frame_behind=True
    )
    idle = fresh.replace(codec=fresh.codec.replace(pending=jnp.zeros_like(fresh.codec.pending)))
    pair = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), fresh, idle)
    run, keys, lagged = jnp.asarray([True, False]), jnp.concatenate([key, key]), []
    for t in range(6):
        beat = jnp.asarray(np.stack([x[t * BEAT : (t + 1) * BEAT]] * 2))
        pair, out = behind(params, pair, beat, keys, run)
        np.testing.assert_array_equal(out.text[0], text[t])
        np.testing.assert_array_equal(out.codes[0], codes[t])
        lagged.append(np.asarray(out.wav[0]))
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[1:], pair), idle)
    spf, whole = CFG.codec.samples_per_frame, np.concatenate(wav)
    np.testing.assert_array_equal(lagged[0][:spf], 0.0)
    np.testing.assert_allclose(np.concatenate(lagged)[spf:], whole[:-spf], rtol=0, atol=1e-5)
    last = jax.tree.map(lambda a: a[:1], pair)
    waiting = ear_tts.replace_control_codes(params.tts, out.codes[0, -1])
    np.testing.assert_array_equal(last.codec.pending[0], waiting)
    flushed, tail = codec_lib.decode_step(
        params.codec, last.codec, last.codec.pending[:, None], cfg=CFG.codec
    )
    np.testing.assert_allclose(tail[0], whole[-spf:], rtol=0, atol=1e-5)
    chex.assert_trees_all_close(flushed.replace(pending=None), state.codec, atol=1e-5, rtol=0)
    chex.assert_trees_all_close(last.replace(codec=state.codec), state, atol=1e-5, rtol=0)


def _sliced_weights(params, template) -> set[str]:
    """The params (by path) that one ``voicechat.advance`` frame slices or indexes into, through
    every nested jaxpr (a sub-jaxpr's inputs are the last of its equation's). A slice that keeps
    every element (``w[0]`` of a [1, ...] conv weight) is a reshape, not a copy, and is not
    counted."""
    step = functools.partial(voicechat.advance, cfg=CFG, precision=PREC, deterministic=False)
    audio, key = jnp.zeros((1, BEAT), jnp.float32), jax.random.key_data(jax.random.key(0))[None]
    jaxpr = jax.make_jaxpr(step)(params, template, audio, key).jaxpr
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    cut = {"slice", "dynamic_slice", "gather", "squeeze"}
    found: set[str] = set()

    def walk(jaxpr, leaf: dict) -> None:
        def of(v):  # the param a variable is, if any (literals are none)
            return None if hasattr(v, "val") else leaf.get(v)

        for e in jaxpr.eqns:
            if e.primitive.name in cut and e.outvars[0].aval.size < e.invars[0].aval.size:
                found.update(p for v in e.invars if (p := of(v)) is not None)
            for sub in shared.sub_jaxprs(e):
                outer = e.invars[len(e.invars) - len(sub.invars) :]
                pairs = zip(sub.invars, outer, strict=True)
                walk(sub, {i: of(o) for i, o in pairs if of(o) is not None})

    walk(jaxpr, dict(zip(jaxpr.invars[: len(paths)], paths, strict=True)))
    return found


def test_served_products_are_one_leaf_per_layer(engine, params):
    """The engine serves the products of the LLM, the speech decoder backbone and the MoG trunk
    one leaf per layer (``voicechat.serving_layout``): a frame takes no slice of them, where the
    stored layout takes one per layer (each a copy before its product on a GPU). The frames stay
    the model's
    (``test_served_frames_equal_the_model_alone``)."""
    products = {".in_proj", ".out_proj", ".up", ".down", ".q", ".k", ".v", ".o", ".gate"}
    products |= {".qkv", ".gate_up"}
    template = shared.template(engine.serve)

    def streamed(paths):
        ours = (p for p in paths if any(f".{x}." in p for x in ("llm", "backbone", "mog")))
        return {p for p in ours if p.endswith(tuple(products))}

    stored = streamed(_sliced_weights(params, template))
    assert {".llm.mamba.in_proj", ".llm.mlp.down", ".tts.backbone.gate", ".tts.mog.up"} <= stored
    assert streamed(_sliced_weights(engine.params, template)) == set()
    up = engine.params.llm.mlp.up
    chex.assert_trees_all_equal(up, tuple(params.llm.mlp.up[i] for i in range(len(up))))
    # The speech decoder's products that share an input are one per layer, columns in order.
    backbone = engine.params.tts.backbone
    assert backbone.q is None
    assert backbone.gate is None
    assert engine.params.tts.mog.up is None
    s = params.tts.backbone
    qkv = [jnp.concatenate([s.q[i], s.k[i], s.v[i]], -1) for i in range(len(backbone.qkv))]
    chex.assert_trees_all_equal(backbone.qkv, tuple(qkv))
    # Already in the serving layout: kept as it is (an engine built from such params holds them,
    # not a second copy).
    assert voicechat.serving_layout(engine.params).llm.mlp.up is up
    # A GPU's layout also splits the encoder's layers and the RNNT's LSTM layers (the CPU keeps
    # them stacked, as scans): then neither takes a slice of its weights either.
    gpu = engine.params.replace(
        encoder=conformer.serving_layout(engine.params.encoder, unrolled=True),
        rnnt=rnnt.serving_layout(engine.params.rnnt, unrolled=True),
    )
    assert isinstance(gpu.rnnt.lstm.w_in, tuple)
    assert isinstance(gpu.encoder.layers, tuple)
    sliced = _sliced_weights(gpu, template)
    assert not {p for p in sliced if p.startswith((".encoder.layers", ".rnnt.lstm"))}


@pytest.mark.parametrize("how", ["inactive", "held"])
def test_inactive_and_held_slots_are_bit_identical(engine, params, how):
    """A tick leaves every leaf of an inactive slot, or of a live slot the host holds (``run``
    off), as it was; the running slots move."""
    serve = engine.serve
    state = state_lib.from_template(engine.template, serve.slots)
    live = [True, how == "held", True]
    state = state.replace(active=jnp.asarray(live))
    before = jax.device_get(state)
    beat = engine.empty_beat().replace(
        audio=np.stack([_speech(0.16, i) for i in range(3)]),
        run=np.asarray([True, how != "held", True]),
    )
    tick = jax.jit(functools.partial(step_lib.tick, cfg=CFG, serve=serve))
    masks = SlotRule.read(state, engine.template).decide(beat, serve)
    after, out = tick(params, state, engine.template, beat, masks)
    after = jax.device_get(after)
    for x, y in zip(
        jax.tree_util.tree_leaves(before.model),
        jax.tree_util.tree_leaves(after.model),
        strict=True,
    ):
        np.testing.assert_array_equal(x[1], y[1])
    assert int(after.model.frame[0]) == 2
    assert int(after.model.frame[1]) == 0
    assert list(np.asarray(out.ran)) == [True, False, True]
    assert list(np.asarray(out.active)) == live


def test_context_cap_ends_the_session(params):
    serve = ServeConfig(slots=1, frames_per_tick=2, context_frames=6, precision=PREC)
    engine = Engine(params, CFG, serve)
    server = Server(engine, clock="offline", loop="dispatch", warmup_ticks=0)
    server.run([SessionPlan(id="cap", audio=_speech(2, 40))], 6)
    assert server.logs["cap"].arrays()["text"].size == 6
    assert server.ended["cap"] == "context cap"


def test_context_cap_rollover_goes_on_without_a_gap(params):
    """With ``at_cap='rollover'`` a session at the cap rolls over (an empty capsule) and goes on.

    Every tick runs and yields its frames; the roll-over beats are reported; the audio streams go
    on (the frames after a roll-over are not a fresh session's: the encoder, codec and previous
    tokens continue).
    """
    serve = ServeConfig(
        slots=1, frames_per_tick=2, context_frames=6, at_cap="rollover", precision=PREC
    )
    engine = Engine(params, CFG, serve)
    x = _speech(2, 41)
    server = Server(engine, clock="offline", loop="dispatch", warmup_ticks=0)
    server.run([SessionPlan(id="roll", audio=x)], 8)
    out = server.logs["roll"].arrays()
    assert "roll" not in server.ended
    # Ticks 0-2 fill the 6-frame cap; tick 3 rolls over first, and so on: 16 frames in 8 ticks.
    assert out["text"].size == 16
    assert out["wav"].size == 16 * 1764
    assert np.all(np.isfinite(out["wav"]))


def test_hold_full_keeps_every_cache_full_and_the_session_live(params):
    """The benchmark-only ``hold_full``: past a 6-frame cap for 8 ticks, the session never reaches
    the cap (no end, no roll-over) and after every tick both caches read as full."""
    serve = ServeConfig(
        slots=2, frames_per_tick=2, context_frames=6, hold_full=True, precision=PREC
    )
    engine = Engine(params, CFG, serve)
    server = Server(engine, clock="offline", loop="dispatch", warmup_ticks=0)
    server.run([SessionPlan(id="full", audio=_speech(2, 42))], 8)
    assert "full" not in server.ended
    assert server.logs["full"].arrays()["text"].size == 16
    model, fresh = engine.state.model, engine.template
    # Slot 0 served: full. Slot 1 never joined: its state is the template's, untouched.
    assert np.asarray(model.llm.length).tolist() == [model.llm.k[0].shape[2], *fresh.llm.length]
    assert np.asarray(model.tts.pos).tolist() == [model.tts.k[0].shape[3], *fresh.tts.pos]
    # The staged engine's host mirror followed the held fills.
    assert engine.staged
    mirror_agrees(engine)


def _write_wav(path, x, rate=16000, channels=1):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


def _write_float_wav(path, x, rate=16000):
    """A mono IEEE-float WAV (format 3), the kind that can carry NaN samples."""
    data = np.asarray(x, "<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(body)) + body)


_BAD_INPUT_RUN = dict(
    seconds=0.64, clock="offline", loop="dispatch", serve=ServeConfig(slots=2), warmup_ticks=0
)


@pytest.fixture(scope="module")
def good_alone(tmp_path_factory):
    """The good file served alone (the reference every bad-file run is checked against, once)."""
    root = tmp_path_factory.mktemp("good_alone")
    good = root / "good.wav"
    _write_wav(good, _speech(1, 50))
    runner.run(
        runner.RunOptions(
            sessions=1, input_wavs=(str(good),), output_dir=str(root / "b"), **_BAD_INPUT_RUN
        )
    )
    return good, root / "b" / "s000"


@pytest.mark.parametrize("kind", ["rate", "stereo", "empty", "nan"])
def test_bad_input_file_is_refused_clearly(tmp_path, kind, good_alone):
    """A bad file fails its session with a clear message; the others' outputs are unchanged."""
    good, alone = good_alone
    bad = tmp_path / f"bad_{kind}.wav"
    if kind == "rate":
        _write_wav(bad, _speech(1, 51), rate=8000)
    elif kind == "stereo":
        _write_wav(bad, np.repeat(_speech(1, 51), 2), channels=2)
    elif kind == "empty":
        _write_wav(bad, np.zeros(0, np.float32))
    else:
        x = _speech(1, 51)
        x[1000] = np.nan
        _write_float_wav(bad, x)
    with_bad = runner.run(
        runner.RunOptions(
            sessions=2,
            input_wavs=(str(good), str(bad)),
            output_dir=str(tmp_path / "a"),
            **_BAD_INPUT_RUN,
        )
    )
    message = with_bad.failures["s001"]
    expected = {"rate": "8000", "stereo": "channel", "empty": "empty", "nan": "nan"}[kind]
    assert expected in message.lower()
    assert "s001" not in with_bad.outputs
    for name in ("frames.jsonl", "output.wav"):
        a = (tmp_path / "a" / "s000" / name).read_bytes()
        b = (alone / name).read_bytes()
        assert a == b, name


def test_frames_jsonl_schema(tmp_path):
    result = runner.run(
        runner.RunOptions(
            seconds=0.48,
            clock="offline",
            loop="dispatch",
            sessions=1,
            serve=_BAD_INPUT_RUN["serve"],  # a configuration this file serves already
            output_dir=str(tmp_path),
        )
    )
    with open(result.outputs["s000"]["frames"]) as f:
        rows = [json.loads(line) for line in f]
    assert [r["frame"] for r in rows] == list(range(6))
    for r in rows:
        assert {"frame", "text", "function", "codes"} <= set(r)
        assert len(r["codes"]) == CFG.tts.n_quantizers
    with wave.open(result.outputs["s000"]["wav"]) as w:
        assert w.getframerate() == 22050
        assert w.getnframes() == 6 * 1764


def test_churn_run_outputs_match_each_sessions_lifetime(tmp_path):
    """``--churn``: sessions join and leave at random ticks; each gets 2 frames per live tick."""
    opts = runner.RunOptions(
        seconds=1.6,
        clock="offline",
        loop="dispatch",
        serve=_BAD_INPUT_RUN["serve"],  # 2 slots: served from the bad-input runs' programs
        sessions=5,
        churn=True,
        seed=3,
        output_dir=str(tmp_path),
        warmup_ticks=0,
    )
    result = runner.run(opts)
    plans, _ = runner.plans_for(opts, 10, runner._load_inputs((), 5))
    assert len({p.join for p in plans}) > 1
    for p in plans:
        if p.id not in result.outputs:
            assert "server full" in result.failures[p.id]
            continue
        with open(result.outputs[p.id]["frames"]) as f:
            frames = sum(1 for _ in f)
        assert frames == 2 * ((p.leave or 10) - p.join)


def test_vanished_client_fails_alone(engine):
    """A client that stops sending is failed after ``vanish_beats`` silent beats; others go on."""
    good = [SessionPlan(id=f"v{i}", audio=_speech(2, 60 + i)) for i in range(2)]
    gone = SessionPlan(id="gone", audio=_speech(2, 62), vanish=2)
    engine.reset()
    server = Server(
        engine, clock="offline", loop="dispatch", warmup_ticks=0, seed=7, vanish_beats=3
    )
    server.run([*good, gone], 9)
    assert server.failures["gone"] == "client vanished: no audio for 3 beats"
    assert server.ended["gone"].startswith("failed: client vanished")
    # beats 0-1 had audio; 2-4 were silent (the third silent beat fails it); released before 5
    assert server.logs["gone"].arrays()["text"].size == 2 * 5
    alone = _serve(engine, good, 9)
    for p in good:
        _same(_out(server, p.id), _out(alone, p.id))
