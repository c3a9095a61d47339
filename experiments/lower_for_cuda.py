"""Lowers the dispatch tick for CUDA on a machine without a GPU: a check before device time.

The tick is traced as it would be on a GPU (the weights in a GPU's serving layout; the Pallas
kernels as Triton calls, not in the interpreter; the codec's multi-pass product presets, which
the CPU refuses) and lowered for the
``cuda`` platform, with abstract weights and state, so a configuration that cannot lower fails
here and not on the lent machine. It does not compile: XLA's GPU compile, Triton's included,
needs the device. Prints the size of the lowered module, its Triton calls and its products by
precision.

  PYTHONPATH=. python3 experiments/lower_for_cuda.py --model=voicechat_11b --precision=tf32x3_codec

The kernels default to 'auto', made as a GPU server makes them for ``--slots``
(``ServeConfig.resolved``); the line printed names them.
"""

from __future__ import annotations

import dataclasses
import re

from absl import app, flags

from experiments.harness import abstract_tick_args, traced_as_gpu
from voicechat_jax import config as config_lib
from voicechat_jax import step as step_lib
from voicechat_jax.precision import CODEC_MATMUL, policy

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_string("precision", "reference", "Precision policy (voicechat_jax.precision).")
flags.DEFINE_enum("codec_matmul", None, list(CODEC_MATMUL), "Override of the policy's.")
flags.DEFINE_integer("slots", 64, "Slots of the tick (the 'auto' kernels depend on them).")
flags.DEFINE_integer("context_frames", 64, "Context cap (the shapes, not the cost, matter here).")
flags.DEFINE_enum("ssm_kernel", "auto", [m.value for m in config_lib.SSMKernel], "Mamba step.")
flags.DEFINE_enum("attention", "auto", [m.value for m in config_lib.AttentionImpl], "LLM's.")
flags.DEFINE_enum(
    "tts_attention", None, [m.value for m in config_lib.AttentionImpl], "Speech decoder's."
)
flags.DEFINE_bool(
    "codec_in_attention", False, "Each frame's codec products in the next frame's attention."
)
flags.DEFINE_bool(
    "codec_frame_behind",
    False,
    "With codec_in_attention, the codec a frame behind: every frame's products in attention.",
)


def main(argv):
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]()
    precision = policy(FLAGS.precision)
    if FLAGS.codec_matmul:
        precision = dataclasses.replace(precision, codec_matmul=FLAGS.codec_matmul)
    serve = config_lib.ServeConfig(
        slots=FLAGS.slots,
        context_frames=FLAGS.context_frames,
        ssm_kernel=FLAGS.ssm_kernel,
        attention=FLAGS.attention,
        tts_attention=FLAGS.tts_attention,
        codec_in_attention=FLAGS.codec_in_attention,
        codec_frame_behind=FLAGS.codec_frame_behind,
        precision=precision,
    ).resolved("gpu")
    args = abstract_tick_args(cfg, serve)
    with traced_as_gpu():
        traced = step_lib.make_tick(cfg, serve).trace(*args)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    products = re.findall(r"stablehlo\.dot_general[^\n]*", text)
    kinds = {
        "tf32_x3": sum("tf32" in p and "num_primitive_operations = 3" in p for p in products),
        "tf32": sum("tf32" in p and "num_primitive_operations = 1" in p for p in products),
        "bf16_x6": sum("lhs_precision_type = bf16" in p and "algorithm" in p for p in products),
        "HIGHEST": sum("HIGHEST" in p for p in products),
        "HIGH": sum("[HIGH, HIGH]" in p for p in products),
    }
    fused = text.count('name = "attention_and_product"')
    matmuls = text.count('name = "matmul"')
    print(
        f"{FLAGS.model} tick lowered for cuda: {len(text):,} characters, "
        f"{text.count('__gpu$xla.gpu.triton')} Triton calls "
        f"({fused} attention_and_product, {matmuls} matmul), "
        f"{len(products)} products {kinds}; "
        f"{serve.slots} slots, kernels {serve.kernels().row()}"
    )


if __name__ == "__main__":
    app.run(main)
