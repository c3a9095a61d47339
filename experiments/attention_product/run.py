"""How much of the faithful tick's fp32 products hides inside the speech decoder's attention launch?

See README.md. At the 11B shapes (``--slots`` sessions, two CFG rows each, every cache row full:
the faithful fp32 cache at the two-minute cap) each timing runs ``--layers`` attention launches
in a chain (each layer's query is the last one's output, as layers follow one another), each
beside one product of the same shape, and is the median of ``--calls`` calls divided by the
layers:

- ``attention``: ``mha_decode_attention`` alone (the tick's kernel at these slots);
- ``xla``, ``pallas``: the product alone, as XLA runs it (``jnp.dot`` at HIGHEST, the tick's
  way) and by the fused kernel's product role (``attention_product.fp32_product``);
- ``serial``: the attention, then XLA's product (as the tick runs them); ``serial_pallas``: the
  attention, then the Pallas product (two launches of the fused kernel's code);
- ``interleaved``, ``blocked``: both in one launch (``attention_product.attention_and_product``).

``hidden`` = (serial - interleaved) / min(attention, xla): the share of the shorter part the one
launch took off against the two; ``same``: the one launch's outputs equal the two Pallas
launches' bit for bit (the attention and the product); ``vs_xla_max_abs``: the Pallas product
against XLA's. The products are the first frame's codec products (``codec.decode_step``: each
stage's transposed-conv product, then its ConvNeXt blocks' two products, rows = slots x the
stage's steps a frame; the largest in halves of their rows, ``_half``, as the tick asks for
them since da10f40) and the speech decoder's four weight products at one CFG half of its rows
(the rows a slot-split pipeline would run beside the other half's attention). Rows go to
``--out``; a table is printed last, with ``saving_ms`` = (serial - interleaved) times the
product's count a beat (the codec's first frame: one a layer launch, both frames a frame
behind; the backbone: 28 layers x 2 frames), an estimate from per-layer rows, not a tick
measurement.

    PYTHONPATH=. python3 experiments/attention_product/run.py --out=rows.jsonl
    PYTHONPATH=. python3 experiments/attention_product/run.py --tiny --interpret  # CPU check
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import harness
from pallas_kernels import attention_product as ap
from pallas_kernels.mha_decode_attention import MHABlocks, default_blocks, mha_decode_attention
from voicechat_jax import config as config_lib
from voicechat_jax.model import codec as codec_lib
from voicechat_jax.model.beside import xla_product

FLAGS = flags.FLAGS
flags.DEFINE_integer("slots", 96, "Sessions (two speech-decoder rows each; codec rows follow).")
flags.DEFINE_integer("layers", 8, "Attention launches chained in one timed call.")
flags.DEFINE_list("products", None, "Products to measure (names in the table); default all.")
flags.DEFINE_string("blocks", None, "The attention's tiling (MHABlocks.label); default its own.")
flags.DEFINE_integer("block_m", 64, "Product tile rows.")
flags.DEFINE_integer("block_f", 64, "Product tile columns.")
flags.DEFINE_integer("block_k", 32, "Product contraction step.")
flags.DEFINE_integer("num_stages", None, "The one launch's Triton stages (default its own).")
flags.DEFINE_integer("calls", 10, "Timed calls per timing (median), after 2 warm-up calls.")
flags.DEFINE_bool("tiny", False, "The tiny model's shapes (with --interpret: a CPU check).")
flags.DEFINE_bool("interpret", False, "The Pallas interpreter (a CPU check of the script).")
flags.DEFINE_string("label", "default", "The run's name.")
flags.DEFINE_string("out", None, "JSON-lines output file (appended).")

VARIANTS = ("attention", "xla", "pallas", "serial", "serial_pallas", "interleaved", "blocked")


@dataclasses.dataclass(frozen=True)
class Product:
    """One of the tick's fp32 products: x [M, C] @ w [C, F], ``per_beat`` times a beat."""

    name: str
    M: int
    C: int
    F: int
    per_beat: int


def products(cfg: config_lib.ModelConfig, slots: int) -> list[Product]:
    """A frame's codec products as the tick asks for them, and the speech decoder's at half its
    CFG rows.

    The codec's are ``codec.decode_step_products``' with one place a speech-decoder layer: the
    largest in two halves of their rows (``_half``, counted twice) until each layer has one.
    """
    codec, tts = cfg.codec, cfg.tts
    asked, steps, c_in = [], 1, codec.latent_size  # (name, M, C, F) in the generator's order
    mults, rates = tuple(reversed(codec.channel_mult)), tuple(reversed(codec.rates))
    for s, (m, r) in enumerate(zip(mults, rates, strict=True), 1):
        C = codec.base_hidden * m
        asked.append((f"codec_up{s}", slots * steps, c_in, C * r))
        steps *= r
        for _ in range(codec.num_blocks):
            asked.append((f"codec_pw1_{s}", slots * steps, C, 4 * C))
            asked.append((f"codec_pw2_{s}", slots * steps, 4 * C, C))
        c_in = C
    halved = codec_lib.halved_products([M * C * F for _, M, C, F in asked], tts.n_layers)
    counts: dict[tuple, int] = {}
    for i, (name, M, C, F) in enumerate(asked):
        key = (f"{name}_half", -(-M // 2), C, F) if i in halved else (name, M, C, F)
        counts[key] = counts.get(key, 0) + (2 if i in halved else 1)
    out = [Product(name, M, C, F, n) for (name, M, C, F), n in counts.items()]
    D, H, per = tts.d_model, tts.head_dim, 2 * tts.n_layers
    for name, C, F in (
        ("tts_qkv", D, (tts.n_heads + 2 * tts.n_kv_heads) * H),
        ("tts_o", tts.n_heads * H, D),
        ("tts_gate_up", D, 2 * tts.mlp_dim),
        ("tts_down", tts.mlp_dim, D),
    ):
        out.append(Product(name, slots, C, F, per))  # one of the two CFG halves: slots rows
    return out


def measure(cfg, prod: Product, blocks: MHABlocks, pblocks: ap.ProductBlocks) -> dict:
    tts = cfg.tts
    Bsz, K, H = 2 * FLAGS.slots, tts.n_kv_heads, tts.head_dim
    S = tts.prompt_frames + (40 if FLAGS.tiny else config_lib.ServeConfig().context_frames)
    scale = tts.query_pre_attn_scalar**-0.5
    keys = jax.random.split(jax.random.key(0), 4 + FLAGS.layers)
    q = jax.random.normal(keys[0], (Bsz, K, 1, H), jnp.float32)
    k = jax.random.normal(keys[1], (Bsz, K, S, H), jnp.float32)
    v = jax.random.normal(keys[2], (Bsz, K, S, H), jnp.float32)
    lengths = jnp.full((Bsz,), S, jnp.int32)  # every row full: the worst case, the floor's
    w = jax.random.normal(keys[3], (prod.C, prod.F), jnp.float32) / np.sqrt(prod.C)
    xs = tuple(jax.random.normal(kx, (prod.M, prod.C), jnp.float32) for kx in keys[4:])
    kw = dict(scale=scale, blocks=blocks, interpret=FLAGS.interpret)
    attend = functools.partial(mha_decode_attention, **kw)
    pallas = functools.partial(ap.fp32_product, product=pblocks, interpret=FLAGS.interpret)

    def fused(order):
        return functools.partial(
            ap.attention_and_product, **kw, product=pblocks, order=order,
            num_stages=FLAGS.num_stages,
        )  # fmt: skip

    steps = {  # (q, x) -> (q, y) for one layer
        "attention": lambda q, x: (attend(q, k, v, lengths), None),
        "xla": lambda q, x: (q, xla_product(x, w)),
        "pallas": lambda q, x: (q, pallas(x, w)),
        "serial": lambda q, x: (attend(q, k, v, lengths), xla_product(x, w)),
        "serial_pallas": lambda q, x: (attend(q, k, v, lengths), pallas(x, w)),
        "interleaved": lambda q, x: fused("interleaved")(q, k, v, lengths, x, w),
        "blocked": lambda q, x: fused("blocked")(q, k, v, lengths, x, w),
    }

    def chain(step):
        def run(q, xs):
            ys = []
            for x in xs:
                q, y = step(q, x)
                ys.append(y)
            return q, ys

        return jax.jit(run)

    ms, outs = {}, {}
    for name in VARIANTS:
        fn = chain(steps[name])
        outs[name] = fn(q, xs)
        ms[name] = harness.time_call(lambda fn=fn: fn(q, xs), calls=FLAGS.calls) / FLAGS.layers

    def equal(a, b) -> bool:
        return all(bool(jnp.array_equal(u, t)) for u, t in zip(a, b, strict=True))

    pairs = zip(outs["pallas"][1], outs["xla"][1], strict=True)
    same = {
        o: equal(jax.tree.leaves(outs[o]), jax.tree.leaves(outs["serial_pallas"]))
        for o in ap.ORDERS
    }
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    flops = 2 * prod.M * prod.C * prod.F
    saved = ms["serial"] - ms["interleaved"]
    return {
        "label": FLAGS.label,
        "slots": FLAGS.slots,
        "S": S,
        "layers": FLAGS.layers,
        **dataclasses.asdict(prod),
        "blocks": blocks.label(),
        "product_blocks": dataclasses.asdict(pblocks),
        "launch_stages": FLAGS.num_stages or ap.LAUNCH_STAGES,
        **{f"{name}_ms": round(t, 4) for name, t in ms.items()},
        "attention_tbps": round((k.nbytes + v.nbytes) / ms["attention"] / 1e9, 3),
        **{f"{n}_tflops": round(flops / ms[n] / 1e9, 2) for n in ("xla", "pallas")},
        "hidden": round(saved / min(ms["attention"], ms["xla"]), 3),
        "saving_ms": round(saved * prod.per_beat, 3),
        **{f"same_{o}": same[o] for o in ap.ORDERS},
        "vs_xla_max_abs": err,
    }


def main(argv):
    del argv
    cfg = config_lib.tiny() if FLAGS.tiny else config_lib.voicechat_11b()
    blocks = MHABlocks.parse(FLAGS.blocks) if FLAGS.blocks else default_blocks(jnp.float32)
    pblocks = ap.ProductBlocks(FLAGS.block_m, FLAGS.block_f, FLAGS.block_k)
    chosen = products(cfg, FLAGS.slots)
    if FLAGS.products:
        unknown = set(FLAGS.products) - {p.name for p in chosen}
        if unknown:
            raise app.UsageError(f"unknown products {sorted(unknown)}")
        chosen = [p for p in chosen if p.name in FLAGS.products]
    log = harness.RowLog(FLAGS.out)
    rows = []
    # the largest first: a run cut short by the device time keeps the products that matter most
    for prod in sorted(chosen, key=lambda p: -p.M * p.C * p.F):
        if prod.C % pblocks.block_k or prod.F % pblocks.block_f:
            continue  # does not tile (none of the 11B shapes with the default tiles)
        rows.append(log.write(measure(cfg, prod, blocks, pblocks)))
    print(
        "| product | M x C x F | attention ms (TB/s) | XLA ms (TFLOP/s) | Pallas ms (TFLOP/s) "
        "| serial ms | interleaved ms (hidden) | blocked ms | same | a beat | saving ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['name']} | {r['M']} x {r['C']} x {r['F']} | {r['attention_ms']:.3f} "
            f"({r['attention_tbps']:.2f}) | {r['xla_ms']:.3f} ({r['xla_tflops']:.1f}) | "
            f"{r['pallas_ms']:.3f} ({r['pallas_tflops']:.1f}) | {r['serial_ms']:.3f} | "
            f"{r['interleaved_ms']:.3f} ({r['hidden']:.2f}) | {r['blocked_ms']:.3f} | "
            f"{r['same_interleaved'] and r['same_blocked']} | {r['per_beat']} | "
            f"{r['saving_ms']:.2f} |"
        )
    codec = sum(r["saving_ms"] for r in rows if r["name"].startswith("codec"))
    tts = sum(r["saving_ms"] for r in rows if r["name"].startswith("tts"))
    print(f"estimated saving a beat (per-layer rows x counts): codec first frame {codec:.2f} ms "
          f"(a frame behind, both frames: {2 * codec:.2f} ms), speech decoder half-rows "
          f"{tts:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    app.run(main)
