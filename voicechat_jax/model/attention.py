"""Attention: the one masked body every attention of the model uses, and the decode entry point.

``masked_softmax`` is the model's masked softmax (scores in fp32, the masked ones set to a fill
before the softmax, probabilities cast to the operands' dtype), and ``gqa`` the grouped-query
attention body over a [B, K, S, H] cache built on it: ``nano._attend`` (the LLM), the speech
decoder's multi-position path (``gemma.forward``) and ``attend``'s 'xla' path all run ``gqa``;
the character encoder (its own key layout) and the Conformer (NeMo's -10000 fill, masked
probabilities zeroed after) run ``masked_softmax``.

``attend`` is one step (T = 1) of causal self-attention over a per-slot KV cache: the query of
each slot against the rows its cache holds. It serves the speech decoder's multi-head attention
(``gemma.forward``: G = 1, fp32 or bf16 KV, sliding-window and global layers) and the LLM's
grouped-query attention (``nano._attn``: G > 1, bf16 KV, global), with the implementation picked
by one switch (``AttentionImpl``):

- ``'xla'``: the jnp path, exactly the model's own math at T = 1 (scores in fp32 from operands in
  q's dtype, ``jnp.finfo(float32).min`` on masked scores, softmax in fp32, probabilities cast to
  q's dtype, the value product accumulated in fp32 and cast to q's dtype), so swapping it in for
  ``nano._attend`` or the attention of ``gemma.forward`` changes no output bit (the tests check
  it against copies of both). It reads the whole cache whatever the lengths.
- ``'cudnn'``: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` with
  ``key_value_seq_lengths``. It costs layout copies: that API takes [B, T, N, H] queries and
  [B, S, K, H] keys and values, so each of k and v is transposed from the cache's [B, K, S, H]
  (a full read and write of the layer's cache per call, twice the bytes the attention itself
  needs), and q from [B, K, G, H] is only reshaped. cuDNN's flash attention takes fp16/bf16
  operands only: with a bf16 cache q is rounded to bf16 and the output comes back through bf16;
  an fp32 cache is refused (use 'xla' or 'pallas'). Its ``local_window_size`` counts from the
  query's index in T (0 here), not from the slot's position, so a sliding window is passed as a
  boolean ``mask`` [B, 1, 1, S] instead (cuDNN turns it into an additive bias read per score).
- ``'pallas'``: ``pallas_kernels.decode_attention``, the split-K Triton kernel that reads the
  cache as stored and skips the rows a slot does not attend to (interpreted on the CPU, decided
  at trace time). fp32 softmax; it matches 'xla' to rounding, not bit for bit. Written for the
  LLM's grouped-query case (G > 1); at G = 1 it pads H to 128 lanes and has one query row per
  program.
- ``'pallas_mha'``: at G = 1 (the speech decoder), ``pallas_kernels.mha_decode_attention``, the
  kernel laid out for one query per kv head (heads as rows, H unpadded, a bf16 cache read as
  bf16, rows past a slot's length skipped); at G > 1 the same kernel as ``'pallas'``, so one value
  can serve both attentions. fp32 softmax; it matches 'xla' to rounding. A new value rather than
  a change to ``'pallas'`` at G = 1: it has not been measured against XLA on the H200 yet, and
  ``--attention=pallas`` (which the speech decoder follows by default) keeps meaning what its
  measured rows measured.

Shapes (axis letters of ``voicechat_jax.model``): q [B, K, G, H] (query head ``n = k * G + g``,
i.e. ``q.reshape(B, K, G, H)`` of the model's [B, N, H]); k, v [B, K, S, H] one layer's cache,
position p of a slot at row p; lengths [B] int32 the rows each slot has written, its query's own
included (the model's ``pos + 1``). Key row j of slot b is attended iff ``j < lengths[b]`` and,
with a ``window``, ``lengths[b] - 1 - j < window`` (``gemma.forward``'s ``distance < window``).
A window of S or more cuts nothing at any length up to S and is dropped (the global path runs:
at 11B the speech decoder's sliding window, 7500, exceeds its 1537-row cache at the cap).
A slot that sees no row (``lengths <= 0``, or a window wholly past the cache: a length
beyond S) gets an output of zeros under every implementation. Returns [B, K, G, H] in q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import DecodeAttentionBlocks, decode_attention
from pallas_kernels.mha_decode_attention import MHABlocks, mha_decode_attention
from voicechat_jax.config import AttentionImpl

F32 = jnp.float32


def _seen(lengths: jax.Array, S: int, window: int | None) -> jax.Array:
    """[B, S] bool: the rows each slot attends to, built as the model builds its masks.

    The query's position is ``lengths - 1``; causal is ``key <= position`` and the window
    ``position - key < window``, the same comparisons (and so the same booleans) as
    ``nano._attn`` and ``gemma.forward``.
    """
    position = (lengths - 1).astype(jnp.int32)[:, None]  # [B, 1]
    key_pos = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S]
    seen = key_pos <= position
    if window is not None:
        seen = seen & (position - key_pos < window)
    return seen


MASKED = float(jnp.finfo(F32).min)  # the score of a masked position (NeMo's -10000 aside)


def masked_softmax(scores, mask, dtype, *, fill: float = MASKED, zero_masked: bool = False):
    """``softmax(where(mask, scores, fill))`` over the last axis, in fp32, cast to ``dtype``.

    ``scores`` fp32 (already scaled); ``mask`` bool, broadcastable to it. ``zero_masked`` sets
    the masked probabilities to 0 after the softmax (NeMo's Conformer does; a row with nothing
    unmasked then gives zeros rather than a uniform average).
    """
    probs = jax.nn.softmax(jnp.where(mask, scores, fill), axis=-1)
    if zero_masked:
        probs = jnp.where(mask, probs, 0.0)
    return probs.astype(dtype)


def gqa(q, k, v, mask, *, scale: float) -> jax.Array:
    """Masked grouped-query attention: the model's body, in q's dtype.

    q [B, T, K, G, H] (query head ``n = k * G + g``); k, v [B, K, S, H]; mask bool broadcastable
    to [B, K, G, T, S]. Scores from operands in q's dtype, accumulated in fp32 and scaled,
    ``masked_softmax``, the value product accumulated in fp32. Returns [B, T, K, G, H].
    """
    act = q.dtype
    scores = jnp.einsum("btkgh,bksh->bkgts", q, k.astype(act), preferred_element_type=F32)
    probs = masked_softmax(scores * scale, mask, act)
    # [B, K, G, T, H] first, then moved: XLA:CPU has no bf16 x bf16 -> fp32 dot for "->btkgh".
    out = jnp.einsum("bkgts,bksh->bkgth", probs, v.astype(act), preferred_element_type=F32)
    return jnp.moveaxis(out, 3, 1).astype(act)


def _attend_xla(q, k, v, lengths, window: int | None, scale: float) -> jax.Array:
    """The model's jnp attention at T = 1 (``gqa`` with T kept as an axis)."""
    mask = _seen(lengths, k.shape[2], window)[:, None, None, None]  # [B, 1, 1, T=1, S]
    return gqa(q[:, None], k, v, mask, scale=scale)[:, 0]  # [B, K, G, H]


def _attend_dpa(q, k, v, lengths, window: int | None, scale: float, implementation: str):
    """``jax.nn.dot_product_attention`` in its [B, T, N, H] layout (``implementation`` 'cudnn';
    'xla' runs the same plumbing on the CPU, which is how the tests check it)."""
    Bsz, K, G, H = q.shape
    S = k.shape[2]
    dtype = k.dtype
    query = q.reshape(Bsz, 1, K * G, H).astype(dtype)  # [B, T=1, N, H]
    key = jnp.swapaxes(k, 1, 2)  # [B, S, K, H]: a copy of the cache
    value = jnp.swapaxes(v, 1, 2)
    mask = None
    if window is not None:
        mask = _seen(lengths, S, window)[:, None, None, :]  # [B, 1, 1, S]
    out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        key_value_seq_lengths=jnp.clip(lengths, 0, S).astype(jnp.int32),
        implementation=implementation,
    )
    return out.reshape(Bsz, K, G, H).astype(q.dtype)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None,
    scale: float,
    impl: AttentionImpl | str = AttentionImpl.XLA,
    blocks: DecodeAttentionBlocks | None = None,
    mha_blocks: MHABlocks | None = None,
) -> jax.Array:
    """One decode step of attention over a per-slot KV cache (the module docstring's contract).

    Args:
      q: [B, K, G, H] the step's query, in the activation dtype.
      k, v: [B, K, S, H] one layer's cache as stored, position p at row p.
      lengths: [B] int32 rows written per slot, the query's own included.
      window: static sliding window (the last ``window`` rows), or None for a global layer.
      scale: static Python float multiplying q . k.
      impl: 'xla', 'cudnn', 'pallas' or 'pallas_mha' (static).
      blocks: the grouped-query kernel's tiling ('pallas', and 'pallas_mha' at G > 1); default
        ``DecodeAttentionBlocks()``.
      mha_blocks: the G = 1 kernel's tiling ('pallas_mha' at G = 1); default
        ``mha_decode_attention.default_blocks`` for the cache's dtype.

    Returns:
      [B, K, G, H] in q's dtype; exactly zero for a slot that sees no row.

    Raises:
      ValueError: on an unknown ``impl``, inconsistent shapes, a bad window, or 'cudnn' with a
        cache that is not fp16/bf16.
    """
    impl = AttentionImpl(impl)
    _check(q.ndim == 4, f"q must be [B, K, G, H]: {q.shape}")
    Bsz, K, G, H = q.shape
    _check(
        k.ndim == 4 and k.shape[:2] == (Bsz, K) and k.shape[3] == H and v.shape == k.shape,
        f"k and v must be [B={Bsz}, K={K}, S, H={H}]: {k.shape}, {v.shape}",
    )
    _check(lengths.shape == (Bsz,), f"lengths must be [B={Bsz}]: {lengths.shape}")
    _check(
        window is None or (isinstance(window, int) and window >= 1),
        f"window must be None or a static int >= 1: {window!r}",
    )
    S = k.shape[2]
    if window is not None and window >= S:
        window = None  # cuts nothing at any length <= S: run the global path (no mask to build)
    # No CPU lowering for the kernels: they run in the Pallas interpreter there.
    interpret = jax.default_backend() == "cpu"
    if impl == AttentionImpl.PALLAS_MHA and G == 1:
        return mha_decode_attention(
            q, k, v, lengths, window=window, scale=scale, interpret=interpret, blocks=mha_blocks
        )
    if impl in (AttentionImpl.PALLAS, AttentionImpl.PALLAS_MHA):
        b = blocks or DecodeAttentionBlocks()
        return decode_attention(
            q,
            k,
            v,
            lengths,
            window=window,
            scale=scale,
            interpret=interpret,
            block_s=b.block_s,
            split_s=b.split_s,
            num_warps=b.num_warps,
            num_stages=b.num_stages,
            dot=b.dot,
        )
    if impl == AttentionImpl.CUDNN:
        _check(
            k.dtype in (jnp.bfloat16, jnp.float16),
            f"'cudnn' needs a bf16 or fp16 cache (cuDNN flash attention): {k.dtype}; "
            "use 'xla' or 'pallas' for an fp32 cache",
        )
        out = _attend_dpa(q, k, v, lengths, window, scale, "cudnn")
    else:
        out = _attend_xla(q, k, v, lengths, window, scale)
    # A slot that sees no row: a softmax over nothing, which both paths would turn into a mean
    # of rows; defined as 0, as the kernel and the reference return.
    hi = jnp.minimum(lengths, S)
    lo = 0 if window is None else jnp.maximum(lengths - window, 0)
    return jnp.where((hi > lo)[:, None, None, None], out, jnp.zeros((), out.dtype))
