"""The NeMo reference fixture (``tests.reference.nemo_ref``) against NeMo's own loops and layout."""

from __future__ import annotations

import collections
import json
import re

import numpy as np
import pytest
import torch

from tests.reference import nemo_ref
from voicechat_jax.config import EOS_ID, PAD_ID
from voicechat_jax.release_config import config_from_release


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture(scope="module")
def full_shapes():
    return nemo_ref.nemo_full_size_key_shapes()


@pytest.fixture(scope="module")
def offline(nemo_tiny, test_audio):
    return nemo_ref.nemo_offline_inference(nemo_tiny, test_audio)


@pytest.fixture(scope="module")
def perception(nemo_tiny, test_audio):
    return nemo_ref.nemo_offline_perception(nemo_tiny, test_audio)


@pytest.fixture(scope="module")
def listened(nemo_tiny, perception):
    return nemo_ref.nemo_listen(nemo_tiny, perception)


def test_full_size_layout(full_shapes):
    """NeMo 3.0's 1,616 tensors + function_head + 15 RNNT tensors (docs/model.md §4)."""
    assert len(full_shapes) == 1632
    census = collections.Counter(".".join(k.split(".")[:2]) for k in full_shapes)
    assert census["stt_model.perception"] == 640
    assert census["stt_model.llm"] == 339
    assert census["stt_model.rnnt_decoder"] == 9
    assert census["stt_model.rnnt_joint"] == 6
    assert census["tts_model.tts_model"] == 418
    assert census["tts_model.audio_codec"] == 214
    expected = {
        "stt_model.embed_tokens.weight": (131072, 4480),
        "stt_model.lm_head.weight": (131072, 4480),
        "stt_model.function_head.weight": (131072, 4480),
        "stt_model.llm.layers.0.mixer.in_proj.weight": (22656, 4480),
        "stt_model.llm.layers.0.mixer.conv1d.weight": (12288, 1, 4),
        "stt_model.llm.layers.0.mixer.out_proj.weight": (4480, 10240),
        "stt_model.llm.layers.14.mixer.q_proj.weight": (5120, 4480),
        "stt_model.llm.layers.14.mixer.k_proj.weight": (1024, 4480),
        "stt_model.llm.layers.1.mixer.up_proj.weight": (15680, 4480),
        "stt_model.perception.encoder.pre_encode.out.weight": (1024, 4352),
        "stt_model.perception.encoder.layers.23.self_attn.pos_bias_u": (8, 128),
        "stt_model.perception.encoder.layers.0.conv.depthwise_conv.weight": (1024, 1, 9),
        "stt_model.perception.proj.weight": (4480, 1024),
        "stt_model.perception.preprocessor.featurizer.fb": (1, 128, 257),
        "stt_model.rnnt_decoder.prediction.dec_rnn.lstm.weight_ih_l0": (2560, 640),
        "stt_model.rnnt_joint.joint_net.2.weight": (1025, 640),
        "tts_model.tts_model.backbone.layers.27.self_attn.q_norm.weight": (72,),
        "tts_model.tts_model.mog_head.proj_mus.weight": (65536, 1152),
        "tts_model.tts_model.mog_head.low_mat": (1024, 512, 64),
        "tts_model.tts_model.rvq_embs": (31, 1024, 512),
        "tts_model.tts_model.embed_subword.embed_tokens.weight": (257, 1152),
        "tts_model.tts_model.embed_subword.subword_flag_emb.is_continuation": (131073,),
        "tts_model.tts_model.embed_subword.bos_eos_emb.special_flags": (131072,),
        "tts_model.tts_model.gated_fusion_audio_text.residual_scale": (),
        "tts_model.audio_prompt_latents.Aria": (1, 37, 1152),
        "tts_model.codec_silence_tokens": (31,),
        "tts_model._control_codes": (3,),
        "tts_model.audio_codec.decoder.layers.0.weight": (512, 1536, 9),
        "tts_model.audio_codec.prvq.mus_list.30": (1024, 512),
    }
    for key, shape in expected.items():
        assert full_shapes[key] == shape, key


def _kinds(names) -> set[str]:
    return {re.sub(r"\.\d+(?=\.|$)", ".N", n) for n in names}


def test_tiny_model_has_the_release_layout(nemo_tiny, full_shapes):
    """Up to layer indices, the tiny model's tensors are named as the release's."""
    sd = nemo_ref.release_state_dict(nemo_tiny)
    assert _kinds(sd) == _kinds(full_shapes)
    ints = sorted(k for k, v in sd.items() if v.dtype == np.int64)
    assert len(ints) == 6, ints  # docs/model.md §4: "fp32 plus 6 int64 buffers"
    assert all(v.dtype in (np.float32, np.int64) for v in sd.values())


def test_weights_are_not_trivial(nemo_tiny):
    sd = nemo_ref.release_state_dict(nemo_tiny)
    for name, v in sd.items():
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            assert np.std(v) > 0.03, name
        if name.endswith(".bias") and v.size > 1:
            assert np.max(np.abs(v)) > 0, name


def test_runners_reproduce_nemo_offline_inference(nemo_tiny, offline, perception):
    """Whole-clip perception -> nemo_listen (no function channel) -> nemo_speak == NeMo's loop."""
    listened = nemo_ref.nemo_listen(nemo_tiny, perception, function_channel=False)
    np.testing.assert_array_equal(listened["text"], offline["text"])
    spoken = nemo_ref.nemo_speak(nemo_tiny, listened["text"])
    np.testing.assert_array_equal(spoken["codes"], offline["codes"])
    assert rel_err(spoken["wav"], offline["wav"]) <= 1e-6
    # frame 0: EarTTS skipped, codes stay 0
    assert np.all(spoken["codes"][0] == 0)
    spf = nemo_tiny.tts_model.audio_codec.config.wav_to_token_ratio
    assert spoken["wav"].shape == (len(listened["text"]) * spf,)


def test_system_prompt_matches_nemo(nemo_tiny, test_audio, perception):
    prompt = [1, 300, 301, 302, EOS_ID]
    ref = nemo_ref.nemo_offline_inference(nemo_tiny, test_audio, system_prompt_ids=prompt)
    ours = nemo_ref.nemo_listen(nemo_tiny, perception, prompt, function_channel=False)
    np.testing.assert_array_equal(ours["text"], ref["text"])
    # NeMo's EarTTS runs over the prompt positions too, with PAD text
    spoken = nemo_ref.nemo_speak(nemo_tiny, np.concatenate([[PAD_ID] * len(prompt), ours["text"]]))
    np.testing.assert_array_equal(spoken["codes"], ref["codes"])
    assert rel_err(spoken["wav"], ref["wav"]) <= 1e-6


def test_token_choices_vary_over_frames(listened, offline):
    T = len(listened["text"])
    assert T == 26
    assert len(set(listened["text"].tolist())) >= T // 3
    assert len(set(listened["function"].tolist())) >= T // 3
    assert len({tuple(c) for c in offline["codes"][1:]}) >= T // 3


def test_listen_loop_equals_one_teacher_forced_pass(nemo_tiny, perception, listened):
    """Frame by frame with feedback == one causal pass over the fed-back inputs."""
    stt = nemo_tiny.stt_model
    text = torch.as_tensor(np.concatenate([[PAD_ID], listened["text"][:-1]]))
    func = torch.as_tensor(np.concatenate([[PAD_ID], listened["function"][:-1]]))
    with torch.no_grad():
        x = torch.as_tensor(perception)
        x = x + stt.embed_tokens(text) + 2.0 * stt.embed_tokens(func)
        h = stt.llm(inputs_embeds=x[None], use_cache=False, return_dict=True)
        h = h["last_hidden_state"][0]
        text_next = stt.lm_head(h).argmax(-1).numpy()
        func_next = stt.function_head(h).argmax(-1).numpy()
    assert rel_err(listened["hidden"], h.numpy()) <= 1e-5
    np.testing.assert_array_equal(text_next, listened["text"])
    np.testing.assert_array_equal(func_next, listened["function"])


def test_streaming_perception_near_offline(nemo_tiny, test_audio, perception):
    """docs/model.md §8: streaming differs by ~1e-2 early (zero log-mel cache), less later."""
    streamed = nemo_ref.nemo_streaming_perception(nemo_tiny, test_audio)
    assert streamed.shape == perception.shape
    assert rel_err(streamed[0], perception[0]) <= 1e-5
    assert rel_err(streamed, perception) <= 5e-2
    assert rel_err(streamed[-4:], perception[-4:]) <= 5e-3


def test_eos_forces_silence_on_the_same_step(nemo_tiny, listened):
    """NeMo 3.0: text_t == EOS replaces step t's *previous* codes with codec_silence_tokens."""
    text = listened["text"].copy()
    text[text == EOS_ID] = PAD_ID
    base = nemo_ref.nemo_speak(nemo_tiny, text)
    k = 6
    text[k] = EOS_ID
    eos = nemo_ref.nemo_speak(nemo_tiny, text)
    np.testing.assert_array_equal(eos["codes"][:k], base["codes"][:k])
    assert not np.array_equal(eos["codes"][k], base["codes"][k])
    # the same step with the silence frame as previous codes and EOS as text, run through NeMo
    tts = nemo_tiny.tts_model
    gen = nemo_ref.deterministic_generation_config(nemo_tiny)
    with torch.no_grad():
        tts.set_init_inputs(speaker_name="Aria")
        init = tts.get_init_inputs(B=1)
        init.update({"use_cache": True, "past_key_values": None, "guidance_enabled": True})
        cache = tts.tts_model(**init).past_key_values
        code = init["code"][:, -1:]
        ids = torch.as_tensor(text)[None]
        for t in range(1, k + 1):
            prev_codes = code
            if t == k:
                prev_codes = tts.codec_silence_tokens.view(1, 1, -1)
            out = tts.tts_model(
                code=prev_codes,
                subword_ids=ids[:, t : t + 1],
                subword_mask=torch.ones(1, 1, dtype=torch.bool),
                past_key_values=cache,
                use_cache=True,
                guidance_enabled=True,
                generation_config=gen,
                ignore_eos_flag_stop=True,
            )
            code, cache = out["codes"], out["past_key_values"]
    np.testing.assert_array_equal(code[0, 0].numpy(), eos["codes"][k])


def test_save_release_round_trip(nemo_tiny, tiny_cfg, tmp_path):
    from safetensors.numpy import load_file

    nemo_ref.save_release(nemo_tiny, tiny_cfg, tmp_path)
    release = json.loads((tmp_path / "config.json").read_text())
    llm_dir = release["model"]["stt"]["model"]["pretrained_llm"]
    assert "Nemotron" in llm_dir
    with open(f"{llm_dir}/config.json") as f:
        llm = json.load(f)
    assert config_from_release(release, llm) == tiny_cfg
    tensors = load_file(str(tmp_path / "model.safetensors"))
    sd = nemo_ref.release_state_dict(nemo_tiny)
    assert sorted(tensors) == sorted(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(tensors[k], v, err_msg=k)
