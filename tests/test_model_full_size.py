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
