"""The streaming perception (mel, cache-aware FastConformer, proj) against NeMo 3.0's streaming.

The reference is NeMo's ``AudioPerceptionModule`` built with ``tiny().encoder`` and the release's
options (random non-trivial weights, eval mode, fp32), run the way docs/model.md §8 describes NeMo's
streaming: ``CacheAwareStreamingAudioBuffer`` cuts the whole-clip mel into one-frame chunks and
``ConformerEncoder.cache_aware_stream_step`` runs each (``drop_extra_pre_encoded`` 0 at step 0),
then ``perception.proj``. Weights reach the port through ``keys.encoder.rules``.
"""

from __future__ import annotations

import dataclasses
import re
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from voicechat_jax.config import EncoderConfig, tiny, voicechat_11b
from voicechat_jax.keys import encoder as encoder_keys
from voicechat_jax.keys import fill, to_layout
from voicechat_jax.model import conformer
from voicechat_jax.model.common import count_params
from voicechat_jax.precision import Precision
from voicechat_jax.release_config import config_to_release

torch = pytest.importorskip("torch")

CFG = tiny()
ENC = CFG.encoder
PREC = Precision.fp32()
SPF = ENC.mel.samples_per_frame
N_FRAMES = 38  # ~3 s
PREFIX = encoder_keys.PERCEPTION


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def _perception_cfg(enc: EncoderConfig):
    """The release's perception options (``config.json`` ``perception``) at ``enc``'s sizes,
    as ``release_config.config_to_release`` writes them."""
    from omegaconf import OmegaConf

    base = CFG if enc.output_dim == CFG.llm.d_model else voicechat_11b()
    release, _ = config_to_release(dataclasses.replace(base, encoder=enc))
    return OmegaConf.create(release["model"]["stt"]["model"]["perception"])


def _build_nemo(enc: EncoderConfig, seed: int = 0):
    """NeMo's perception, random non-trivial weights (norms near 1, non-zero biases), eval mode."""
    from nemo.collections.speechlm2.modules.perception import AudioPerceptionModule

    torch.manual_seed(seed)
    m = AudioPerceptionModule(_perception_cfg(enc))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1 or "pos_bias" in name:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)
    return m.eval()


def _nemo_stream(m, audios: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """NeMo's cache-aware streaming, one frame per step: (enc [B, T, D], proj [B, T, D_llm])."""
    from nemo.collections.asr.parts.utils.streaming_utils import CacheAwareStreamingAudioBuffer
    from omegaconf import OmegaConf

    # The buffer only needs the encoder and the preprocessor config of an ASR model.
    asr = types.SimpleNamespace(
        encoder=m.encoder,
        _cfg=OmegaConf.create({"preprocessor": m.cfg.preprocessor}),
        from_config_dict=m.from_config_dict,
        device=torch.device("cpu"),
    )
    buffer = CacheAwareStreamingAudioBuffer(model=asr, online_normalization=False)
    for a in audios:
        buffer.append_audio(a)
    enc = m.encoder
    assert enc.streaming_cfg.pre_encode_cache_size == [0, ENC.pre_encode_cache]
    assert enc.streaming_cfg.drop_extra_pre_encoded == ENC.drop_pre_encoded
    cache_channel, cache_time, cache_len = enc.get_initial_cache_state(batch_size=len(audios))
    encs, projs = [], []
    with torch.inference_mode():
        for step, (chunk, lengths) in enumerate(buffer):
            out, _, cache_channel, cache_time, cache_len = enc.cache_aware_stream_step(
                processed_signal=chunk,
                processed_signal_length=lengths,
                cache_last_channel=cache_channel,
                cache_last_time=cache_time,
                cache_last_channel_len=cache_len,
                keep_all_outputs=buffer.is_buffer_empty(),
                drop_extra_pre_encoded=enc.streaming_cfg.drop_extra_pre_encoded if step else 0,
            )
            out = out.transpose(1, 2)
            encs.append(out.numpy())
            projs.append(m.proj(out).numpy())
    return np.concatenate(encs, axis=1), np.concatenate(projs, axis=1)


def _stream(params, state, audio: np.ndarray, sizes: list[int], step):
    """Feed ``audio`` [B, n * 1280] in calls of ``sizes[i]`` frames: (state, enc, proj)."""
    encs, projs, c = [], [], 0
    for k in sizes:
        state, e, p = step(params, state, jnp.asarray(audio[:, c * SPF : (c + k) * SPF]))
        encs.append(np.asarray(e))
        projs.append(np.asarray(p))
        c += k
    return state, np.concatenate(encs, axis=1), np.concatenate(projs, axis=1)


def _step(params, state, samples):
    return conformer.encoder_step(params, state, samples, cfg=ENC, precision=PREC)


_jit_step = jax.jit(_step)


@pytest.fixture(scope="module")
def ref():
    m = _build_nemo(ENC)
    tensors = {f"{PREFIX}.{k}": v.numpy() for k, v in m.state_dict().items()}
    params = fill(
        conformer.abstract(ENC, PREC),
        encoder_keys.rules(CFG),
        tensors,
        param_prefix="encoder",
    )
    params = jax.tree_util.tree_map(jnp.asarray, params)
    rng = np.random.default_rng(0)
    audio = (0.3 * rng.standard_normal((2, N_FRAMES * SPF))).astype(np.float32)
    enc, proj = _nemo_stream(m, [audio[0], audio[1]])
    # NeMo's clip has one more frame, made from the end-of-clip flush (docs/model.md §8).
    assert enc.shape[1] == N_FRAMES + 1
    _, got_enc, got_proj = _stream(
        params, conformer.init_state(ENC, 2, PREC), audio, [1] * N_FRAMES, _jit_step
    )
    return {
        "params": params,
        "audio": audio,
        "enc": enc[:, :N_FRAMES],
        "proj": proj[:, :N_FRAMES],
        "got_enc": got_enc,
        "got_proj": got_proj,
    }


def test_streaming_matches_nemo(ref):
    """Frame by frame, one frame per call, both streams: encoder output and proj within 1e-4."""
    assert ref["got_enc"].shape == (2, N_FRAMES, ENC.d_model)
    assert ref["got_proj"].shape == (2, N_FRAMES, ENC.output_dim)
    assert _rel(ref["got_enc"], ref["enc"]) < 1e-4
    assert _rel(ref["got_proj"], ref["proj"]) < 1e-4
    # Step 0 (mel frame 0 alone) and step 1 (zero log-mel frames in the cache) are special.
    assert _rel(ref["got_enc"][:, :2], ref["enc"][:, :2]) < 1e-4


def test_k_frames_per_call_equal_single(ref):
    sizes = [3, 1, 2, 3, 3, 1, 2, 3, 3, 2, 3, 3, 1, 3, 2, 3]  # crosses the 8-frame attention window
    assert sum(sizes) == N_FRAMES
    _, enc, proj = _stream(
        ref["params"], conformer.init_state(ENC, 2, PREC), ref["audio"], sizes, _jit_step
    )
    assert _rel(enc, ref["got_enc"]) < 1e-5
    assert _rel(proj, ref["got_proj"]) < 1e-5


def test_streams_in_a_batch_are_independent(ref):
    """Slot 1 joins 3 frames after slot 0 (fresh state in its row): each row equals its stream."""
    params, audio = ref["params"], ref["audio"]
    n, late = 14, 3
    _, alone0, _ = _stream(
        params, conformer.init_state(ENC, 1, PREC), audio[:1], [1] * n, _jit_step
    )
    _, alone1, _ = _stream(
        params, conformer.init_state(ENC, 1, PREC), audio[1:], [1] * (n - late), _jit_step
    )
    state = conformer.init_state(ENC, 2, PREC)
    fresh = conformer.init_state(ENC, 2, PREC)
    rows = [[], []]
    for c in range(n):
        if c == late:
            state = jax.tree_util.tree_map(lambda s, f: s.at[1].set(f[1]), state, fresh)
        x = np.full((2, SPF), 0.2, np.float32)  # slot 1 before it joins: anything
        x[0] = audio[0, c * SPF : (c + 1) * SPF]
        if c >= late:
            x[1] = audio[1, (c - late) * SPF : (c - late + 1) * SPF]
        state, e, _ = _jit_step(params, state, jnp.asarray(x))
        rows[0].append(np.asarray(e[0]))
        if c >= late:
            rows[1].append(np.asarray(e[1]))
    assert _rel(np.concatenate(rows[0])[None], alone0) < 1e-5
    assert _rel(np.concatenate(rows[1])[None], alone1) < 1e-5
    assert _rel(alone0, ref["got_enc"][:1, :n]) < 1e-5


def test_jit_equals_eager(ref):
    params, audio = ref["params"], ref["audio"][:, : 2 * SPF]
    _, eager, eager_p = _stream(params, conformer.init_state(ENC, 2, PREC), audio, [2], _step)
    _, jitted, jitted_p = _stream(params, conformer.init_state(ENC, 2, PREC), audio, [2], _jit_step)
    assert _rel(jitted, eager) < 1e-5
    assert _rel(jitted_p, eager_p) < 1e-5


def test_unrolled_layers_equal_the_scan(ref):
    """The serving layout a GPU gets (``conformer.serving_layout``): the L layers one
    ``LayerParams`` each (q | k | v one product), run unrolled, give the scan's frames and caches
    (3 two-frame calls that cross the attention window's start); the split's layers are the
    stack's, and the CPU keeps the stack unless asked."""
    params, audio = ref["params"], ref["audio"][:, : 6 * SPF]
    assert conformer.serving_layout(params) is params  # the CPU: a scan, as stored
    unrolled = conformer.serving_layout(params, unrolled=True)
    assert len(unrolled.layers) == ENC.n_layers
    one, stacked = unrolled.layers[1], jax.tree_util.tree_map(lambda a: a[1], params.layers)
    chex.assert_trees_all_equal(one.ff1, stacked.ff1)
    chex.assert_trees_all_equal(one.conv, stacked.conv)
    a = stacked.attn
    assert one.attn.q is None
    chex.assert_trees_all_equal(one.attn.qkv, jnp.concatenate([a.q, a.k, a.v], -1))
    assert conformer.serving_layout(unrolled, unrolled=True) is unrolled
    start = conformer.init_state(ENC, 2, PREC)
    s_scan, enc_scan, proj_scan = _stream(params, start, audio, [2, 2, 2], _jit_step)
    s_unr, enc_unr, proj_unr = _stream(unrolled, start, audio, [2, 2, 2], _jit_step)
    assert _rel(enc_unr, enc_scan) < 1e-6
    assert _rel(proj_unr, proj_scan) < 1e-6
    assert _rel(np.asarray(s_unr.att_k), np.asarray(s_scan.att_k)) < 1e-6
    assert _rel(np.asarray(s_unr.conv_cache), np.asarray(s_scan.conv_cache)) < 1e-6


@pytest.mark.parametrize("unrolled", [False, True])
def test_rows_that_do_not_run_keep_their_state(ref, unrolled):
    """``run`` off for a slot: every leaf of its state comes back bit-identical (the attention
    caches masked in each layer's write, the small leaves at the end), and the running slot
    gets what an all-running call gives it; on both layouts."""
    params = conformer.serving_layout(ref["params"], unrolled=unrolled)
    audio = ref["audio"]
    state, _, _ = _stream(params, conformer.init_state(ENC, 2, PREC), audio, [2, 2], _jit_step)
    x = jnp.asarray(audio[:, 4 * SPF : 6 * SPF])
    step = jax.jit(lambda p, s, a, r: conformer.encoder_step(p, s, a, r, cfg=ENC, precision=PREC))
    held, enc, _ = step(params, state, x, jnp.asarray([True, False]))
    moved, enc_all, _ = _jit_step(params, state, x)
    for before, after, full in zip(
        jax.tree_util.tree_leaves(state),
        jax.tree_util.tree_leaves(held),
        jax.tree_util.tree_leaves(moved),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(after)[1], np.asarray(before)[1])
        np.testing.assert_array_equal(np.asarray(after)[0], np.asarray(full)[0])
    np.testing.assert_array_equal(np.asarray(enc)[0], np.asarray(enc_all)[0])
    assert int(held.pos[1]) == 4
    assert int(held.pos[0]) == 6


@pytest.mark.parametrize("unrolled", [False, True])
def test_caches_are_updated_in_place(ref, unrolled):
    """With the state donated, the compiled step copies neither attention cache whole: each
    layer writes its new frames into the ring where it lies (a cache shift, or a select of the
    old state after the step, made XLA copy whole caches; the CPU compile shows it as the GPU's
    would, per layer on the unrolled layers)."""
    params = conformer.serving_layout(ref["params"], unrolled=unrolled)
    state = conformer.init_state(ENC, 2, PREC)
    step = jax.jit(
        lambda p, s, a, r: conformer.encoder_step(p, s, a, r, cfg=ENC, precision=PREC),
        donate_argnums=1,
    )
    args = (params, state, jnp.zeros((2, 2 * SPF)), jnp.asarray([True, False]))
    hlo = step.lower(*args).compile().as_text()
    shape = "f32[{}]".format(",".join(map(str, state.att_k.shape)))
    whole = [line for line in hlo.splitlines() if f"= {shape}" in line]
    assert whole  # the caches are in the program
    assert not [line for line in whole if re.search(r"\bcopy\(", line)]


def test_random_init_is_sane():
    params = conformer.init(jax.random.key(1), ENC, PREC)
    rng = np.random.default_rng(1)
    audio = (0.3 * rng.standard_normal((2, 4 * SPF))).astype(np.float32)
    _, enc, proj = _stream(params, conformer.init_state(ENC, 2, PREC), audio, [1] * 4, _jit_step)
    assert np.all(np.isfinite(enc))
    assert np.all(np.isfinite(proj))
    assert 0.1 < float(np.std(enc)) < 10.0
    assert 0.1 < float(np.std(proj)) < 10.0


def _nemo_full_size_state_dict(enc: EncoderConfig, monkeypatch) -> dict:
    """The full-size NeMo perception's state dict on the meta device (allocates nothing)."""
    import nemo.collections.asr.parts.submodules.subsampling as subsampling
    from nemo.collections.speechlm2.modules.perception import AudioPerceptionModule

    # ConvSubsampling sizes its ``out`` Linear with ``int(calc_length(torch.tensor(feat_in)))``,
    # which a meta tensor cannot answer: evaluate that one length on the CPU.
    calc_length = subsampling.calc_length

    def cpu_calc_length(lengths, **kw):
        if lengths.is_meta:
            lengths = torch.tensor(float(enc.mel.n_mels), device="cpu")
        return calc_length(lengths, **kw)

    monkeypatch.setattr(subsampling, "calc_length", cpu_calc_length)
    with torch.device("meta"):
        m = AudioPerceptionModule(_perception_cfg(enc))
    return {f"{PREFIX}.{k}": tuple(v.shape) for k, v in m.state_dict().items()}


def test_full_size_key_table(monkeypatch):
    """Release names and shapes of the 11B perception map one to one onto the abstract params."""
    cfg = voicechat_11b()
    nemo_shapes = _nemo_full_size_state_dict(cfg.encoder, monkeypatch)
    rules = encoder_keys.rules(cfg)
    assert len(rules) == len(nemo_shapes) == 640
    assert {r.release for r in rules} == set(nemo_shapes)
    abstract = conformer.abstract(cfg.encoder, Precision.reference())
    leaves = dict(
        (".".join(str(getattr(k, "name", k)) for k in path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
    )
    slots = {}
    for r in rules:
        # the layout transform on a zero-stride view: shapes only, nothing allocated
        view = np.broadcast_to(np.float32(0), nemo_shapes[r.release])
        leaf = leaves[r.param.removeprefix("encoder.")]
        assert to_layout(view, r.layout).shape == leaf.shape[len(r.index) :], r.release
        slots.setdefault(r.param, set()).add(r.index)
    assert {f"encoder.{p}" for p in leaves} == set(slots)
    for p, idx in slots.items():
        leaf = leaves[p.removeprefix("encoder.")]
        n = int(np.prod([leaf.shape[i] for i in range(len(next(iter(idx))))]))
        assert len(idx) == n, p
    n_nemo = sum(int(np.prod(s)) for s in nemo_shapes.values())
    assert count_params(abstract) == n_nemo
    assert 613e6 < n_nemo < 615e6  # docs/model.md §1: 614 M


def test_full_size_state_shapes():
    cfg = voicechat_11b().encoder
    state = jax.eval_shape(lambda: conformer.init_state(cfg, 3, Precision.reference()))
    # a ring of the 70 frames of context and the 8 a call may add (ENCODER_CALL_FRAMES)
    assert state.att_k.shape == state.att_v.shape == (3, 24, 78, 1024)
    assert conformer.ring_rows(cfg) == 78
    assert state.conv_cache.shape == (3, 24, 8, 1024)
    assert state.pre_cache.shape == (3, 9, 128)
    assert state.mel_tail.shape == (3, 1377)
    assert state.pos.shape == (3,)
