"""The 11B preset at full size, allocating nothing: parameter counts and the whole key table.

The release's 1,632 names and shapes come from NeMo's ``NemotronVoiceChat`` built with the release
configuration on the meta device, plus the function head and the RNNT head NeMo 3.0 lacks
(``tests.reference.nemo_ref.nemo_full_size_key_shapes``).
"""

from __future__ import annotations

import pytest

from tests.reference import nemo_ref
from voicechat_jax.config import voicechat_11b
from voicechat_jax.keys import fill
from voicechat_jax.keys.table import release_table
from voicechat_jax.model import voicechat
from voicechat_jax.model.common import count_params
from voicechat_jax.precision import Precision

CFG = voicechat_11b()


@pytest.fixture(scope="module")
def abstract():
    return voicechat.abstract(CFG, Precision.reference(), text_table=False)


def test_release_parameter_counts(abstract):
    """The release's counts (docs/model.md §1): perception 614 M, LLM backbone 7,714 M, three
    [131072, 4480] matrices, speech decoder 797 M, codec ~200 M."""
    llm = abstract.llm
    matrices = [llm.embed, llm.lm_head, llm.function_head]
    assert [m.shape for m in matrices] == [(131072, 4480), (4480, 131072), (4480, 131072)]
    backbone = count_params(llm) - sum(m.size for m in matrices)
    assert backbone == 7_713_822_208
    assert round(count_params(abstract.encoder) / 1e6) == 614
    assert round(count_params(abstract.rnnt) / 1e6, 2) == 8.94
    # The speech decoder (tts_model.tts_model) is 797 M with its int buffers and the projection
    # matrix the port drops (audio_prompt_projection_W, [1152, 1152]).
    tts = count_params(
        abstract.tts.replace(silence_codes=None, control_codes=None, prompt_latents=None)
    )
    assert tts + 1152 * 1152 == 797_244_612
    # The codec without the 31 training-only variance scalars.
    assert count_params(abstract.codec) == 199_943_936


def test_every_release_key_is_consumed_once_with_its_shape(abstract):
    shapes = nemo_ref.nemo_full_size_key_shapes()
    assert len(shapes) == 1632
    table = release_table(CFG)
    assert len(table) == 1632
    assert {r.release for r in table} == set(shapes)
    fill(abstract, table, shapes, shapes_only=True)


@pytest.mark.parametrize(
    ("policy", "gb"), [("reference", 1.121), ("bf16_tts_kv_tf32x3_codec", 0.725)]
)
def test_frame_step_bytes_at_the_cap(policy, gb):
    """A slot's bytes per frame-step at the 1,500-frame cap (``engine.frame_step_bytes``): the
    docs/serving.md §3 arithmetic (141.6 MB of SSM state read and written; 16,384 B of LLM KV and
    516,096 B of speech-decoder KV a frame, half that in bf16; the encoder's and codec's states,
    the encoder's attention caches a ring of 78 rows since 2026-12-05: 1.120 and 0.723 GB
    before), from the template's own shapes."""
    import jax

    from voicechat_jax.config import ServeConfig
    from voicechat_jax.engine import byte_floor_ms, frame_step_bytes, template_fn
    from voicechat_jax.precision import policy as policy_of

    precision = policy_of(policy)
    serve = ServeConfig(precision=precision, context_frames=1500)
    params = voicechat.abstract(CFG, precision)
    template = jax.eval_shape(template_fn(CFG, serve), params)
    step = frame_step_bytes(template)
    assert step / 1e9 == pytest.approx(gb, abs=5e-4)
    tts_kv = 516_096 * 1500 // (1 if policy == "reference" else 2)
    assert step > 2 * 141_557_760 + 16_384 * 1500 + tts_kv
    # The floor of a 96-slot beat: two frame-steps of the 26.03 GB of parameters and 96 slots
    # at 3.7 TB/s.
    floor = byte_floor_ms(params, template, 96)
    assert floor == pytest.approx(2 * (26.03 + 96 * gb) / 3.7, rel=1e-3)
