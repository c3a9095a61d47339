"""The RNNT transcript head against NeMo ASR's ``RNNTDecoder`` / ``RNNTJoint`` and greedy decoders.

NeMo 3.0's ``NemotronVoiceChat`` has no RNNT head (docs/model.md §8), so the reference is assembled
from NeMo's own ASR parts: the modules are built with the release's ``_rnnt_merge_info`` structure
(tiny sizes), given random weights, renamed to release keys and loaded through ``keys.rnnt``.
The greedy reference is ``GreedyRNNTInfer`` (sequence level) and ``GreedyBatchedRNNTInfer``
(label looping, the default batched decoder), whole-sequence and chunked with
``partial_hypotheses``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import shared
from voicechat_jax.config import tiny, voicechat_11b
from voicechat_jax.keys import fill
from voicechat_jax.keys import rnnt as rnnt_keys
from voicechat_jax.model import rnnt
from voicechat_jax.model.common import count_params
from voicechat_jax.precision import Precision

_greedy = functools.partial(
    shared.nemo_module, "nemo.collections.asr.parts.submodules.rnnt_greedy_decoding"
)


_nemo_rnnt = functools.partial(shared.nemo_module, "nemo.collections.asr.modules")


torch = pytest.importorskip("torch")

CFG = tiny()
RC = CFG.rnnt
T = 40  # encoder frames
CHUNK = 3  # frames per call in the chunked runs (NeMo's example streams 3 frames a chunk)
SEED = 1
QUIET = 3 * CHUNK  # leading quiet frames of the second stream


def _nemo_modules(rc, *, dropout: float = 0.2):
    """NeMo's prediction net and joint as the release configures them (eval mode).

    The joint's dropout makes ``joint_net`` = [ReLU, Dropout, Linear], which gives the release's
    ``joint_net.2`` key; it is inactive in eval mode.
    """
    dec = _nemo_rnnt().RNNTDecoder(
        prednet={"pred_hidden": rc.pred_hidden, "pred_rnn_layers": rc.pred_layers},
        vocab_size=rc.vocab_size,
        blank_as_pad=rc.blank_as_pad,
    )
    joint = _nemo_rnnt().RNNTJoint(
        jointnet={
            "joint_hidden": rc.joint_hidden,
            "activation": "relu",
            "encoder_hidden": rc.encoder_hidden,
            "pred_hidden": rc.pred_hidden,
            "dropout": dropout,
        },
        num_classes=rc.vocab_size,
    )
    return dec.eval(), joint.eval()


def _release_tensors(dec, joint) -> dict[str, np.ndarray]:
    out = {}
    for prefix, module in (("stt_model.rnnt_decoder.", dec), ("stt_model.rnnt_joint.", joint)):
        for k, v in module.state_dict().items():
            out[prefix + k] = v.detach().numpy()
    return out


def _randomize(dec, joint, gen) -> None:
    """Random weights with a moderate blank: frames emit 0, a few, or the 10-symbol cap."""
    with torch.no_grad():
        for p in [*dec.parameters(), *joint.parameters()]:
            std = p.shape[-1] ** -0.5 if p.ndim == 2 else 0.3
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        dec.prediction.embed.weight.mul_(3.0)
        dec.prediction.embed.weight[RC.blank_id] = 0  # the padding_idx row stays zero
        joint.pred.weight.mul_(3.0)  # the prediction net must steer the labels
        joint.joint_net[2].bias[RC.blank_id] += 3.0


def _frames_of(labels, stamps) -> list[list[int]]:
    """Per-frame label lists from a NeMo hypothesis (labels and their frame indices)."""
    out = [[] for _ in range(T)]
    for k, t in zip(np.asarray(labels).tolist(), np.asarray(stamps).tolist(), strict=True):
        out[int(t)].append(int(k))
    return out


def _ours_frames(tokens, n_tokens) -> list[list[int]]:
    """Per-frame label lists from one slot's tokens [T, M] / n_tokens [T]."""
    tokens, n_tokens = np.asarray(tokens), np.asarray(n_tokens)
    assert np.all(tokens[np.arange(tokens.shape[-1])[None] >= n_tokens[:, None]] == RC.blank_id)
    return [tokens[t, : n_tokens[t]].tolist() for t in range(tokens.shape[0])]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def ref():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(SEED)
    dec, joint = _nemo_modules(RC)
    _randomize(dec, joint, gen)
    # Frame scales spread over 0.2..2 so that some frames are blank and some hit the cap.
    scale = torch.linspace(0.2, 2.0, T)[torch.randperm(T, generator=gen)]
    enc = torch.randn(1, T, RC.encoder_hidden, generator=gen) * scale[None, :, None]
    # The second stream starts quiet: its first chunks are all blank, so the start-of-stream
    # state must survive calls that emit nothing.
    quiet = torch.full((T,), 2.0)
    quiet[:QUIET] = 0.01
    enc2 = torch.randn(1, T, RC.encoder_hidden, generator=gen) * quiet[None, :, None]
    params = fill(
        rnnt.abstract(RC, Precision.fp32()),
        rnnt_keys.rules(CFG),
        _release_tensors(dec, joint),
        param_prefix="rnnt",
    )
    params = jax.tree_util.tree_map(jnp.asarray, params)
    return dec, joint, params, enc, enc2


def _nemo_whole(dec, joint, enc, batched: bool):
    kw = {"blank_index": RC.blank_id, "max_symbols_per_step": RC.max_symbols}
    if batched:
        infer = _greedy().GreedyBatchedRNNTInfer(dec, joint, **kw, use_cuda_graph_decoder=False)
    else:
        infer = _greedy().GreedyRNNTInfer(dec, joint, **kw)
    (hyp,) = infer(encoder_output=enc.transpose(1, 2), encoded_lengths=torch.tensor([T]))[0]
    return _frames_of(hyp.y_sequence, hyp.timestamp)


def _nemo_chunked(dec, joint, enc):
    """Label-looping greedy decoding, CHUNK frames per call, carrying ``partial_hypotheses``."""
    infer = _greedy().GreedyBatchedRNNTInfer(
        dec,
        joint,
        blank_index=RC.blank_id,
        max_symbols_per_step=RC.max_symbols,
        use_cuda_graph_decoder=False,
    )
    hyps = None
    for t0 in range(0, T, CHUNK):
        x = enc[:, t0 : t0 + CHUNK]
        hyps = infer(
            encoder_output=x.transpose(1, 2),
            encoded_lengths=torch.tensor([x.shape[1]]),
            partial_hypotheses=hyps,
        )[0]
    (hyp,) = hyps
    return _frames_of(hyp.y_sequence, hyp.timestamp), hyp.dec_state


_step = jax.jit(rnnt.rnnt_step, static_argnames="cfg")


def _ours(params, enc: np.ndarray, chunk: int, step=_step):
    """Our decoding of enc [B, T, D_enc], ``chunk`` frames per call."""
    state = rnnt.init_state(RC, enc.shape[0], Precision.fp32())
    toks, ns = [], []
    for t0 in range(0, enc.shape[1], chunk):
        state, tok, n = step(params, state, jnp.asarray(enc[:, t0 : t0 + chunk]), cfg=RC)
        toks.append(np.asarray(tok))
        ns.append(np.asarray(n))
    return state, np.concatenate(toks, axis=1), np.concatenate(ns, axis=1)


@pytest.fixture(scope="module")
def nemo_frames(ref):
    """NeMo's per-frame labels of both streams (``GreedyRNNTInfer``, whole sequence)."""
    dec, joint, _, enc, enc2 = ref
    return [_nemo_whole(dec, joint, x, batched=False) for x in (enc, enc2)]


def test_reference_is_a_hard_case(ref, nemo_frames):
    """The NeMo decoders agree; the case has blank, partial and capped frames, and a quiet start."""
    dec, joint, _, enc, enc2 = ref
    for x, frames in zip((enc, enc2), nemo_frames, strict=True):
        assert _nemo_whole(dec, joint, x, batched=True) == frames
    counts = np.array([len(f) for f in nemo_frames[0]])
    assert (counts == 0).sum() >= 3
    assert (counts == RC.max_symbols).sum() >= 3
    assert ((counts > 0) & (counts < RC.max_symbols)).sum() >= 3
    assert len({k for f in nemo_frames[0] for k in f}) >= 5  # more than a repeated label
    counts2 = np.array([len(f) for f in nemo_frames[1]])
    assert not counts2[:QUIET].any()
    assert counts2[QUIET:].any()


@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("chunk", [1, CHUNK])
def test_greedy_matches_nemo(ref, nemo_frames, chunk, stream):
    """Frame by frame and 3 frames a call, our labels equal NeMo's whole-sequence decoding."""
    x = ref[3 + stream].numpy()
    _, tokens, n_tokens = _ours(ref[2], x, chunk)
    assert _ours_frames(tokens[0], n_tokens[0]) == nemo_frames[stream]


def test_unrolled_lstm_matches_nemo_and_the_scan(ref, nemo_frames):
    """The serving layout a GPU gets (``rnnt.serving_layout``): the LSTM's layers as per-layer
    leaves, run unrolled, give NeMo's labels and the scan's state; the CPU keeps the stack
    unless asked, and params already split are returned as they are."""
    params = ref[2]
    assert rnnt.serving_layout(params) is params
    split = rnnt.serving_layout(params, unrolled=True)
    assert len(split.lstm.w_in) == RC.pred_layers
    np.testing.assert_array_equal(split.lstm.w_hidden[1], params.lstm.w_hidden[1])
    np.testing.assert_array_equal(split.lstm.b[0], params.lstm.b[0])
    assert rnnt.serving_layout(split, unrolled=True) is split
    x = ref[3].numpy()
    s_scan, _, _ = _ours(params, x, CHUNK)
    s_unr, tokens, n_tokens = _ours(split, x, CHUNK)
    assert _ours_frames(tokens[0], n_tokens[0]) == nemo_frames[0]
    for a, b in zip(
        jax.tree_util.tree_leaves(s_unr), jax.tree_util.tree_leaves(s_scan), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_carried_state_matches_nemo_partial_hypotheses(ref, nemo_frames):
    """NeMo chunked with ``partial_hypotheses`` == NeMo whole == ours; the carried state matches."""
    dec, joint, params, enc, _ = ref
    frames, item = _nemo_chunked(dec, joint, enc)
    assert frames == nemo_frames[0]
    state, _, _ = _ours(params, enc.numpy(), CHUNK)
    h, c = item.predictor_state  # [L, D] each: the slot's LSTM state after its last label
    assert _rel(state.h[0], h.numpy()) < 1e-5
    assert _rel(state.c[0], c.numpy()) < 1e-5
    assert _rel(state.pred[0], item.predictor_output.reshape(-1).numpy()) < 1e-5
    last = [k for f in nemo_frames[0] for k in f][-1]
    assert int(state.label[0]) == int(item.label) == last


def test_batch_of_two_equals_each_alone(ref):
    _, _, params, enc, enc2 = ref
    both = np.concatenate([enc.numpy(), enc2.numpy()], axis=0)
    state, tokens, n_tokens = _ours(params, both, CHUNK)
    for b, x in enumerate((enc, enc2)):
        s1, t1, n1 = _ours(params, x.numpy(), CHUNK)
        np.testing.assert_array_equal(tokens[b : b + 1], t1)
        np.testing.assert_array_equal(n_tokens[b : b + 1], n1)
        for got, want in zip(
            jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(s1), strict=True
        ):
            np.testing.assert_allclose(np.asarray(got)[b : b + 1], want, rtol=0, atol=1e-6)
    assert not np.array_equal(tokens[0], tokens[1])  # the two slots really differ


def test_jit_equals_eager(ref):
    _, _, params, enc, _ = ref
    x = enc.numpy()[:, : 2 * CHUNK]

    def eager(*a, **k):
        with jax.disable_jit():
            return rnnt.rnnt_step(*a, **k)

    s_jit, t_jit, n_jit = _ours(params, x, CHUNK)
    s_eager, t_eager, n_eager = _ours(params, x, CHUNK, step=eager)
    np.testing.assert_array_equal(t_jit, t_eager)
    np.testing.assert_array_equal(n_jit, n_eager)
    assert n_jit.sum() > 0
    for a, b in zip(
        jax.tree_util.tree_leaves(s_jit), jax.tree_util.tree_leaves(s_eager), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_one_joint_evaluation_matches_nemo(ref):
    """Prediction net (from a random state, and from the start symbol) and joint logits."""
    dec, joint, params, _, _ = ref
    gen = torch.Generator().manual_seed(7)
    B = 4
    labels = torch.randint(0, RC.vocab_size, (B,), generator=gen)
    h = torch.randn(RC.pred_layers, B, RC.pred_hidden, generator=gen) * 0.5
    c = torch.randn(RC.pred_layers, B, RC.pred_hidden, generator=gen)
    enc = torch.randn(B, 1, RC.encoder_hidden, generator=gen)
    joint.log_softmax = False  # raw logits (NeMo log-softmaxes on the CPU only)
    try:
        with torch.no_grad():
            g, (h1, c1) = dec.predict(labels[:, None], state=(h, c), add_sos=False)
            want = joint.joint(enc, g)[:, 0, 0]  # [B, V + 1]
            g0, _ = dec.predict(None, state=None, add_sos=False, batch_size=B)
            want0 = joint.joint(enc, g0)[:, 0, 0]
    finally:
        joint.log_softmax = None

    jh, jc = (jnp.asarray(np.swapaxes(x.numpy(), 0, 1)) for x in (h, c))  # [B, L, D]
    ours_g, ours_h, ours_c = rnnt.predict(params, jnp.asarray(labels.numpy()), jh, jc, cfg=RC)
    f = rnnt.project_encoder(params, jnp.asarray(enc[:, 0].numpy()))
    logits = rnnt.joint_logits(params, f, rnnt.project_prediction(params, ours_g))
    assert _rel(ours_g, g[:, 0].numpy()) <= 1e-5
    assert _rel(ours_h, np.swapaxes(h1.numpy(), 0, 1)) <= 1e-5
    assert _rel(ours_c, np.swapaxes(c1.numpy(), 0, 1)) <= 1e-5
    assert _rel(logits, want.numpy()) <= 1e-5

    zeros = jnp.zeros_like(jh)
    blank = jnp.full((B,), RC.blank_id, jnp.int32)
    ours_g0, _, _ = rnnt.predict(params, blank, zeros, zeros, cfg=RC)
    logits0 = rnnt.joint_logits(params, f, rnnt.project_prediction(params, ours_g0))
    assert _rel(logits0, want0.numpy()) <= 1e-5


def test_release_key_table_at_full_size():
    """15 release tensors, 8.94 M values; the table fills every parameter exactly."""
    full = voicechat_11b()
    dec, joint = _nemo_modules(full.rnnt)
    tensors = _release_tensors(dec, joint)
    rules = rnnt_keys.rules(full)
    assert len(tensors) == 15
    assert {r.release for r in rules} == set(tensors)
    n_release = sum(x.size for x in tensors.values())
    assert round(n_release / 1e6, 2) == 8.94
    abstract = rnnt.abstract(full.rnnt, Precision.reference())
    params = fill(abstract, rules, tensors, param_prefix="rnnt")
    # bias_ih and bias_hh are summed into one slot per layer
    summed = full.rnnt.pred_layers * 4 * full.rnnt.pred_hidden
    assert count_params(abstract) == count_params(params) == n_release - summed
    np.testing.assert_array_equal(
        params.lstm.b[1],
        tensors["stt_model.rnnt_decoder.prediction.dec_rnn.lstm.bias_ih_l1"]
        + tensors["stt_model.rnnt_decoder.prediction.dec_rnn.lstm.bias_hh_l1"],
    )
    np.testing.assert_array_equal(
        params.joint.out, tensors["stt_model.rnnt_joint.joint_net.2.weight"].T
    )
