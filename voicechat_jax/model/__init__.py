"""The Nemotron VoiceChat 11B network as pure functions over typed parameter pytrees.

One module per sub-network: ``mel`` (streaming log-mel front end), ``conformer`` (cache-aware
FastConformer + ``perception.proj``), ``nano`` (the hybrid Mamba-2/attention LLM and its heads),
``rnnt`` (the transcript side head), ``gemma`` (the speech decoder backbone), ``char_encoder``
(its char-aware text side), ``ear_tts`` and ``mog`` (gated fusion, MoG head, RVQ refinement),
``codec`` (the RVQ-VAE codec); ``voicechat`` joins them into one frame step.

Axis alphabet, used in every einsum, shape comment and docstring of the package:

====  ==========================================================
``B``  slots (live sessions); for CFG rows ``B`` doubles, see ear_tts
``T``  frames (80 ms model frames) or, inside a sub-network, its own time steps
``S``  cache length (attention context kept per slot)
``N``  query heads
``K``  key/value heads
``G``  query heads per key/value head (``N // K``)
``H``  head dim
``D``  model dim
``F``  MLP (feed-forward) dim
``Q``  quantizers (codebooks)
``V``  vocabulary
``L``  layers (a stacked leading axis)
``C``  channels of a convolution
``P``  Mamba-2 SSM state size (``ssm_state_size``)
``E``  mixture components of the MoG head
``M``  mel bins
``Z``  the speech decoder's latent size (one RVQ frame before quantization)
``Y``  codebook size of one quantizer (codes ``0 .. Y-1``; ``Y`` is the mask id)
``U``  prompt positions (the speech decoder's speaker prompt, the LLM's system prompt)
``X``  the SSD chunk length of the Mamba-2 prefill
``J``  characters per token (the speech decoder's char-aware text side)
``I``  tokens flattened into rows (the char encoder's batch)
``O``  RNNT symbols per frame (``max_symbols``)
====  ==========================================================

Inside the Mamba mixer ``N``/``H``/``K``/``G`` are its heads, head dim, B/C groups and heads per
group (the GQA analogy); Mamba's B and C matrices are arrays ``b_mat``/``c_mat``, never letters.
Each letter means one thing everywhere; a sub-network's further local axis takes an unused letter
and is named in its module docstring.
"""
