"""Converted checkpoints are verified before they are trusted; conversions clean up and take turns.

- ``integrity.json`` lists every file the conversion wrote with its size and sha256; each kind of
  damage (a shard file deleted, truncated or altered, a digest that differs, the config missing,
  another format version, an empty directory, ...) is one ``CheckpointError`` line naming the file,
  from ``restore`` and ``check`` as from ``voicechat-convert --check``.
- ``voicechat-convert`` stopped by SIGTERM or SIGINT leaves nothing beside ``--dst``; after SIGKILL
  the next conversion to the same ``--dst`` removes the dead one's partial directory.
- A second conversion to a ``--dst`` being converted is refused with one line.

Conversions here are of the tiny model; the CLI ones use 4 KiB shards (~80 of them, a few seconds
of writing) so that a signal surely lands mid-conversion.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
import pytest

from tests import shared
from tests.reference import nemo_ref
from voicechat_jax import checkpoint as ckpt
from voicechat_jax import convert as conv
from voicechat_jax.cli import convert as convert_cli
from voicechat_jax.precision import Precision

F32 = Precision.fp32()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL, SIZES = ckpt.Verify.FULL, ckpt.Verify.SIZES


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "voicechat_jax.cli.convert", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)


def _error_line(stderr: str) -> str:
    """The CLI's one error line; there is exactly one, it is the last, and no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("voicechat-convert:")]
    assert len(lines) == 1, stderr[-3000:]
    assert stderr.rstrip("\n").splitlines()[-1] == lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def release(nemo_tiny, tiny_cfg, tmp_path_factory):
    """The tiny release directory and its LLM's config.json and tokenizer.json."""
    root = tmp_path_factory.mktemp("release")
    nemo_ref.save_release(nemo_tiny, tiny_cfg, root / "release")
    llm_dir = nemo_tiny.release_cfg["model"]["stt"]["model"]["pretrained_llm"]
    return {
        "dir": root / "release",
        "llm_config": os.path.join(llm_dir, "config.json"),
        "tokenizer": os.path.join(llm_dir, "tokenizer.json"),
    }


@pytest.fixture(scope="module")
def converted(release, tmp_path_factory) -> str:
    """The tiny release converted (fp32, with its tokenizer); tests damage copies of it."""
    dst = tmp_path_factory.mktemp("ck") / "tiny"
    conv.convert(
        release["dir"],
        dst,
        llm_config=release["llm_config"],
        tokenizer=release["tokenizer"],
        precision=F32,
    )
    return str(dst)


def _listing(directory: str) -> dict[str, dict]:
    with open(os.path.join(directory, ckpt.INTEGRITY)) as f:
        return json.load(f)["files"]


def test_integrity_lists_every_file_with_its_size_and_sha256(converted):
    listing = _listing(converted)
    on_disk = {
        os.path.relpath(os.path.join(here, name), converted)
        for here, _, names in os.walk(converted)
        for name in names
    }
    assert set(listing) == on_disk - {ckpt.INTEGRITY}
    assert {ckpt.MODEL_CONFIG, ckpt.MANIFEST, ckpt.TOKENIZER, "params/index.json"} <= set(listing)
    orbax = [rel for rel in listing if rel.startswith("params/shard_")]
    assert len({rel.split("/")[1] for rel in orbax}) == 2  # the params, then the tables
    for rel, want in listing.items():
        with open(os.path.join(converted, rel), "rb") as f:
            data = f.read()
        assert want == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    for verify in (FULL, SIZES):
        done = ckpt.check(converted, verify)
        assert (done.files, done.bytes) == (len(listing), sum(f["bytes"] for f in listing.values()))


# ---------------------------------------------------------------------------------------------
# damaged checkpoints


def _biggest_shard_file(d: str) -> str:
    listing = _listing(d)
    rel = max((r for r in listing if "/d/" in r), key=lambda r: listing[r]["bytes"])
    return os.path.join(d, rel)


def _delete_shard_file(d: str) -> str:
    path = _biggest_shard_file(d)
    os.remove(path)
    return path


def _truncate_shard_file(d: str) -> str:
    path = _biggest_shard_file(d)
    os.truncate(path, os.path.getsize(path) // 2)
    return path


def _alter_shard_file(d: str) -> str:
    """Same size, other bytes in the middle: orbax alone restores it without a word."""
    path = _biggest_shard_file(d)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def _edit_json(path: str, edit: Callable[[dict], None]) -> None:
    with open(path) as f:
        tree = json.load(f)
    edit(tree)
    with open(path, "w") as f:
        json.dump(tree, f)


def _differing_digest(d: str) -> str:
    def edit(tree):
        entry = tree["files"][ckpt.MODEL_CONFIG]
        entry["sha256"] = "0" * 64

    _edit_json(os.path.join(d, ckpt.INTEGRITY), edit)
    return os.path.join(d, ckpt.MODEL_CONFIG)


def _delete_config(d: str) -> str:
    os.remove(os.path.join(d, ckpt.MODEL_CONFIG))
    return os.path.join(d, ckpt.MODEL_CONFIG)


def _other_format(d: str) -> str:
    _edit_json(os.path.join(d, ckpt.INTEGRITY), lambda tree: tree.update(format="voicechat_jax/3"))
    return os.path.join(d, ckpt.INTEGRITY)


def _format_1(d: str) -> str:
    """A checkpoint of the first format: no integrity data."""
    os.remove(os.path.join(d, ckpt.INTEGRITY))
    index = os.path.join(d, ckpt.PARAMS, ckpt.INDEX)
    _edit_json(index, lambda tree: tree.update(format="voicechat_jax/1"))
    return d


def _delete_integrity(d: str) -> str:
    os.remove(os.path.join(d, ckpt.INTEGRITY))
    return os.path.join(d, ckpt.INTEGRITY)


def _garble_integrity(d: str) -> str:
    with open(os.path.join(d, ckpt.INTEGRITY), "w") as f:
        f.write('{"format": ')
    return os.path.join(d, ckpt.INTEGRITY)


def _empty(d: str) -> str:
    shutil.rmtree(d)
    os.mkdir(d)
    return d


def _absent(d: str) -> str:
    shutil.rmtree(d)
    return d


def _config_with_unknown_key(d: str) -> str:
    """The config edited and the integrity data rewritten to match: the config's own check."""
    _edit_json(os.path.join(d, ckpt.MODEL_CONFIG), lambda tree: tree.update(extra=1))
    ckpt.write_integrity(d)
    return os.path.join(d, ckpt.MODEL_CONFIG)


def _index_missing_a_leaf(d: str) -> str:
    index = os.path.join(d, ckpt.PARAMS, ckpt.INDEX)
    _edit_json(index, lambda tree: tree["leaves"].pop("llm.norm_f"))
    ckpt.write_integrity(d)
    return index


# name -> (damage: checkpoint dir -> the path the error must name, what it must say, whether
# Verify.SIZES catches it too)
DAMAGE = {
    "shard file deleted": (_delete_shard_file, r"missing \(the conversion wrote it\)", True),
    "shard file truncated": (
        _truncate_shard_file,
        r"size differs: [\d,]+ bytes, the conversion wrote [\d,]+",
        True,
    ),
    "shard file altered": (_alter_shard_file, r"altered or corrupt: sha256 [0-9a-f]{16}", False),
    "digest mismatch": (_differing_digest, r"altered or corrupt: sha256 [0-9a-f]{16}", False),
    "config missing": (_delete_config, r"missing \(the conversion wrote it\)", True),
    "other format version": (
        _other_format,
        r"format 'voicechat_jax/3', this version reads 'voicechat_jax/2': convert the release",
        True,
    ),
    "format 1 (no integrity data)": (
        _format_1,
        r"format 'voicechat_jax/1', this version reads 'voicechat_jax/2': convert the release",
        True,
    ),
    "integrity.json missing": (_delete_integrity, r"missing: not a converted checkpoint", True),
    "integrity.json not JSON": (_garble_integrity, r"not valid JSON", True),
    "empty directory": (_empty, r"empty directory, not a converted checkpoint", True),
    "no such directory": (_absent, r"no such directory", True),
    "config with an unknown key": (
        _config_with_unknown_key,
        r"ModelConfig: unknown keys \['extra'\], missing keys \[\]",
        True,
    ),
    "index without a parameter": (
        _index_missing_a_leaf,
        r"the stored parameters do not match model_config\.json: missing \['llm\.norm_f'\]",
        True,
    ),
}


def _damaged(converted: str, tmp_path, case: str) -> tuple[str, str]:
    d = str(tmp_path / "ck")
    shutil.copytree(converted, d)
    return d, DAMAGE[case][0](d)


def _one_line_error(call, path: str, pattern: str) -> str:
    with pytest.raises(ckpt.CheckpointError) as err:
        call()
    return _check_one_line(err.value, path, pattern)


def _check_one_line(error: ckpt.CheckpointError, path: str, pattern: str) -> str:
    """``error`` is one line that starts with ``path`` and matches ``pattern``; its message."""
    message = str(error)
    assert "\n" not in message
    assert error.path == path
    assert message.startswith(f"{path}: "), message
    assert re.search(pattern, message), message
    return message


@pytest.mark.parametrize("verify", [FULL, SIZES])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_one_line_naming_the_file(case, verify, converted, tmp_path):
    d, path = _damaged(converted, tmp_path, case)
    _, pattern, sizes_catch_it = DAMAGE[case]
    if verify is SIZES and not sizes_catch_it:
        assert ckpt.check(d, SIZES).files == len(_listing(d))  # the documented blind spot
        return
    message = _one_line_error(lambda: ckpt.restore(d, F32, verify=verify), path, pattern)
    assert _one_line_error(lambda: ckpt.check(d, verify), path, pattern) == message


def test_fast_mode_restores_an_altered_file_full_mode_refuses_it(converted, tmp_path):
    """What ``Verify.SIZES`` gives up: a same-size alteration is caught only if the decoder
    notices. The byte flipped lies in one leaf's compressed chunk, and the data files' layout
    differs from one conversion to the next (four conversions of one release here: four
    different largest files, 0.81-1.64 MB). So zstd either decodes other values for that leaf
    (the file restores, one leaf differs) or detects the corruption (orbax's one-line error,
    naming the shard). Full verification refuses it either way."""
    d, path = _damaged(converted, tmp_path, "shard file altered")
    shard = os.path.dirname(os.path.dirname(path))  # .../params/shard_NNNNN
    try:
        _, altered, _ = ckpt.restore(d, F32, verify=SIZES)
    except ckpt.CheckpointError as error:
        _check_one_line(error, shard, r"orbax cannot restore it")
    else:
        _, intact, _ = ckpt.restore(converted, F32)
        leaves = zip(jax.tree.leaves(altered), jax.tree.leaves(intact), strict=True)
        assert sum(not np.array_equal(a, b) for a, b in leaves) == 1
    _one_line_error(lambda: ckpt.restore(d, F32), path, r"altered or corrupt")


def test_a_policy_with_product_choices_restores(converted):
    """A policy's product choices (``matmul``, ``codec_matmul``, ``tts_matmul``,
    ``encoder_matmul``) are not how weights are stored: restoring under them gives the leaves the
    dtypes alone give (before 2026-12-07 the manifest check read them as dtypes and raised
    TypeError, e.g. ``voicechat-serve --checkpoint=... --precision=tf32x3_codec``), and a
    manifest written when they were recorded still reads as the same precision."""
    products = dataclasses.replace(
        F32,
        matmul="tensorfloat32",
        codec_matmul="tf32_x3",
        tts_matmul="pallas_tf32x3",
        encoder_matmul="pallas_tf32x3",
    )
    assert ckpt.precision_to_json(products) == ckpt.precision_to_json(F32)
    _, got, _ = ckpt.restore(converted, products, verify=SIZES)
    _, want, _ = ckpt.restore(converted, F32, verify=SIZES)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )
    written = {**ckpt.precision_to_json(F32), "matmul": "float32", "tts_matmul": "float64"}
    assert ckpt.same_precision(written, products)
    assert not ckpt.same_precision(written, Precision.bf16_tts_kv())


def test_a_chunk_orbax_cannot_decode_is_one_line_naming_the_shard(converted, monkeypatch):
    """Where zstd finds a chunk corrupt, orbax raises a bare ``Exception`` carrying the whole
    tensorstore spec, from tensorstore's ``ValueError`` (seen on 2026-12-06 for one conversion's
    layout of ``test_fast_mode_restores_an_altered_file_full_mode_refuses_it``): one line naming
    the shard and the first cause, never a traceback."""

    def restore(self, directory, target):
        try:
            raise ValueError(
                'FAILED_PRECONDITION: Error reading "rnnt.joint.out/0.0": '
                "ZSTD_decompressStream() failed: Data corruption detected"
            )
        except ValueError as e:
            raise Exception(  # what orbax raises
                "Encountered error while reading array index. See full TensorStore details: "
                + "{" * 2000
            ) from e

    monkeypatch.setattr(ckpt.ocp.StandardCheckpointer, "restore", restore)
    shard = os.path.join(converted, ckpt.PARAMS, "shard_00000")
    message = _one_line_error(
        lambda: ckpt.restore(converted, F32, verify=SIZES),
        shard,
        r"orbax cannot restore it \(ValueError: FAILED_PRECONDITION: .*Data corruption detected\)",
    )
    assert "TensorStore details" not in message


def test_orbax_error_in_fast_mode_is_one_line_naming_the_shard(converted, tmp_path):
    """A shard's OCDBT manifest zeroed (same size): only orbax notices, and says it in a line."""
    d = str(tmp_path / "ck")
    shutil.copytree(converted, d)
    shard = os.path.join(d, ckpt.PARAMS, "shard_00001")
    manifest = os.path.join(shard, "manifest.ocdbt")
    with open(manifest, "r+b") as f:
        f.write(b"\0" * os.path.getsize(manifest))
    message = _one_line_error(
        lambda: ckpt.restore(d, F32, verify=SIZES), shard, r"orbax cannot restore it \(ValueError"
    )
    assert "tensorstore_spec" not in message
    assert len(message) < 600
    _one_line_error(lambda: ckpt.restore(d, F32), manifest, r"altered or corrupt")


CLI_CASES = ["shard file deleted", "shard file truncated", "shard file altered", "config missing"]
CLI_CASES += ["other format version", "empty directory"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_check_cli_prints_the_error_as_one_line(case, converted, tmp_path):
    d, _ = _damaged(converted, tmp_path, case)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.check(d)
    out = shared.run_cli(convert_cli, f"--check={d}")
    assert out.returncode == 1
    assert _error_line(out.stderr) == f"voicechat-convert: {err.value}"


def test_check_cli_on_a_sound_checkpoint(converted):
    out = shared.run_cli(convert_cli, f"--check={converted}", "--verify=sizes")
    assert out.returncode == 0, out.stderr[-2000:]
    n = len(_listing(converted))
    assert re.fullmatch(
        rf"{re.escape(converted)}: {n} files, [\d,]+ bytes verified \(sizes\) in [\d.]+ s",
        out.stdout.strip(),
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--src=somewhere"], "--src and --dst are required"),
        (["--check=somewhere", "--dst=elsewhere"], "--check takes no --src, --dst or --dry_run"),
        (["--src=a", "--dst=b", "--shard_bytes=0"], "flag --shard_bytes=0: 0 is not a positive"),
    ],
    ids=["no dst", "check and dst", "shard_bytes 0"],
)
def test_bad_flags_are_one_line(args, says, tmp_path):
    out = shared.run_cli(convert_cli, *args)
    assert out.returncode == 2
    line = _error_line(out.stderr)
    assert says in line
    assert line.endswith("(--helpshort lists the flags)")


# ---------------------------------------------------------------------------------------------
# signals, stale partial directories, the lock


def _start(release, dst) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "voicechat_jax.cli.convert",
        f"--src={release['dir']}",
        f"--dst={dst}",
        f"--llm_config={release['llm_config']}",
        "--precision=fp32",
        f"--shard_bytes={shared.SMALL_SHARDS}",  # a conversion that takes a few seconds
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _partials(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".ck.partial-"))


def _wait_until_writing(proc: subprocess.Popen, parent, shards: int = 5) -> str:
    """The partial directory, once the conversion has written ``shards`` shards into it."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        found = _partials(parent)
        if found:
            params = os.path.join(parent, found[0], ckpt.PARAMS)
            done = os.listdir(params) if os.path.isdir(params) else []
            if sum(n.startswith("shard_") for n in done) >= shards:
                return os.path.join(parent, found[0])
        time.sleep(0.01)
    raise AssertionError("the conversion never got to writing shards")


@pytest.fixture
def stopper():
    """Processes started by a test, killed if the test ends before they do."""
    procs: list[subprocess.Popen] = []
    yield procs.append
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_removes_the_partial_directory(signum, release, tmp_path, stopper):
    parent = tmp_path / "out"
    parent.mkdir()
    dst = parent / "ck"
    proc = _start(release, dst)
    stopper(proc)
    _wait_until_writing(proc, parent)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum
    name = signal.Signals(signum).name
    assert _error_line(stderr) == (
        f"voicechat-convert: interrupted by {name}; nothing was written to {dst}"
    )
    assert os.listdir(parent) == []  # no partial directory, no lock file, no dst


def test_next_conversion_removes_a_killed_ones_partial_directory(release, tmp_path, stopper):
    """SIGKILL leaves the partial directory and the (unlocked) lock file; the next conversion to
    the same dst takes the lock, removes the partial directory and converts."""
    parent = tmp_path / "out"
    parent.mkdir()
    dst = parent / "ck"
    proc = _start(release, dst)
    stopper(proc)
    partial = _wait_until_writing(proc, parent)
    proc.kill()
    proc.communicate(timeout=120)
    assert os.path.isdir(partial)
    assert ".ck.lock" in os.listdir(parent)
    other = parent / ".other.partial-x1"  # another destination's: not ours to remove
    other.mkdir()
    conv.convert(release["dir"], dst, llm_config=release["llm_config"], precision=F32)
    assert sorted(os.listdir(parent)) == [".other.partial-x1", "ck"]
    assert ckpt.check(dst).files == len(_listing(str(dst)))


def test_second_conversion_to_the_same_dst_is_refused(release, tmp_path, stopper):
    """The first conversion is stopped (SIGSTOP) mid-write; the second says one line, exits 1 and
    leaves the first's work alone; the first, continued, completes."""
    parent = tmp_path / "out"
    parent.mkdir()
    dst = parent / "ck"
    first = _start(release, dst)
    stopper(first)
    partial = _wait_until_writing(first, parent)
    first.send_signal(signal.SIGSTOP)
    try:
        second = _cli(
            f"--src={release['dir']}",
            f"--dst={dst}",
            f"--llm_config={release['llm_config']}",
            "--precision=fp32",
        )
        assert os.path.isdir(partial)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 1
    lock = parent / ".ck.lock"
    assert _error_line(second.stderr) == (
        f"voicechat-convert: {dst} is being converted by pid {first.pid} on "
        f"{socket.gethostname()} (lock {lock}); wait for it to finish or stop it"
    )
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    assert os.listdir(parent) == ["ck"]
    ckpt.check(dst)


def test_lock_in_process(release, tmp_path):
    """The lock refuses a second holder in the same process too (one flock per open file) and
    leaves no file once released; a destination whose parent cannot be made is one error."""
    dst = str(tmp_path / "ck")
    with conv.DstLock(dst) as held:
        assert os.path.exists(held.path)
        with pytest.raises(conv.ConversionError, match=r"ck is being converted by pid \d+ on "):
            conv.convert(release["dir"], dst, llm_config=release["llm_config"], precision=F32)
    assert os.listdir(tmp_path) == []
    with conv.DstLock(dst):
        pass
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(conv.ConversionError, match=r"cannot create .*file"):
        conv.convert(release["dir"], tmp_path / "file" / "ck", llm_config=release["llm_config"])
