"""The release ``config.json`` reader/writer (``voicechat_jax.release_config``)."""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest

from voicechat_jax.config import tiny, voicechat_11b
from voicechat_jax.release_config import (
    BACKBONE,
    ENC,
    NANO_9B_V2,
    config_from_release,
    config_to_release,
    read_release,
)


def _delete(tree: dict, path: str) -> None:
    *parents, last = path.split(".")
    for p in parents:
        tree = tree[p]
    del tree[last]


def _set(tree: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


@pytest.mark.parametrize("preset", [tiny, voicechat_11b])
def test_round_trip(preset):
    cfg = preset()
    release, llm = config_to_release(cfg, pretrained_llm="test/Tiny-Nemotron-H")
    # through JSON, as the files are: Infinity, tuples -> lists, ints vs floats
    release, llm = json.loads(json.dumps(release)), json.loads(json.dumps(llm))
    assert config_from_release(release, llm) == cfg


def test_11b_without_llm_config_uses_the_known_llm():
    release, _ = config_to_release(voicechat_11b())
    assert release["model"]["stt"]["model"]["pretrained_llm"] == NANO_9B_V2
    assert config_from_release(release) == voicechat_11b()


def test_other_llm_without_its_config_raises():
    release, _ = config_to_release(tiny(), pretrained_llm="test/Tiny-Nemotron-H")
    with pytest.raises(ValueError, match="llm_cfg"):
        config_from_release(release)


@pytest.mark.parametrize(
    "path",
    [
        "model.speech_generation.model.tts_config.backbone_config.num_hidden_layers",
        "model.stt.model.perception.encoder.att_context_size",
        "model.stt.model.duplex_function_channel_weight",
        "_rnnt_merge_info.decoder_config.prednet.pred_hidden",
        "model.speech_generation.model.codec_config.rates",
        "data.frame_length",
    ],
)
def test_missing_needed_key_raises_naming_it(path):
    release, llm = config_to_release(tiny(), pretrained_llm="test/Tiny-Nemotron-H")
    _delete(release, path)
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        config_from_release(release, llm)


def test_missing_llm_key_raises_naming_it():
    release, llm = config_to_release(tiny(), pretrained_llm="test/Tiny-Nemotron-H")
    del llm["mamba_head_dim"]
    with pytest.raises(ValueError, match="mamba_head_dim"):
        config_from_release(release, llm)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (f"{ENC}.conv_norm_type", "batch_norm"),
        (f"{ENC}.att_context_size", [70, 2]),
        ("model.stt.model.perception.preprocessor.normalize", "per_feature"),
        ("model.stt.model.inference_eos_boost", 1.5),
        (f"{BACKBONE}.hidden_activation", "gelu"),
    ],
)
def test_unimplemented_value_raises(path, value):
    release, llm = config_to_release(tiny(), pretrained_llm="test/Tiny-Nemotron-H")
    _set(release, path, value)
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        config_from_release(release, llm)


def test_finite_dt_limit_raises():
    release, llm = config_to_release(tiny(), pretrained_llm="test/Tiny-Nemotron-H")
    llm["time_step_limit"] = [0.001, 0.1]
    with pytest.raises(ValueError, match="time_step_limit"):
        config_from_release(release, llm)


def test_unknown_keys_are_collected_and_logged_once(caplog):
    release, llm = config_to_release(tiny(), pretrained_llm="test/Tiny-Nemotron-H")
    _set(release, "model.stt.model.some_new_knob", 3)
    llm["another_knob"] = True
    _, unused = read_release(release, llm)
    assert "model.stt.model.some_new_knob" in unused
    assert "llm:another_knob" in unused
    # keys the port reads are not reported
    assert f"{ENC}.d_model" not in unused
    with caplog.at_level(logging.INFO, logger="absl"):
        config_from_release(release, llm)
    reports = [r for r in caplog.records if "does not use" in r.getMessage()]
    assert len(reports) == 1
    assert "model.stt.model.some_new_knob" in reports[0].getMessage()


def test_library_defaults_fill_absent_keys():
    """A release backbone_config without Gemma-3's defaults reads like the 11B."""
    release, _ = config_to_release(voicechat_11b())
    for key in (
        "rms_norm_eps",
        "query_pre_attn_scalar",
        "sliding_window_pattern",
        "rope_theta",
        "rope_local_base_freq",
    ):
        _delete(release, f"{BACKBONE}.{key}")
    assert config_from_release(release) == voicechat_11b()


def test_layer_types_list_sets_the_global_layers():
    cfg = voicechat_11b()
    release, _ = config_to_release(cfg)
    _delete(release, f"{BACKBONE}.sliding_window_pattern")
    kinds = ("sliding_attention", "full_attention")
    _set(release, f"{BACKBONE}.layer_types", [kinds[g] for g in cfg.tts.layer_is_global])
    assert config_from_release(release) == cfg
    bad = copy.deepcopy(release)
    bad_types = [kinds[g] for g in cfg.tts.layer_is_global]
    bad_types[0] = "full_attention"
    _set(bad, f"{BACKBONE}.layer_types", bad_types)
    with pytest.raises(ValueError, match="periodic"):
        config_from_release(bad)


@pytest.mark.parametrize("preset", [tiny, voicechat_11b])
def test_transformers_reads_what_we_wrote(preset):
    """The HF configs NeMo builds from ``config_to_release`` have the ModelConfig's structure."""
    from transformers import Gemma3TextConfig, NemotronHConfig, T5GemmaModuleConfig

    cfg = preset()
    release, llm = config_to_release(cfg, pretrained_llm="test/Tiny-Nemotron-H")
    tts = release["model"]["speech_generation"]["model"]["tts_config"]
    gemma = Gemma3TextConfig(**tts["backbone_config"])
    assert [t == "full_attention" for t in gemma.layer_types] == list(cfg.tts.layer_is_global)
    assert gemma.rope_parameters["full_attention"]["rope_theta"] == cfg.tts.rope_global_base
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == cfg.tts.rope_local_base
    assert gemma.sliding_window == cfg.tts.sliding_window
    assert gemma.query_pre_attn_scalar == cfg.tts.query_pre_attn_scalar
    cas = T5GemmaModuleConfig(**tts["cas_config"]["backbone_config"]["encoder"])
    assert cas.attn_logit_softcapping == cfg.tts.cas_softcap
    assert cas.rope_parameters["rope_theta"] == cfg.tts.cas_rope_base
    nemotron = NemotronHConfig(**llm)
    assert nemotron.hybrid_override_pattern == cfg.llm.pattern
    assert nemotron.layer_norm_epsilon == cfg.llm.norm_eps
    assert tuple(nemotron.time_step_limit) == (0.0, math.inf)
