"""voicechat-convert and converted checkpoints: the release -> orbax -> the server, strictly.

- A tiny random ``NemotronVoiceChat`` made by NeMo (``tests.reference.nemo_ref``), saved in the
  release layout, converted, restored and served with ``voicechat-serve`` (offline clock,
  deterministic speech sampling): every served frame equals NeMo's own per-frame outputs.
- The converter's plan over the real release's 1,632 names and shapes (NeMo on the meta device)
  written as a header-only sparse ``model.safetensors``: every key consumed once.
- Every bad input of the issue: a clear message naming the tensors, and nothing at ``--dst``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import tempfile

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests import shared
from tests.reference import nemo_ref
from voicechat_jax import checkpoint as ckpt
from voicechat_jax import convert as conv
from voicechat_jax.cli import convert as convert_cli
from voicechat_jax.cli import serve as serve_cli
from voicechat_jax.config import voicechat_11b
from voicechat_jax.keys import KeyRule, load_params
from voicechat_jax.keys.table import release_table
from voicechat_jax.model import char_encoder, voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.release_config import config_to_release
from voicechat_jax.serving import audio as audio_lib

F32 = Precision.fp32()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_FRAMES = 24  # served: 12 beats of 2 frames
SPF = 1280


def _leaves(tree) -> dict[str, np.ndarray]:
    return dict(
        zip(ckpt.leaf_paths(tree), map(np.asarray, jax.tree_util.tree_leaves(tree)), strict=True)
    )


@pytest.fixture(scope="module")
def release(nemo_tiny, tiny_cfg, tmp_path_factory):
    """The tiny release directory, its LLM config.json and its text tokenizer."""
    root = tmp_path_factory.mktemp("release")
    nemo_ref.save_release(nemo_tiny, tiny_cfg, root / "release")
    llm_dir = nemo_tiny.release_cfg["model"]["stt"]["model"]["pretrained_llm"]
    return {
        "dir": root / "release",
        "llm_config": os.path.join(llm_dir, "config.json"),
        "tokenizer": os.path.join(llm_dir, "tokenizer.json"),
    }


@pytest.fixture(scope="module")
def converted(release, tmp_path_factory):
    """The tiny release converted in fp32, with its tokenizer (text table precomputed)."""
    dst = tmp_path_factory.mktemp("ck") / "tiny"
    result = conv.convert(
        release["dir"],
        dst,
        llm_config=release["llm_config"],
        tokenizer=release["tokenizer"],
        precision=F32,
        revision="test-revision",
    )
    return dst, result


@pytest.fixture(scope="module")
def reference_params(nemo_tiny, tiny_cfg, release):
    """What the parity tests load: NeMo's state dict through the key table, in fp32."""
    chars = char_encoder.char_table(release["tokenizer"])
    return load_params(tiny_cfg, nemo_ref.release_state_dict(nemo_tiny), F32, chars)


def test_restored_params_equal_the_key_table_load(converted, reference_params, tiny_cfg):
    dst, _ = converted
    cfg, params, decode = ckpt.restore(dst, F32)
    assert cfg == tiny_cfg
    ours, ref = _leaves(params), _leaves(reference_params)
    assert sorted(ours) == sorted(ref)
    for path, want in ref.items():
        assert ours[path].dtype == want.dtype, path
        np.testing.assert_array_equal(ours[path], want, err_msg=path)
    device = jax.devices()[0]
    assert all(x.devices() == {device} for x in jax.tree_util.tree_leaves(params))
    assert decode is not None
    assert decode(np.array([1, 30, 31, 12, 2])) == decode(np.array([30, 31]))  # specials dropped


def test_reference_precision_casts_each_leaf_to_its_policy(release, nemo_tiny, tiny_cfg, tmp_path):
    """LLM in bf16, A_log/D/dt_bias and everything else fp32, int buffers int32: the abstract."""
    ref_precision = Precision.reference()
    dst = tmp_path / "ck"
    conv.convert(
        release["dir"],
        dst,
        llm_config=release["llm_config"],
        tokenizer=release["tokenizer"],
        precision=ref_precision,
        # split leaves: the text table is precomputed from the pieces too
        shard_bytes=shared.SMALL_SHARDS,
    )
    _, params, _ = ckpt.restore(dst, ref_precision)
    chars = char_encoder.char_table(release["tokenizer"])
    want = load_params(tiny_cfg, nemo_ref.release_state_dict(nemo_tiny), ref_precision, chars)
    ours, ref = _leaves(params), _leaves(want)
    tree = voicechat.abstract(tiny_cfg, ref_precision)
    abstract = dict(zip(ckpt.leaf_paths(tree), jax.tree_util.tree_leaves(tree), strict=True))
    for path, x in ref.items():
        assert ours[path].dtype == x.dtype == abstract[path].dtype, path
        np.testing.assert_array_equal(ours[path], x, err_msg=path)
    kinds = {p: str(x.dtype) for p, x in ours.items()}
    assert kinds["llm.mamba.in_proj"] == kinds["llm.embed"] == kinds["llm.lm_head"] == "bfloat16"
    assert kinds["llm.mamba.A_log"] == kinds["llm.mamba.dt_bias"] == "float32"
    assert kinds["tts.control_codes"] == kinds["tts.char_encoder.is_continuation"] == "int32"
    assert kinds["encoder.proj"] == kinds["tts.text_table"] == "float32"


def test_split_shards_without_tokenizer(release, converted, tmp_path):
    """Tiny shards split every stacked leaf into pieces; without a tokenizer the text table is
    computed at load (from the release LLM's tokenizer) and equals the precomputed one."""
    dst = tmp_path / "ck"
    result = conv.convert(
        release["dir"],
        dst,
        llm_config=release["llm_config"],
        precision=F32,
        shard_bytes=shared.SMALL_SHARDS,
    )
    index = json.loads((dst / "params" / "index.json").read_text())
    assert ckpt.TEXT_TABLE not in index["leaves"]
    assert ckpt.CHAR_TABLE not in index["leaves"]
    assert result.manifest["text_table"].startswith("at load")
    pieces = {p: len(v["pieces"]) for p, v in index["leaves"].items()}
    assert pieces["llm.mamba.in_proj"] == 2
    assert pieces["tts.backbone.q"] == 4
    assert len(os.listdir(dst / "params")) > 50
    _, split, _ = ckpt.restore(dst, F32)
    _, whole, _ = ckpt.restore(converted[0], F32)
    a, b = _leaves(split), _leaves(whole)
    assert sorted(a) == sorted(b)
    for path in b:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)
    # no tokenizer anywhere (an LLM id that is not in the local Hugging Face cache)
    manifest = json.loads((dst / "manifest.json").read_text())
    (dst / "manifest.json").write_text(json.dumps({**manifest, "pretrained_llm": "nvidia/absent"}))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest\.json: size differs"):
        ckpt.restore(dst, F32)
    ckpt.write_integrity(str(dst))  # the edit, signed: restore gets past the digests
    with pytest.raises(ckpt.CheckpointError, match="no text table and no tokenizer was found"):
        ckpt.restore(dst, F32)
    _, given, _ = ckpt.restore(dst, F32, tokenizer=release["tokenizer"])
    np.testing.assert_array_equal(given.tts.text_table, whole.tts.text_table)


def test_manifest_and_config(converted, release, tiny_cfg):
    dst, result = converted
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest == json.loads(json.dumps(result.manifest))
    src = release["dir"] / "model.safetensors"
    assert manifest["source"]["bytes"] == os.path.getsize(src)
    assert manifest["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert manifest["source"]["revision"] == "test-revision"
    tensors = load_file(str(src))
    listed = {t["name"]: t for t in manifest["tensors"]}
    assert sorted(listed) == sorted(tensors)
    for name, x in tensors.items():
        assert tuple(listed[name]["shape"]) == x.shape, name
        assert listed[name]["dtype"] == {"float32": "F32", "int64": "I64"}[x.dtype.name], name
    dropped = sorted(n for n, t in listed.items() if t["param"] is None)
    assert dropped == sorted(r.release for r in release_table(tiny_cfg) if r.param is None)
    assert manifest["text_table"] == "precomputed"
    assert ckpt.config_from_json(json.loads((dst / "model_config.json").read_text())) == tiny_cfg
    full = voicechat_11b()
    assert ckpt.config_from_json(json.loads(json.dumps(ckpt.config_to_json(full)))) == full
    with pytest.raises(ckpt.CheckpointError, match=r"unknown keys \['extra'\]"):
        ckpt.config_from_json({**ckpt.config_to_json(full), "extra": 1})


def test_dry_run_lists_every_tensor_and_writes_nothing(release, tmp_path):
    dst = tmp_path / "never"
    args = [f"--src={release['dir']}", f"--llm_config={release['llm_config']}", "--dry_run"]
    out = shared.run_cli(convert_cli, *args, f"--dst={dst}")
    assert out.returncode == 0, out.stderr
    names = load_file(str(release["dir"] / "model.safetensors"))
    mapped = re.findall(r"^  (\S+) [FI]\d+\[[\d, ]*\] -> ", out.stdout, re.M)
    assert sorted(mapped) == sorted(names)
    assert "would write" in out.stdout
    assert not dst.exists()


def _header_only_release(directory, shapes: dict[str, tuple[int, ...]], release_cfg: dict) -> int:
    """A release whose model.safetensors has a real header and sparse (unwritten) data."""
    ints = ("pad_tensor", "is_continuation", "special_flags", "_control_codes", "silence_tokens")
    header, offset = {}, 0
    for name, shape in shapes.items():
        dtype, size = ("I64", 8) if name.endswith(ints) else ("F32", 4)
        n = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(release_cfg, f)
    return offset


@pytest.fixture(scope="module")
def full_shapes() -> dict[str, tuple[int, ...]]:
    return nemo_ref.nemo_full_size_key_shapes()


def test_full_size_plan_consumes_every_release_key_once(full_shapes, tmp_path):
    """The release's 1,632 names and shapes (NeMo on the meta device), read from a header-only
    file by the converter: each key mapped once with its shape, every parameter filled, and no
    shard larger than the biggest single leaf (host memory bound)."""
    shapes = full_shapes
    assert len(shapes) == 1632
    data = _header_only_release(tmp_path / "release", shapes, config_to_release(voicechat_11b())[0])
    release = conv.Release(str(tmp_path / "release" / "model.safetensors"))
    cfg, _, _ = conv.read_config(str(tmp_path / "release"), None)
    assert cfg == voicechat_11b()
    plan = conv.make_plan(cfg, Precision.reference(), release)
    assert sorted(r.release for r in plan.rules) == sorted(shapes)
    listing = plan.listing()
    assert len(re.findall(r"^  \S+ [FI]\d+\[[\d, ]*\] -> ", listing, re.M)) == 1632
    assert plan.read_bytes <= data
    # spec §4: 44,382,749,892 bytes in all; the rest is the header
    assert 0 < 44_382_749_892 - 8 - data < 400_000
    written = sum(e.nbytes for s in plan.shards for e in s)
    assert written == sum(math.prod(t.shape) * t.dtype.itemsize for t in plan.leaves.values())
    biggest_leaf = max(math.prod(t.shape) * t.dtype.itemsize for t in plan.leaves.values())
    in_proj = [e for s in plan.shards for e in s if e.path == "llm.mamba.in_proj"]
    assert len(in_proj) == 6
    assert sum(e.stop - e.start for e in in_proj) == 27
    for shard in plan.shards:
        assert sum(e.nbytes for e in shard) <= max(conv.SHARD_BYTES, biggest_leaf)


def test_full_size_llm_that_is_not_the_built_in_one(full_shapes, tmp_path):
    """Without --llm_config the built-in 9B sizes must match the tensors; the message says so."""
    shapes = dict(full_shapes)
    shapes["stt_model.llm.layers.1.mixer.up_proj.weight"] = (15680 + 64, 4480)
    _header_only_release(tmp_path / "release", shapes, config_to_release(voicechat_11b())[0])
    with pytest.raises(
        conv.ConversionError, match=r"pass --llm_config\): .*up_proj\.weight: shape"
    ):
        conv.convert(tmp_path / "release", None, dry_run=True)


# ---------------------------------------------------------------------------------------------
# bad inputs


@pytest.fixture(scope="module")
def tensors(release):
    return load_file(str(release["dir"] / "model.safetensors"))


def _variant(release, root, tensors=None, config=None):
    """A copy of the tiny release with other tensors or another config.json."""
    d = root / "bad_release"
    d.mkdir()
    cfg = config or json.loads((release["dir"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(d / "model.safetensors"))
    else:
        (d / "model.safetensors").write_bytes((release["dir"] / "model.safetensors").read_bytes())
    return d


def _expect_failure(src, root, pattern, **kwargs):
    out = tempfile.mkdtemp(dir=root)
    kwargs.setdefault("precision", F32)
    with pytest.raises(conv.ConversionError, match=pattern) as err:
        conv.convert(src, os.path.join(out, "ck"), **kwargs)
    assert os.listdir(out) == [], "a failed conversion left files behind"
    return str(err.value)


def _edit(tensors, **changes):
    out = dict(tensors)
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            del out[name]
        else:
            out[name] = value
    return out


LM_HEAD = "stt_model.lm_head.weight"
EMBED = "stt_model.embed_tokens.weight"
IN_PROJ0 = "stt_model.llm.layers.0.mixer.in_proj.weight"


def _bad_tensors(t: dict[str, np.ndarray]) -> dict[str, tuple[dict, str]]:
    nan, inf = t[LM_HEAD].copy(), t[IN_PROJ0].copy()
    nan[3, 5], inf[0, 0] = np.nan, -np.inf
    control = "tts_model._control_codes"
    return {
        "unmapped key": (
            {**t, "stt_model.llm.layers.0.mixer.extra.weight": t[LM_HEAD][:2]},
            r"1 source keys map nowhere: \['stt_model\.llm\.layers\.0\.mixer\.extra\.weight'\]",
        ),
        "missing key (parameter never filled)": (
            {k: v for k, v in t.items() if k != "stt_model.llm.norm_f.weight"},
            r"1 keys the model needs are missing: \['stt_model\.llm\.norm_f\.weight'\]",
        ),
        "shape": (
            {**t, "stt_model.perception.proj.weight": t["stt_model.perception.proj.weight"].T},
            r"stt_model\.perception\.proj\.weight: shape \(\d+, \d+\) != expected",
        ),
        "nan and inf": (
            {**t, LM_HEAD: nan, IN_PROJ0: inf},
            r"2 tensors hold NaN or Inf: \['stt_model\.lm_head\.weight', "
            r"'stt_model\.llm\.layers\.0\.mixer\.in_proj\.weight'\]",
        ),
        "all zeros": (
            {**t, EMBED: np.zeros_like(t[EMBED]), IN_PROJ0: np.zeros_like(t[IN_PROJ0])},
            r"2 tensors are all zeros: \['stt_model\.embed_tokens\.weight', "
            r"'stt_model\.llm\.layers\.0\.mixer\.in_proj\.weight'\].*known-good revision",
        ),
        "float for an int buffer": (
            {**t, control: t[control].astype(np.float32)},
            r"wrong kind.*tts_model\._control_codes \(F32 -> tts\.control_codes\)",
        ),
        "int overflow": (
            {**t, control: t[control] + (1 << 40)},
            r"overflow int32: \['tts_model\._control_codes'\]",
        ),
    }


BAD_TENSOR_CASES = (
    "unmapped key",
    "missing key (parameter never filled)",
    "shape",
    "nan and inf",
    "all zeros",
    "float for an int buffer",
    "int overflow",
)


@pytest.mark.parametrize("case", BAD_TENSOR_CASES)
def test_bad_tensors_fail_naming_them(case, release, tensors, tmp_path):
    bad, pattern = _bad_tensors(tensors)[case]
    src = _variant(release, tmp_path, tensors=bad)
    _expect_failure(src, tmp_path, pattern, llm_config=release["llm_config"])


@pytest.mark.parametrize("how", ["truncated", "corrupt header"])
def test_truncated_or_corrupt_file(how, release, tmp_path):
    src = _variant(release, tmp_path)
    path = src / "model.safetensors"
    blob = path.read_bytes()
    if how == "truncated":
        path.write_bytes(blob[: len(blob) - 1000])
    else:
        path.write_bytes(blob[:8] + b"!" * 40 + blob[48:])
    msg = _expect_failure(src, tmp_path, "truncated or corrupt", llm_config=release["llm_config"])
    assert str(path) in msg


def test_config_that_contradicts_the_tensors(release, tmp_path):
    """The config says 3 encoder layers, the tensors hold 2."""
    cfg = json.loads((release["dir"] / "config.json").read_text())
    cfg["model"]["stt"]["model"]["perception"]["encoder"]["n_layers"] = 3
    src = _variant(release, tmp_path, config=cfg)
    _expect_failure(
        src,
        tmp_path,
        r"the tensors contradict the config: \d+ keys the model needs are missing: "
        r"\['stt_model\.perception\.encoder\.layers\.2\.",
        llm_config=release["llm_config"],
    )


def test_llm_config_that_contradicts_the_tensors(release, tmp_path):
    with open(release["llm_config"]) as f:
        llm = json.load(f)
    llm["intermediate_size"] += 8
    (tmp_path / "llm.json").write_text(json.dumps(llm))
    src = _variant(release, tmp_path)
    _expect_failure(
        src,
        tmp_path,
        r"stt_model\.llm\.layers\.1\.mixer\.up_proj\.weight: shape",
        llm_config=tmp_path / "llm.json",
    )


def test_unreadable_config(release, tmp_path):
    src = _variant(release, tmp_path)
    (src / "config.json").write_text("{not json")
    _expect_failure(src, tmp_path, r"config\.json is not valid JSON")
    (src / "config.json").write_text("{}")
    _expect_failure(src, tmp_path, r"config\.json: release config\.json lacks 'data\.frame_length'")


def _table_filling_twice(cfg) -> list[KeyRule]:
    """Layer 2's norm lands on layer 0's slot of the same stacked parameter."""
    rules = release_table(cfg)
    i = next(k for k, r in enumerate(rules) if r.release == "stt_model.llm.layers.2.norm.weight")
    j = next(k for k, r in enumerate(rules) if r.release == "stt_model.llm.layers.0.norm.weight")
    rules[i] = KeyRule(rules[i].release, rules[j].param, rules[j].index)
    return rules


def _table_dropping(name: str):
    def table(cfg) -> list[KeyRule]:
        return [KeyRule(r.release, None) if r.release == name else r for r in release_table(cfg)]

    return table


@pytest.mark.parametrize(
    ("table", "pattern"),
    [
        (
            _table_filling_twice,
            r"stt_model\.llm\.layers\.2\.norm\.weight: slot llm\.mamba\.norm\[0\] filled twice",
        ),
        (
            _table_dropping("stt_model.llm.layers.3.norm.weight"),
            r"llm\.mamba\.norm: slots \[\(1,\)\] never filled",
        ),
        (
            _table_dropping("stt_model.llm.norm_f.weight"),
            r"1 parameters have no rule: \['llm\.norm_f'\]",
        ),
    ],
    ids=["filled twice", "slot never filled", "parameter never filled"],
)
def test_broken_key_table_is_caught(table, pattern, release, tmp_path):
    _expect_failure(
        release["dir"],
        tmp_path,
        r"contradict.*" + pattern,
        llm_config=release["llm_config"],
        table=table,
    )


def test_existing_destination_is_left_alone(release, tmp_path):
    dst = tmp_path / "ck"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(conv.ConversionError, match="already exists"):
        conv.convert(release["dir"], dst, llm_config=release["llm_config"])
    assert os.listdir(dst) == ["keep.txt"]


def test_cli_exits_non_zero_with_the_message(release, tensors, tmp_path):
    bad, _ = _bad_tensors(tensors)["all zeros"]
    src = _variant(release, tmp_path, tensors=bad)
    dst = tmp_path / "out" / "ck"
    out = shared.run_cli(
        convert_cli,
        f"--src={src}",
        f"--dst={dst}",
        f"--llm_config={release['llm_config']}",
    )
    assert out.returncode == 1
    assert "voicechat-convert:" in out.stderr
    assert "stt_model.embed_tokens.weight" in out.stderr
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------
# served from the converted checkpoint vs NeMo


@pytest.fixture(scope="module")
def clip(test_audio, tmp_path_factory) -> tuple[str, np.ndarray]:
    """The test audio as a 16 kHz WAV, and the samples the server reads back from it."""
    path = str(tmp_path_factory.mktemp("wav") / "in.wav")
    audio_lib.write_wav(path, test_audio, rate=16000)
    return path, audio_lib.read_wav(path)


def test_served_frames_match_nemo(converted, clip, nemo_tiny, tiny_cfg, tmp_path):
    """``voicechat-serve --checkpoint`` (offline clock, deterministic sampling) vs NeMo: text,
    function and codes of every served frame, the RNNT tokens of every frame and the audio."""
    dst, _ = converted
    wav, samples = clip
    out = shared.run_cli(
        serve_cli,
        f"--checkpoint={dst}",
        "--clock=offline",
        "--speech_sampling=deterministic",
        "--precision=fp32",
        "--slots=1",
        "--sessions=1",
        f"--seconds={N_FRAMES * 0.08}",
        f"--input_wav={wav}",
        f"--output_dir={tmp_path}",
        "--context_frames=32",
        "--warmup_ticks=0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (tmp_path / "s000" / "frames.jsonl").read_text().splitlines()
    frames = [json.loads(line) for line in lines]
    assert [f["frame"] for f in frames] == list(range(N_FRAMES))

    x = samples[: N_FRAMES * SPF]
    proj, enc = nemo_ref.nemo_streaming_perception(nemo_tiny, x, return_encoder=True)
    listen = nemo_ref.nemo_listen(nemo_tiny, proj)
    speak = nemo_ref.nemo_speak(nemo_tiny, listen["text"][:N_FRAMES])
    transcript = nemo_ref.nemo_rnnt_frames(nemo_tiny, enc, tiny_cfg.rnnt.max_symbols)
    assert len(set(listen["text"][:N_FRAMES].tolist())) >= 3, "a degenerate reference"

    np.testing.assert_array_equal([f["text"] for f in frames], listen["text"][:N_FRAMES])
    np.testing.assert_array_equal([f["function"] for f in frames], listen["function"][:N_FRAMES])
    np.testing.assert_array_equal([f["codes"] for f in frames], speak["codes"])
    assert [f["transcript"] for f in frames] == transcript[:N_FRAMES]
    served = audio_lib.read_wav(tmp_path / "s000" / "output.wav", expected_rate=22050)
    # streaming decode = NeMo's offline decode delayed by 8 samples (tests/test_pipeline.py);
    # PCM16 output: compare to one quantisation step
    n = served.size - 14
    np.testing.assert_allclose(served[14 : 14 + n], speak["wav"][6 : 6 + n], rtol=0, atol=2e-4)
    assert np.max(np.abs(speak["wav"])) > 1e-2
    assert (tmp_path / "s000" / "transcript.txt").read_text().strip()


def test_text_table_computed_at_load_equals_precomputed(release, converted, tmp_path):
    """``--notext_table``: the checkpoint keeps the tokenizer's char table and ``restore``
    computes the text table from it; it equals the one the converter precomputes."""
    dst = tmp_path / "ck"
    result = conv.convert(
        release["dir"],
        dst,
        llm_config=release["llm_config"],
        tokenizer=release["tokenizer"],
        precision=F32,
        text_table=False,
    )
    assert result.manifest["text_table"] == "at load (from the stored char table)"
    index = json.loads((dst / "params" / "index.json").read_text())
    assert ckpt.CHAR_TABLE in index["leaves"]
    assert ckpt.TEXT_TABLE not in index["leaves"]
    _, computed, decode = ckpt.restore(dst, F32)
    _, stored, _ = ckpt.restore(converted[0], F32)
    np.testing.assert_array_equal(
        np.asarray(computed.tts.text_table), np.asarray(stored.tts.text_table)
    )
    assert decode is not None
