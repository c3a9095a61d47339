"""Converted checkpoints (``voicechat-convert``): their layout, and restoring them to the device.

A checkpoint directory holds::

  model_config.json     ModelConfig as JSON (``config_to_json``; read back strictly)
  manifest.json         the source: file size and sha256, revision, every tensor's name, shape
                        and dtype and where it went; the precision policy; every parameter written
  release_config.json   the release's own config.json (and llm_config.json when one was given)
  tokenizer.json        the text tokenizer, when the conversion was given one
  params/index.json     every parameter leaf: shape, dtype, and the pieces that hold it
  params/shard_NNNNN/   orbax checkpoints, each a flat dict of arrays of at most ~1 GiB
  integrity.json        the format version, and the size and sha256 of every other file (written
                        last by the converter, from the files as they landed on disk)

A parameter larger than a shard is split along its leading (stacked-layer) axis into pieces, so
the converter never holds more than one shard in host memory; ``restore`` reads every piece
straight onto the device and joins them there. ``params/index.json`` may also list
``tts.text_table`` (the speech decoder's derived subword table, precomputed by the converter) and
``char_table`` (each text id's characters, from the tokenizer); when the text table is absent it is
computed at load.

``check`` (and ``restore``, which calls it first) trusts nothing it has not verified: every file
``integrity.json`` lists must be there with its size and, in ``Verify.FULL``, its sha256 (orbax
itself keeps no checksums: a shard file altered in place restores without complaint). Every
failure is a ``CheckpointError`` whose ``str()`` is one line naming the file and what is wrong.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import hashlib
import json
import os
import time
import types
import typing
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from voicechat_jax import config as config_lib
from voicechat_jax.model import char_encoder, ear_tts, voicechat
from voicechat_jax.precision import Precision

FORMAT = "voicechat_jax/2"  # 2: integrity.json (1 had none; such checkpoints are refused)
MODEL_CONFIG = "model_config.json"
MANIFEST = "manifest.json"
RELEASE_CONFIG = "release_config.json"
LLM_CONFIG = "llm_config.json"
TOKENIZER = "tokenizer.json"
PARAMS = "params"
INDEX = "index.json"
TEXT_TABLE = "tts.text_table"  # the derived [V, D] table, when precomputed
CHAR_TABLE = "char_table"  # [V, C] int32 char ids per text id, when a tokenizer was given
INTEGRITY = "integrity.json"
DIGEST = "sha256"
HASH_WORKERS = 8  # hashlib drops the GIL: files are hashed this many at a time


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, damaged, or does not match its config.

    ``str()`` is one line, ``"<path>: <what is wrong>"``: ``path`` names the file (or the
    directory) at fault, ``problem`` says what is wrong with it.
    """

    def __init__(self, path: str, problem: str):
        self.path = os.fspath(path)
        self.problem = " ".join(str(problem).split())  # one line, whatever the cause said
        super().__init__(f"{self.path}: {self.problem}")

    def __reduce__(self):
        return type(self), (self.path, self.problem)


class Verify(enum.StrEnum):
    """How much of a checkpoint ``check`` reads before it is trusted."""

    FULL = "full"  # every file present, with its size and its sha256 (reads every byte)
    SIZES = "sizes"  # every file present, with its size (stat only: misses same-size changes)


# ---------------------------------------------------------------------------------------------
# ModelConfig <-> JSON


def config_to_json(cfg: config_lib.ModelConfig) -> dict:
    """``ModelConfig`` as a nested dict of JSON values (tuples become lists)."""
    return dataclasses.asdict(cfg)


def config_from_json(tree: Mapping, cls: type = config_lib.ModelConfig):
    """The inverse of ``config_to_json``; a missing or unknown key raises, naming its path."""
    return _dataclass_from(tree, cls, cls.__name__)


def _dataclass_from(tree: Mapping, cls: type, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(tree) - set(names))
    missing = [n for n in names if n not in tree]
    if unknown or missing:
        raise CheckpointError(where, f"unknown keys {unknown}, missing keys {missing}")
    return cls(**{n: _value_from(tree[n], hints[n], f"{where}.{n}") for n in names})


def _value_from(value, hint, where: str):
    if dataclasses.is_dataclass(hint):
        return _dataclass_from(value, hint, where)
    origin = typing.get_origin(hint)
    if origin is tuple:
        return tuple(value)
    if origin in (typing.Union, types.UnionType):  # e.g. ``float | None``
        return value
    if hint is float and isinstance(value, int):
        return float(value)
    return value


# ---------------------------------------------------------------------------------------------
# layout helpers shared with the converter


def leaf_paths(tree) -> list[str]:
    """Dotted paths of a params pytree's leaves, as the key table names them."""
    out = []
    for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = (str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in keypath)
        out.append(".".join(names))
    return out


def precision_to_json(precision: Precision) -> dict[str, str]:
    """The policy's dtypes by field: what the stored leaves are cast to. Its product choices
    (``matmul``, ``codec_matmul``, ``tts_matmul``, ``encoder_matmul``: names or None) say how
    products run, not how weights are stored, and are left out."""
    values = {f.name: getattr(precision, f.name) for f in dataclasses.fields(precision)}
    return {
        k: jnp.dtype(v).name for k, v in values.items() if not (v is None or isinstance(v, str))
    }


def same_precision(wrote: dict[str, str], precision: Precision) -> bool:
    """Whether a manifest's ``precision`` (``precision_to_json`` when it was written) stores the
    leaves as ``precision`` does. Keys that are not dtypes of ``precision`` are ignored: a
    manifest written before 2026-12-07 also recorded the product choices (names read as dtypes,
    'float32' or 'float64')."""
    now = precision_to_json(precision)
    return {k: wrote.get(k) for k in now} == now


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of a leaf's leading axis (the whole leaf: ``start=stop=None``)."""

    shard: str
    entry: str
    start: int | None = None
    stop: int | None = None


class ShardWriter:
    """Writes ``params/shard_NNNNN`` orbax checkpoints one at a time and keeps the index.

    Each shard's files are hashed (``file_digests``) in a thread as soon as orbax has finished
    them, while the converter fills the next shard; ``digests`` returns them all. ``uninterrupted``
    wraps each orbax save (the CLI holds SIGINT and SIGTERM off inside it: a save stopped midway
    leaves orbax's threads writing into a directory about to be removed).
    """

    def __init__(
        self,
        directory: str,
        uninterrupted: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.root = directory
        self._uninterrupted = uninterrupted
        self.directory = os.path.join(directory, PARAMS)
        os.makedirs(self.directory, exist_ok=True)
        self.leaves: dict[str, dict] = {}
        self.n_shards = 0
        self._checkpointer = ocp.StandardCheckpointer()
        self._hashing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="digest")
        self._digests: list[concurrent.futures.Future] = []

    def add_leaf(self, path: str, shape: tuple[int, ...], dtype) -> None:
        self.leaves[path] = {"shape": list(shape), "dtype": jnp.dtype(dtype).name, "pieces": []}

    def write(self, entries: Mapping[str, tuple[str, int | None, int | None, np.ndarray]]) -> str:
        """Saves one shard: ``entry name -> (leaf path, start, stop, array)``; returns its name."""
        name = f"shard_{self.n_shards:05d}"
        self.n_shards += 1
        arrays = {k: v[3] for k, v in entries.items()}
        # chunks of <= 64 MiB: tensorstore encodes chunk by chunk, never a whole 1 GiB array
        save_args = {k: ocp.SaveArgs(chunk_byte_size=64 << 20) for k in arrays}
        with self._uninterrupted():
            where = os.path.join(self.directory, name)
            self._checkpointer.save(where, arrays, save_args=save_args)
            self._checkpointer.wait_until_finished()
        files = _files_under(self.root, os.path.join(PARAMS, name))
        self._digests.append(self._hashing.submit(file_digests, self.root, files, workers=1))
        for entry, (path, start, stop, _) in entries.items():
            piece = dataclasses.asdict(Piece(name, entry, start, stop))
            self.leaves[path]["pieces"].append(piece)
        return name

    def close(self, extra: Mapping | None = None) -> None:
        index = {"format": FORMAT, "leaves": self.leaves, **(extra or {})}
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump(index, f, indent=1)
        self._checkpointer.close()

    def digests(self) -> dict[str, dict]:
        """Size and sha256 of every shard file written so far (waits for the hashing thread)."""
        out: dict[str, dict] = {}
        for future in self._digests:
            out.update(future.result())
        self._hashing.shutdown()
        return out

    def abort(self) -> None:
        """Waits for orbax's writes and the hashing in flight, so the directory can be removed."""
        self._hashing.shutdown(cancel_futures=True)
        try:
            self._checkpointer.wait_until_finished()
        finally:
            self._checkpointer.close()


# ---------------------------------------------------------------------------------------------
# integrity


def _files_under(root: str, sub: str = "") -> list[str]:
    """Every regular file below ``root/sub``, as sorted paths relative to ``root``."""
    out = []
    for here, dirs, files in os.walk(os.path.join(root, sub)):
        dirs.sort()
        out.extend(os.path.relpath(os.path.join(here, f), root) for f in files)
    return sorted(out)


def file_digests(
    root: str, files: Iterable[str], *, workers: int = HASH_WORKERS
) -> dict[str, dict]:
    """``{relative path: {"bytes": size, "sha256": hex}}`` of ``files`` below ``root``."""

    def one(rel: str) -> tuple[str, dict]:
        with open(os.path.join(root, rel), "rb") as f:
            digest = hashlib.file_digest(f, DIGEST).hexdigest()
            return rel, {"bytes": os.fstat(f.fileno()).st_size, DIGEST: digest}

    files = list(files)
    if workers <= 1 or len(files) <= 1:
        return dict(map(one, files))
    # biggest first: a 1 GiB shard file started last would leave the other workers idle
    files.sort(key=lambda rel: -os.path.getsize(os.path.join(root, rel)))
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(files))) as pool:
        return dict(pool.map(one, files))


def write_integrity(directory: str, known: Mapping[str, dict] | None = None) -> dict:
    """Writes ``integrity.json``: the format, and the size and sha256 of every other file.

    ``known`` holds digests already taken (the shards, hashed as they were written); every other
    file is hashed here. Returns what was written.
    """
    known = known or {}
    files = [rel for rel in _files_under(directory) if rel != INTEGRITY]
    digests = {rel: known[rel] for rel in files if rel in known}
    digests.update(file_digests(directory, [rel for rel in files if rel not in known]))
    listing = {"format": FORMAT, "digest": DIGEST, "files": {rel: digests[rel] for rel in files}}
    with open(os.path.join(directory, INTEGRITY), "w") as f:
        json.dump(listing, f, indent=1)
    return listing


@dataclasses.dataclass(frozen=True)
class Checked:
    """What ``check`` verified."""

    directory: str
    config: config_lib.ModelConfig
    files: int
    bytes: int
    verify: Verify
    seconds: float


def check(
    directory: str | os.PathLike,
    verify: Verify = Verify.FULL,
    *,
    manifest_sha256: str | None = None,
) -> Checked:
    """Verifies a converted checkpoint without reading any array onto a device.

    Every file of ``integrity.json`` must be present with its size and (``Verify.FULL``) its
    sha256; the format must be this version's; ``model_config.json`` must parse and
    ``params/index.json`` must hold exactly the parameters that config implies, in their shapes.
    With ``manifest_sha256``, ``integrity.json`` itself must have that sha256 (``verify_files``).
    Raises ``CheckpointError`` (one line: the file and what is wrong) on the first failure.
    """
    t0 = time.perf_counter()
    directory = os.path.abspath(os.fspath(directory))
    listing = verify_files(directory, Verify(verify), manifest_sha256=manifest_sha256)
    cfg, _, index = _read_meta(directory)
    _expected_leaves(directory, cfg, index)
    total = sum(f["bytes"] for f in listing.values())
    return Checked(directory, cfg, len(listing), total, Verify(verify), time.perf_counter() - t0)


def integrity_digest(directory: str | os.PathLike) -> str:
    """The sha256 of a checkpoint's ``integrity.json`` (what ``manifest_sha256`` pins)."""
    path = os.path.join(os.fspath(directory), INTEGRITY)
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, DIGEST).hexdigest()
    except OSError as e:
        raise CheckpointError(path, f"cannot be read: {e.strerror}") from e


def verify_files(
    directory: str, verify: Verify, *, manifest_sha256: str | None = None
) -> dict[str, dict]:
    """The files of ``integrity.json``, each found with its size (and sha256); or raises.

    ``integrity.json`` checks the files against itself: it finds damage, not tampering (whoever
    alters a file can rewrite its listing). ``manifest_sha256``, kept apart from the checkpoint
    (printed by the converter), pins the listing and with ``Verify.FULL`` every byte it lists.
    """
    if not os.path.isdir(directory):
        what = "not a directory" if os.path.exists(directory) else "no such directory"
        raise CheckpointError(directory, what)
    if not os.listdir(directory):
        raise CheckpointError(directory, "empty directory, not a converted checkpoint")
    if manifest_sha256 is not None:
        found = integrity_digest(directory)
        if found != manifest_sha256.strip().lower():
            raise CheckpointError(
                os.path.join(directory, INTEGRITY),
                f"sha256 {found[:16]}... is not the pinned {manifest_sha256[:16]}... "
                "(--manifest_sha256): not the checkpoint that was pinned",
            )
    listing = _read_integrity(directory)
    files = listing["files"]
    problems = []
    for rel, want in files.items():
        path = os.path.join(directory, rel)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append((path, "missing (the conversion wrote it)"))
            continue
        if size != want["bytes"]:
            # Only the size is known to differ (cut short, grown, or replaced): no guess.
            problems.append(
                (path, f"size differs: {size:,} bytes, the conversion wrote {want['bytes']:,}")
            )
    if verify is Verify.FULL and not problems:
        try:
            found = file_digests(directory, files)
        except OSError as e:
            raise CheckpointError(e.filename or directory, f"cannot be read: {e.strerror}") from e
        for rel, want in files.items():
            if found[rel][DIGEST] != want[DIGEST]:
                problems.append(
                    (
                        os.path.join(directory, rel),
                        f"altered or corrupt: {DIGEST} {found[rel][DIGEST][:16]}..., the "
                        f"conversion wrote {want[DIGEST][:16]}...",
                    )
                )
    if problems:
        path, what = problems[0]
        more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
        raise CheckpointError(path, what + more)
    unlisted = sorted(set(_files_under(directory)) - set(files) - {INTEGRITY})
    if unlisted:
        logging.warning("%s: files the conversion did not write (ignored): %s", directory, unlisted)
    logging.info("%s: %d files verified (%s)", directory, len(files), verify)
    return files


def _read_integrity(directory: str) -> dict:
    path = os.path.join(directory, INTEGRITY)
    if not os.path.exists(path):
        old = _format_of(os.path.join(directory, PARAMS, INDEX))
        if old is not None and old != FORMAT:
            raise CheckpointError(directory, _old_format(old))
        raise CheckpointError(path, "missing: not a converted checkpoint, or not a whole one")
    listing = _load_json(path)
    if listing.get("format") != FORMAT:
        raise CheckpointError(path, _old_format(listing.get("format")))
    files = listing.get("files")
    if (
        listing.get("digest") != DIGEST
        or not isinstance(files, dict)
        or not all(isinstance(f, dict) and {"bytes", DIGEST} <= set(f) for f in files.values())
    ):
        raise CheckpointError(path, f"not a {FORMAT} integrity listing")
    return listing


def _old_format(found) -> str:
    return f"format {found!r}, this version reads {FORMAT!r}: convert the release again"


def _format_of(path: str):
    try:
        with open(path) as f:
            return json.load(f).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            tree = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot be read: {e.strerror}") from e
    except ValueError as e:
        raise CheckpointError(path, f"not valid JSON: {e}") from e
    if not isinstance(tree, dict):
        raise CheckpointError(path, f"not a JSON object but {type(tree).__name__}")
    return tree


# ---------------------------------------------------------------------------------------------
# restore


def read_json(directory: str, name: str) -> dict:
    """``directory/name`` as JSON; ``CheckpointError`` when it is missing or not a JSON object."""
    return _load_json(os.path.join(directory, name))


def _read_meta(directory: str) -> tuple[config_lib.ModelConfig, dict, dict]:
    """(config, manifest, params index) of a checkpoint whose files were verified."""
    path = os.path.join(directory, MODEL_CONFIG)
    tree = _load_json(path)
    try:
        cfg = config_from_json(tree)
    except CheckpointError as e:  # names the config key at fault; the file goes in front
        raise CheckpointError(path, str(e)) from e
    except (TypeError, ValueError) as e:  # ModelConfig's own checks (__post_init__)
        raise CheckpointError(path, f"not a valid ModelConfig: {e}") from e
    manifest = read_json(directory, MANIFEST)
    index_path = os.path.join(directory, PARAMS, INDEX)
    index = _load_json(index_path)
    if index.get("format") != FORMAT:
        raise CheckpointError(index_path, _old_format(index.get("format")))
    return cfg, manifest, index


def _expected_leaves(directory: str, cfg, index: Mapping, precision: Precision | None = None):
    """(abstract params, their leaf paths) after checking the index against ``cfg``."""
    stored = index["leaves"]
    abstract = voicechat.abstract(
        cfg, precision or Precision.reference(), text_table=TEXT_TABLE in stored
    )
    paths = leaf_paths(abstract)
    expected = set(paths) | ({CHAR_TABLE} if CHAR_TABLE in stored else set())
    where = os.path.join(directory, PARAMS, INDEX)
    if set(stored) != expected:
        raise CheckpointError(
            where,
            f"the stored parameters do not match {MODEL_CONFIG}: "
            f"missing {sorted(set(paths) - set(stored))[:10]}, "
            f"unexpected {sorted(set(stored) - expected)[:10]}",
        )
    for path, target in zip(paths, jax.tree_util.tree_leaves(abstract), strict=True):
        if tuple(stored[path]["shape"]) != tuple(target.shape):
            raise CheckpointError(
                where, f"{path}: stored shape {stored[path]['shape']} != {target.shape}"
            )
    return abstract, paths


def restore(
    directory: str | os.PathLike,
    precision: Precision,
    *,
    tokenizer: str | os.PathLike | None = None,
    device: jax.Device | None = None,
    sharding: jax.sharding.Sharding | None = None,
    verify: Verify = Verify.FULL,
    manifest_sha256: str | None = None,
) -> tuple[config_lib.ModelConfig, voicechat.ModelParams, Callable[[np.ndarray], str] | None]:
    """(config, params on ``device``, text decoder or None) of a converted checkpoint.

    ``sharding`` places every leaf instead (e.g. ``mesh.replicated(m)``: a copy on each device of
    a mesh, read by orbax straight onto them); it overrides ``device``.

    The files are verified first (``check``'s ``verify``: ``Verify.SIZES`` skips the digests;
    ``manifest_sha256``: the sha256 ``integrity.json`` must have, ``verify_files``).
    Each leaf is read by orbax straight onto the device in ``precision``'s dtype (orbax casts on
    the host while reading when the checkpoint was written in another policy). Without a
    precomputed text table it is computed here, on the device, from the checkpoint's char table,
    else from a text tokenizer: ``tokenizer``, the checkpoint's ``tokenizer.json``, or the release
    LLM's (a local directory, or the Hugging Face cache; never the network). Every failure is a
    ``CheckpointError`` (one line: the file and what is wrong).
    """
    directory = os.path.abspath(os.fspath(directory))  # orbax refuses relative paths
    verify_files(directory, Verify(verify), manifest_sha256=manifest_sha256)
    cfg, manifest, index = _read_meta(directory)
    stored = index["leaves"]
    has_table = TEXT_TABLE in stored
    abstract, paths = _expected_leaves(directory, cfg, index, precision)
    targets, treedef = jax.tree_util.tree_flatten(abstract)
    wrote = manifest.get("precision")
    if wrote is not None and not same_precision(wrote, precision):
        logging.warning("checkpoint written in precision %s, restoring in %s", wrote, precision)
    if sharding is None:
        device = device or jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
    want = dict(zip(paths, targets, strict=True))
    if CHAR_TABLE in stored:
        want[CHAR_TABLE] = jax.ShapeDtypeStruct(tuple(stored[CHAR_TABLE]["shape"]), jnp.int32)
    leaves = _restore_leaves(os.path.join(directory, PARAMS), stored, want, sharding)
    params = jax.tree_util.tree_unflatten(treedef, [leaves[p] for p in paths])
    tok_path = _find_tokenizer(directory, manifest, tokenizer)
    if not has_table:
        if CHAR_TABLE in leaves:
            chars = leaves[CHAR_TABLE]
        elif tok_path is not None:
            chars = jax.device_put(char_encoder.char_table(tok_path), sharding)
        else:
            raise CheckpointError(
                directory,
                "no text table and no tokenizer was found: convert with --tokenizer, or pass "
                "the text tokenizer's tokenizer.json",
            )
        logging.info("computing the speech decoder's text table at load")
        with jax.default_device(device):
            tts = ear_tts.with_text_table(params.tts, chars, cfg=cfg)
        params = params.replace(tts=jax.device_put(tts, sharding))
    return cfg, params, text_decoder(tok_path) if tok_path is not None else None


def _restore_leaves(directory: str, stored: Mapping, want: Mapping, sharding) -> dict:
    """Every leaf of ``want`` (path -> ShapeDtypeStruct), restored and joined on the device."""
    by_shard: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}
    for path, target in want.items():
        entry = stored[path]
        for piece in entry["pieces"]:
            shape = tuple(entry["shape"])
            if piece["start"] is not None:
                shape = (piece["stop"] - piece["start"], *shape[1:])
            by_shard.setdefault(piece["shard"], {})[piece["entry"]] = jax.ShapeDtypeStruct(
                shape, target.dtype, sharding=sharding
            )
    checkpointer = ocp.StandardCheckpointer()
    restored: dict[str, jax.Array] = {}
    try:
        for shard, targets in sorted(by_shard.items()):
            where = os.path.join(directory, shard)
            try:
                restored.update(checkpointer.restore(where, targets))
            except Exception as e:
                # tensorstore's errors are ValueErrors; orbax wraps a chunk's read error (zstd
                # finding corrupt data, for one) in a bare Exception whose message is the
                # whole tensorstore spec: the error named is the first cause's. Anything else
                # is not a damaged file and goes up as it is.
                cause = _root_cause(e)
                if not isinstance(cause, (OSError, ValueError)):
                    raise
                raise CheckpointError(
                    where,
                    f"orbax cannot restore it ({type(cause).__name__}: {_gist(cause)}); a full "
                    f"verification names the damaged file",
                ) from e
    finally:
        checkpointer.close()
    out = {}
    for path in want:
        pieces = [restored.pop(p["entry"]) for p in stored[path]["pieces"]]
        out[path] = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0)
    return out


def _root_cause(error: BaseException) -> BaseException:
    """The first error of a chain of ``raise ... from``."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _gist(error: BaseException, limit: int = 300) -> str:
    """An orbax/tensorstore error without the tensorstore spec it appends (kilobytes of JSON)."""
    text = " ".join(str(error).split(" [tensorstore_spec")[0].split())
    return text if len(text) <= limit else text[:limit] + "..."


def _find_tokenizer(directory: str, manifest: Mapping, tokenizer) -> str | None:
    """The text tokenizer's ``tokenizer.json``: given, in the checkpoint, or the release LLM's."""
    if tokenizer is not None:
        path = os.fspath(tokenizer)
        return os.path.join(path, TOKENIZER) if os.path.isdir(path) else path
    own = os.path.join(directory, TOKENIZER)
    if os.path.exists(own):
        return own
    llm = manifest.get("pretrained_llm")
    if not llm:
        return None
    if os.path.isdir(llm):
        path = os.path.join(llm, TOKENIZER)
        return path if os.path.exists(path) else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(llm, TOKENIZER)
    return found if isinstance(found, str) else None


def text_decoder(tokenizer_json: str) -> Callable[[np.ndarray], str] | None:
    """Text ids -> string (special tokens such as PAD dropped), or None without ``tokenizers``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        logging.warning("the tokenizers package is missing: no transcript.txt")
        return None
    tok = Tokenizer.from_file(tokenizer_json)
    return lambda ids: tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])
