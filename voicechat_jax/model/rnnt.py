"""The RNNT transcript side head: LSTM prediction net, joint, greedy streaming decoding.

NeMo 3.0's ``NemotronVoiceChat`` has no RNNT head (docs/model.md §8); the release carries one
(``stt_model.rnnt_decoder`` / ``stt_model.rnnt_joint``, 15 tensors, described by the checkpoint's
``_rnnt_merge_info``). It reads the encoder's 1024-d frames (before ``perception.proj``) and emits
SentencePiece ids of the user's speech: the transcript and the blank/non-blank evidence the
turn-taking policy uses. Each piece mirrors NeMo ASR:

- ``predict``: ``nemo.collections.asr.modules.RNNTDecoder.predict`` for one label, ``add_sos=False``
  (an ``nn.Embedding`` then a stacked ``torch.nn.LSTM``; gate order i, f, g, o; the two torch
  biases ``bias_ih + bias_hh`` are stored summed).
- ``project_encoder`` / ``project_prediction`` / ``joint_logits``:
  ``RNNTJoint.project_encoder`` / ``project_prednet`` / ``joint_after_projection`` (ReLU, then the
  Linear to V + 1 classes; dropout is off at inference). Logits are returned raw: NeMo applies
  ``log_softmax`` on the CPU only, which does not change the greedy argmax.
- ``rnnt_step``: greedy RNNT decoding as NeMo's ``GreedyRNNTInfer._greedy_decode`` and the
  label-looping ``GreedyBatchedRNNTInfer`` do it: per encoder frame, emit the argmax label until
  it is blank or ``max_symbols`` labels were emitted in that frame; the prediction net advances
  only on a non-blank label. The decoder state carried between calls is what NeMo's label-looping
  decoder carries between streaming chunks in ``partial_hypotheses`` (``LabelLoopingStateItem``:
  LSTM state after the last label, the joint-projected prediction output, the last label).

Blank is id ``V`` (``cfg.vocab_size``, 1024 in the release). It is also the start symbol: before
anything is emitted the prediction net reads a zero vector, as ``RNNTDecoder.predict(None)`` does
(with ``blank_as_pad`` the embedding's blank row is its ``padding_idx`` row, zero too).

Axes (see ``voicechat_jax.model``): ``B`` slots, ``T`` encoder frames of one call, ``L`` LSTM
layers, ``D`` prediction-net width (``pred_hidden``), ``F`` joint hidden width, ``V`` the
SentencePiece vocabulary (``V + 1`` with blank), ``O`` symbols per frame (``max_symbols``),
``D_enc`` the encoder width (``encoder_hidden``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from voicechat_jax.config import RNNTConfig
from voicechat_jax.model.common import dense, fan_in_normal, normal, per_layer
from voicechat_jax.precision import Precision


@struct.dataclass
class LSTMParams:
    """A stacked LSTM (``torch.nn.LSTM``, no projection), gates packed i, f, g, o.

    Stored stacked on ``L``; ``serving_layout`` gives a GPU the L layers as tuples of per-layer
    leaves (``[D, 4D]``, ``[4D]``), which ``_lstm`` runs unrolled.
    """

    w_in: jax.Array | tuple[jax.Array, ...]  # [L, D, 4D]  weight_ih_l{l}, transposed
    w_hidden: jax.Array | tuple[jax.Array, ...]  # [L, D, 4D]  weight_hh_l{l}, transposed
    b: jax.Array | tuple[jax.Array, ...]  # [L, 4D]  bias_ih_l{l} + bias_hh_l{l}


@struct.dataclass
class JointParams:
    """``RNNTJoint``: two input projections summed, ReLU, then the output Linear."""

    enc: jax.Array  # [D_enc, F]
    enc_b: jax.Array  # [F]
    pred: jax.Array  # [D, F]
    pred_b: jax.Array  # [F]
    out: jax.Array  # [F, V + 1]  joint_net.2
    out_b: jax.Array  # [V + 1]


@struct.dataclass
class RNNTParams:
    """Prediction net (``RNNTDecoder.prediction``) and joint (``RNNTJoint``)."""

    embed: jax.Array  # [V + 1, D] with blank_as_pad (row V is the zero pad row), else [V, D]
    lstm: LSTMParams
    joint: JointParams


@struct.dataclass
class RNNTState:
    """The greedy decoder's state for each slot, carried across frames and calls.

    ``h``/``c``/``pred`` are the prediction net's state and joint-projected output *after* reading
    ``label``. While ``label`` is blank nothing has been emitted yet: the fields then hold zeros
    until the first step primes them from the start symbol (see ``rnnt_step``).
    """

    h: jax.Array  # [B, L, D] LSTM hidden state
    c: jax.Array  # [B, L, D] LSTM cell state
    label: jax.Array  # [B] int32 last emitted label; V (blank) = nothing emitted since reset
    pred: jax.Array  # [B, F] project_prediction(prediction-net output for `label`)


def init(key: jax.Array, cfg: RNNTConfig, precision: Precision) -> RNNTParams:
    """Random weights at a sane scale (gate pre-activations and joint logits of order one)."""
    dt = precision.rnnt
    D, F, L, V = cfg.pred_hidden, cfg.joint_hidden, cfg.pred_layers, cfg.vocab_size
    ks = jax.random.split(key, 10)
    embed = normal(ks[0], (_embed_rows(cfg), D), dt, std=1.0)
    if cfg.blank_as_pad:
        embed = embed.at[cfg.blank_id].set(0)  # torch zeroes its padding_idx row
    lstm = LSTMParams(
        w_in=fan_in_normal(ks[1], (L, D, 4 * D), dt, D),
        w_hidden=fan_in_normal(ks[2], (L, D, 4 * D), dt, D),
        b=normal(ks[3], (L, 4 * D), dt, std=0.1),
    )
    joint = JointParams(
        enc=fan_in_normal(ks[4], (cfg.encoder_hidden, F), dt, cfg.encoder_hidden),
        enc_b=normal(ks[5], (F,), dt, std=0.1),
        pred=fan_in_normal(ks[6], (D, F), dt, D),
        pred_b=normal(ks[7], (F,), dt, std=0.1),
        out=fan_in_normal(ks[8], (F, V + 1), dt, F),
        out_b=normal(ks[9], (V + 1,), dt, std=0.1),
    )
    return RNNTParams(embed=embed, lstm=lstm, joint=joint)


def abstract(cfg: RNNTConfig, precision: Precision) -> RNNTParams:
    """The params' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves); allocates nothing."""
    return jax.eval_shape(lambda k: init(k, cfg, precision), jax.random.key(0))


def init_state(cfg: RNNTConfig, batch: int, precision: Precision) -> RNNTState:
    """The state of a fresh stream: nothing emitted, prediction net not yet primed."""
    return _zero_state(cfg, batch, precision.rnnt)


def _zero_state(cfg: RNNTConfig, batch: int, dtype) -> RNNTState:
    zeros = jnp.zeros((batch, cfg.pred_layers, cfg.pred_hidden), dtype)
    return RNNTState(
        h=zeros,
        c=zeros,
        label=jnp.full((batch,), cfg.blank_id, jnp.int32),
        pred=jnp.zeros((batch, cfg.joint_hidden), dtype),
    )


def _embed_rows(cfg: RNNTConfig) -> int:
    return cfg.vocab_size + 1 if cfg.blank_as_pad else cfg.vocab_size


def serving_layout(params: RNNTParams, *, unrolled: bool | None = None) -> RNNTParams:
    """The head as the engine serves it: on a GPU the LSTM's layers as per-layer leaves, which
    ``_lstm`` runs unrolled; elsewhere stacked, run as a scan.

    A scan over stacked weights copies each layer's two [D, 4D] products' weights out of their
    stack on every symbol step of every frame: at 11B two 13.1 MB copies, 40 times a beat, 0.4
    ms of the faithful 40-slot tick on an H100 (2026-12-05, ``d4d68c4``,
    ``experiments/tick_profile``). As for the encoder (``conformer.serving_layout``), the CPU
    keeps the scan. ``unrolled``: force the choice (default: on a GPU). Params already in the
    asked-for layout are returned as they are.
    """
    if unrolled is None:
        unrolled = jax.default_backend() == "gpu"
    if not unrolled or isinstance(params.lstm.w_in, tuple):
        return params
    return params.replace(lstm=per_layer(params.lstm, ("w_in", "w_hidden", "b")))


def _lstm(
    p: LSTMParams, x: jax.Array, h: jax.Array, c: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One time step of the stacked LSTM: x [B, D], h/c [B, L, D] -> (y [B, D], h, c)."""

    def layer(x, lp):
        w_in, w_hidden, b, h_l, c_l = lp
        z = dense(x, w_in) + dense(h_l, w_hidden) + b.astype(x.dtype)  # [B, 4D]
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c_l = jax.nn.sigmoid(f) * c_l + jax.nn.sigmoid(i) * jnp.tanh(g)
        h_l = jax.nn.sigmoid(o) * jnp.tanh(c_l)
        return h_l, (h_l, c_l)

    if isinstance(p.w_in, tuple):  # the serving layout: one leaf per layer, unrolled
        hs, cs = [], []
        for l in range(len(p.w_in)):
            x, (h_l, c_l) = layer(x, (p.w_in[l], p.w_hidden[l], p.b[l], h[:, l], c[:, l]))
            hs.append(h_l)
            cs.append(c_l)
        return x, jnp.stack(hs, axis=1), jnp.stack(cs, axis=1)
    y, (h, c) = jax.lax.scan(
        layer, x, (p.w_in, p.w_hidden, p.b, jnp.swapaxes(h, 0, 1), jnp.swapaxes(c, 0, 1))
    )
    return y, jnp.swapaxes(h, 0, 1), jnp.swapaxes(c, 0, 1)


def predict(
    params: RNNTParams, label: jax.Array, h: jax.Array, c: jax.Array, *, cfg: RNNTConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The prediction net reads one label per slot: label [B], h/c [B, L, D] -> (g [B, D], h, c).

    Blank (the start symbol) reads a zero vector, like ``RNNTDecoder.predict(None)``.
    """
    x = params.embed[jnp.minimum(label, params.embed.shape[0] - 1)]  # [B, D]
    x = jnp.where((label == cfg.blank_id)[:, None], jnp.zeros_like(x), x)
    return _lstm(params.lstm, x.astype(h.dtype), h, c)


def project_encoder(params: RNNTParams, enc: jax.Array) -> jax.Array:
    """``RNNTJoint.project_encoder``: enc [..., D_enc] -> [..., F]."""
    return dense(enc, params.joint.enc, params.joint.enc_b)


def project_prediction(params: RNNTParams, g: jax.Array) -> jax.Array:
    """``RNNTJoint.project_prednet``: g [..., D] -> [..., F]."""
    return dense(g, params.joint.pred, params.joint.pred_b)


def joint_logits(params: RNNTParams, f: jax.Array, p: jax.Array) -> jax.Array:
    """``RNNTJoint.joint_after_projection``, no CPU-only log_softmax: [..., F] -> [..., V + 1]."""
    return dense(jax.nn.relu(f + p), params.joint.out, params.joint.out_b)


def _select(take: jax.Array, a: RNNTState, b: RNNTState) -> RNNTState:
    """Per slot, ``a`` where ``take`` [B] else ``b``."""
    return jax.tree_util.tree_map(
        lambda x, y: jnp.where(take.reshape(take.shape + (1,) * (x.ndim - 1)), x, y), a, b
    )


def _read(params: RNNTParams, state: RNNTState, label: jax.Array, cfg: RNNTConfig) -> RNNTState:
    """The state after the prediction net reads ``label`` [B] from ``state``."""
    g, h, c = predict(params, label, state.h, state.c, cfg=cfg)
    return RNNTState(h=h, c=c, label=label, pred=project_prediction(params, g))


def rnnt_step(
    params: RNNTParams, state: RNNTState, enc: jax.Array, *, cfg: RNNTConfig
) -> tuple[RNNTState, jax.Array, jax.Array]:
    """Greedy RNNT decoding of T new encoder frames per slot.

    Args:
      params: the head's weights.
      state: the carried decoder state (``init_state`` for a fresh stream).
      enc: [B, T, D_enc] encoder frames (the FastConformer output, before ``perception.proj``).
      cfg: the head's config; ``cfg.max_symbols`` caps the labels per frame.

    Returns:
      (state, tokens [B, T, O] int32, n_tokens [B, T] int32): ``tokens[b, t, :n_tokens[b, t]]`` are
      the labels emitted at frame t, the rest is blank. A frame with ``n_tokens == 0`` is a blank
      frame. Decoding T frames in one call equals T calls of one frame.
    """
    O, blank = cfg.max_symbols, cfg.blank_id
    B = enc.shape[0]
    dt = state.h.dtype
    f = project_encoder(params, enc.astype(dt))  # [B, T, F]

    # A slot that has emitted nothing holds the start-of-stream state: the prediction net after
    # reading the start symbol from a zero state (NeMo's first ``_pred_step``). Recomputing it
    # while nothing is emitted gives the same values, so fresh and reset slots need no separate
    # priming call and ``init_state`` needs no params.
    zero = _zero_state(cfg, B, dt)
    state = _select(state.label == blank, _read(params, zero, zero.label, cfg), state)

    # Each frame runs all ``O`` symbol steps, a slot that has emitted blank masked out of the rest:
    # the same labels and state as NeMo's loop that stops at the first blank of every slot, and a
    # loop whose trip count the compiler knows, so that on a GPU the tick's call does not wait
    # for the device to decide whether to go on (XLA copies a data-dependent predicate to the
    # host every iteration).
    def frame(state: RNNTState, f_t: jax.Array):  # f_t [B, F]
        def body(s, carry):
            active, state, tokens = carry
            logits = joint_logits(params, f_t, state.pred)  # [B, V + 1]
            k = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
            emit = active & (k != blank)
            tokens = tokens.at[:, s].set(jnp.where(emit, k, blank))
            state = _select(emit, _read(params, state, k, cfg), state)
            return emit, state, tokens

        tokens = jnp.full((B, O), blank, jnp.int32)
        active = jnp.ones((B,), bool)
        _, state, tokens = jax.lax.fori_loop(0, O, body, (active, state, tokens))
        return state, tokens

    state, tokens = jax.lax.scan(frame, state, jnp.swapaxes(f, 0, 1))
    tokens = jnp.swapaxes(tokens, 0, 1)  # [B, T, O]
    n_tokens = jnp.sum(tokens != blank, axis=-1, dtype=jnp.int32)
    return state, tokens, n_tokens
