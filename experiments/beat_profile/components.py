"""Each component of a beat timed alone at B slots, on a server's own state, with its byte count.

Every component is the model's own function (the one the tick calls), jitted by itself with its
piece of the state donated, and timed as the tick would run it: one call, block until done, median
over repeats. Bytes are the fewest the component must move (weights read once, state read and
written once, the attention caches read once), so bytes / time is its achieved bandwidth, to be
read against a plain device copy measured in the same run.

Times are per frame-step (a beat has ``frames_per_tick`` of them): components the tick runs once per
beat over all its frames (encoder, RNNT head, codec, admission) are divided by the frames per beat.
Per-layer components are timed for one layer and multiplied by the layer count.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from voicechat_jax import step as step_lib
from voicechat_jax.model import codec, conformer, ear_tts, gemma, mog, nano, rnnt

F32 = jnp.float32


def nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))


@dataclasses.dataclass
class Row:
    component: str
    slots: int
    ms: float  # per frame-step, all repeats of the component included
    bytes: int  # per frame-step
    calls: int  # calls per frame-step that ``ms`` counts (layers, rounds)
    ms_per_call_p10: float
    ms_per_call_p90: float

    @property
    def tbps(self) -> float:
        return self.bytes / (self.ms * 1e-3) / 1e12 if self.ms > 0 else 0.0


def _time(fn: Callable, args: tuple, carry, *, repeats: int, warmup: int = 2):
    """Median seconds of ``carry, _ = fn(*args, carry)`` (the carry donated and threaded)."""
    times = []
    for i in range(warmup + repeats):
        t = time.perf_counter()
        carry, out = fn(*args, carry)
        jax.block_until_ready((carry, out))
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return np.asarray(times), carry


def time_calls(fn, args, repeats: int) -> tuple[np.ndarray, float, tuple]:
    """(seconds of each timed call, the first call's seconds with compile, the first output)."""
    t = time.perf_counter()
    first = jax.block_until_ready(fn(*args))
    first_s = time.perf_counter() - t
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return np.asarray(times), first_s, first


def rel_err(a, b) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def device_copy_tbps(gib: float = 4.0, repeats: int = 10) -> float:
    """TB/s of a plain device copy (bytes read + written) of a ``gib`` GiB fp32 array."""
    n = int(gib * 2**30 / 4)
    x = jnp.arange(n, dtype=F32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t)
    del x
    return 2 * n * 4 / float(np.median(times)) / 1e12


def profile(engine, *, repeats: int = 10, seed: int = 0) -> list[Row]:
    """Times every component at ``engine.serve.slots`` slots on the engine's state (consumed).

    The engine's state is taken apart and donated piece by piece: the engine cannot tick after.
    """
    cfg, serve, params = engine.cfg, engine.serve, engine.params
    B, fpt = serve.slots, serve.frames_per_tick
    model = engine.state.model
    engine.state = None
    key = jax.random.key(seed)
    act = params.llm.embed.dtype
    lc = cfg.llm
    rows: list[Row] = []

    def add(name, times, bytes_per_call, calls, per_beat=False):
        per_call = float(np.median(times))
        div = fpt if per_beat else 1
        rows.append(
            Row(
                component=name,
                slots=B,
                ms=per_call * calls / div * 1e3,
                bytes=int(bytes_per_call * calls / div),
                calls=calls,
                ms_per_call_p10=float(np.percentile(times, 10)) * 1e3,
                ms_per_call_p90=float(np.percentile(times, 90)) * 1e3,
            )
        )

    # -- listening half, once per beat over its frames
    audio = 0.1 * jax.random.normal(key, (B, engine.samples_per_beat), F32)

    def enc_fn(p, a, s):
        s, enc, proj = conformer.encoder_step(p, s, a, cfg=cfg.encoder, precision=engine.precision)
        return s, (enc, proj)

    f = jax.jit(enc_fn, donate_argnums=(2,))
    t, enc_state = _time(f, (params.encoder, audio), model.encoder, repeats=repeats)
    add("mel + encoder", t, nbytes(params.encoder) + 2 * nbytes(enc_state), 1, per_beat=True)
    enc = jnp.zeros((B, fpt, cfg.encoder.d_model), engine.precision.encoder)

    def rnnt_fn(p, e, s):
        s, tr, n = rnnt.rnnt_step(p, s, e, cfg=cfg.rnnt)
        return s, (tr, n)

    f = jax.jit(rnnt_fn, donate_argnums=(2,))
    t, _ = _time(f, (params.rnnt, enc), model.rnnt, repeats=repeats)
    add("RNNT head", t, nbytes(params.rnnt) + 2 * nbytes(model.rnnt), 1, per_beat=True)

    # -- the LLM, one frame: layers timed one of each kind
    h = jax.random.normal(key, (B, lc.d_model), F32).astype(act)
    run = jnp.ones((B,), bool)
    L_m, L_f, L_a = (len(lc.layers_of(c)) for c in "M-*")

    ssm_kernel = serve.kernels(slots=B).ssm_kernel  # 'auto' made as the engine makes it

    def mamba_fn(p, x, carry):
        conv, ssm = carry
        conv, ssm, out = nano._mamba_step(p, 0, x, conv, ssm, run, lc, ssm_kernel)
        return (conv, ssm), out

    f = jax.jit(mamba_fn, donate_argnums=(2,))
    carry = (model.llm.conv[0], model.llm.ssm[0])
    layer_w = jax.tree_util.tree_map(lambda w: w[0], params.llm.mamba)
    t, carry = _time(f, (params.llm.mamba, h), carry, repeats=repeats)
    add(f"LLM Mamba-2 (x{L_m})", t, nbytes(layer_w) + 2 * nbytes(carry), L_m)
    del carry

    def mlp_fn(p, x, _):
        return None, nano._mlp(p, 0, x)

    f = jax.jit(mlp_fn)
    t, _ = _time(f, (params.llm.mlp, h), None, repeats=repeats)
    layer_w = jax.tree_util.tree_map(lambda w: w[0], params.llm.mlp)
    add(f"LLM MLP (x{L_f})", t, nbytes(layer_w), L_f)

    S = model.llm.k[0].shape[2]
    pos = jnp.full((B,), S - 1, jnp.int32)  # a full context: every row read

    def attn_fn(p, x, carry):
        k, v = carry
        k, v, out = nano._attn(p, 0, x[:, None], k, v, pos, run[:, None], lc)
        return (k, v), out

    f = jax.jit(attn_fn, donate_argnums=(2,))
    carry = (model.llm.k[0], model.llm.v[0])
    layer_w = jax.tree_util.tree_map(lambda w: w[0], params.llm.attn)
    t, carry = _time(f, (params.llm.attn, h), carry, repeats=repeats)
    add(f"LLM attention (x{L_a}, S={S})", t, nbytes(layer_w) + nbytes(carry), L_a)
    del carry

    tokens = jnp.zeros((B,), jnp.int32)
    proj = jax.random.normal(key, (B, lc.d_model), F32)

    def heads_fn(p, x, _):
        e = nano.input_embedding(p, tokens, tokens, proj, cfg=lc)
        return None, (e, nano.greedy(p, x))

    f = jax.jit(heads_fn)
    t, _ = _time(f, (params.llm, h), None, repeats=repeats)
    heads_w = nbytes((params.llm.lm_head, params.llm.function_head))
    add("LLM input sum + text/function heads", t, heads_w, 1)

    # -- the speech decoder, one frame
    tts = model.tts

    def embed_fn(p, ids, _):
        return None, ear_tts.embed_frame(p, tts.prev_codes, ids, cfg=cfg)

    f = jax.jit(embed_fn)
    t, _ = _time(f, (params.tts, tokens), None, repeats=repeats)
    add("TTS text side + fusion", t, nbytes(params.tts.fusion), 1)

    x2 = jax.random.normal(key, (2 * B, 1, cfg.tts.d_model), F32).astype(engine.precision.tts)

    def backbone_fn(p, x, carry):
        ks, vs, pos_ = carry
        cache = gemma.GemmaCache(
            k=tuple(a.reshape(2 * B, *a.shape[2:]) for a in ks),
            v=tuple(a.reshape(2 * B, *a.shape[2:]) for a in vs),
            pos=jnp.repeat(pos_, 2),
        )
        cache, out = gemma.forward(p, cache, x, cfg=cfg.tts)
        new = (
            tuple(a.reshape(o.shape) for a, o in zip(cache.k, ks, strict=True)),
            tuple(a.reshape(o.shape) for a, o in zip(cache.v, vs, strict=True)),
            pos_,
        )
        return new, out

    S_t = tts.k[0].shape[3]
    f = jax.jit(backbone_fn, donate_argnums=(2,))
    carry = (tts.k, tts.v, jnp.full((B,), S_t - 1, jnp.int32))
    model = model.replace(tts=None, llm=None)  # drop what is donated or unused
    t, carry = _time(f, (params.tts.backbone, x2), carry, repeats=repeats)
    L_t = cfg.tts.n_layers
    add(
        f"TTS backbone ({L_t} layers, 2 CFG rows, S={S_t})",
        t,
        nbytes(params.tts.backbone) + nbytes(carry[:2]),
        1,
    )
    del carry

    tcfg = cfg.tts
    hc = jax.random.normal(key, (B, tcfg.d_model), F32).astype(engine.precision.tts)
    codes0 = jnp.full((B, tcfg.n_quantizers), tcfg.codebook_size, jnp.int32)
    u, eps = ear_tts.sampling_noise(jax.random.key_data(jax.random.split(key, B)), cfg=cfg)
    schedule = ear_tts.schedule(tcfg)
    start, count = schedule[0]

    def round_fn(p, x, _):
        m = ear_tts.embed_codes(p, codes0)
        y = mog.trunk(p.mog, jnp.concatenate([m + x, m + x]), cfg=tcfg)
        y = mog.guide(y[:B], y[B:], tcfg.guidance_scale)
        comp = mog.choose(mog.logits(p.mog, y), u[0], top_p=tcfg.top_p, deterministic=False)
        z = mog.sample_latent(p.mog, y, comp, eps[0], noise_scale=tcfg.noise_scale, cfg=tcfg)
        return None, z

    f = jax.jit(round_fn)
    t, _ = _time(f, (params.tts, hc), None, repeats=repeats)
    E = tcfg.mog_components
    mog_w = nbytes(params.tts.mog) - nbytes(params.tts.mog.proj_mus) * (E - 1) // E
    add(f"MoG round (x{len(schedule)})", t, mog_w, len(schedule))

    z = jax.random.normal(key, (B, tcfg.latent_size), F32)

    def rvq_fn(p, zz, _):
        return None, ear_tts.rvq_encode(p.rvq_embs, zz, codes0, start, count)

    f = jax.jit(rvq_fn)
    t, _ = _time(f, (params.tts, z), None, repeats=repeats)
    rvq_w = nbytes(params.tts.rvq_embs) * count // tcfg.n_quantizers
    add(f"RVQ encoding ({count} codebooks x{len(schedule)})", t, rvq_w, len(schedule))

    # -- the codec, once per beat over its frames
    codes = jnp.zeros((B, fpt, tcfg.n_quantizers), jnp.int32)

    def codec_fn(p, c, s):
        s, wav = codec.decode_step(p, s, c, cfg=cfg.codec)
        return s, wav

    f = jax.jit(codec_fn, donate_argnums=(2,))
    t, _ = _time(f, (params.codec, codes), model.codec, repeats=repeats)
    add("codec decode", t, nbytes(params.codec) + 2 * nbytes(model.codec), 1, per_beat=True)

    return rows


def admission_ms(engine, *, repeats: int = 10) -> Row:
    """One session admitted into slot 0 (the template written in place), per frame-step."""
    B, fpt = engine.serve.slots, engine.serve.frames_per_tick
    mask = jnp.zeros((B,), bool).at[0].set(True)
    f = jax.jit(lambda t, m, s: (step_lib.insert(s, t, m), None), donate_argnums=(2,))
    times, model = _time(f, (engine.template, mask), engine.state.model, repeats=repeats)
    engine.state = engine.state.replace(model=model)
    per_call = float(np.median(times))
    return Row(
        component="admission (1 slot, per beat)",
        slots=B,
        ms=per_call / fpt * 1e3,
        bytes=int(2 * nbytes(engine.template) / fpt),
        calls=1,
        ms_per_call_p10=float(np.percentile(times, 10)) * 1e3,
        ms_per_call_p90=float(np.percentile(times, 90)) * 1e3,
    )


def reseed_ms(engine, *, repeats: int = 10) -> Row:
    """One session rolled over in slot 0 with a full capsule (``serve.capsule_tokens`` ids)."""
    B, fpt, U = engine.serve.slots, engine.serve.frames_per_tick, engine.serve.capsule_tokens
    mask = jnp.zeros((B,), bool).at[0].set(True)
    capsule = jnp.ones((B, U), jnp.int32)
    n = jnp.full((B,), U, jnp.int32)
    cfg = engine.cfg

    def fn(p, t, m, c, ln, s):
        return step_lib.reseed(p, s, t, m, c, ln, cfg=cfg), None

    f = jax.jit(fn, donate_argnums=(5,))
    args = (engine.params, engine.template, mask, capsule, n)
    times, model = _time(f, args, engine.state.model, repeats=repeats)
    engine.state = engine.state.replace(model=model)
    per_call = float(np.median(times))
    return Row(
        component=f"roll-over (1 slot, {U}-token capsule, per beat)",
        slots=B,
        ms=per_call / fpt * 1e3,
        bytes=int((nbytes(engine.params.llm) + 2 * nbytes(engine.template)) / fpt),
        calls=1,
        ms_per_call_p10=float(np.percentile(times, 10)) * 1e3,
        ms_per_call_p90=float(np.percentile(times, 90)) * 1e3,
    )
