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
====  ==========================================================
"""
