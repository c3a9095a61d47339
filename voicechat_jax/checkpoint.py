"""Converted checkpoints (``voicechat-convert``): their layout, and restoring them to the device.

A checkpoint directory holds::

  model_config.json     ModelConfig as JSON (``config_to_json``; read back strictly)
  manifest.json         the source: file size and sha256, revision, every tensor's name, shape
                        and dtype and where it went; the precision policy; every parameter written
  release_config.json   the release's own config.json (and llm_config.json when one was given)
  tokenizer.json        the text tokenizer, when the conversion was given one
  params/index.json     every parameter leaf: shape, dtype, and the pieces that hold it
  params/shard_NNNNN/   orbax checkpoints, each a flat dict of arrays of at most ~1 GiB

A parameter larger than a shard is split along its leading (stacked-layer) axis into pieces, so
the converter never holds more than one shard in host memory; ``restore`` reads every piece
straight onto the device and joins them there. ``params/index.json`` may also list
``tts.text_table`` (the speech decoder's derived subword table, precomputed by the converter) and
``char_table`` (each text id's characters, from the tokenizer); when the text table is absent it is
computed at load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from voicechat_jax import config as config_lib
from voicechat_jax.model import char_encoder, ear_tts, voicechat
from voicechat_jax.precision import Precision

FORMAT = "voicechat_jax/1"
MODEL_CONFIG = "model_config.json"
MANIFEST = "manifest.json"
RELEASE_CONFIG = "release_config.json"
LLM_CONFIG = "llm_config.json"
TOKENIZER = "tokenizer.json"
PARAMS = "params"
INDEX = "index.json"
TEXT_TABLE = "tts.text_table"  # the derived [V, D] table, when precomputed
CHAR_TABLE = "char_table"  # [V, C] int32 char ids per text id, when a tokenizer was given


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete or does not match its config."""


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
        raise CheckpointError(f"{where}: unknown keys {unknown}, missing keys {missing}")
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
    return {
        f.name: jnp.dtype(getattr(precision, f.name)).name for f in dataclasses.fields(precision)
    }


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of a leaf's leading axis (the whole leaf: ``start=stop=None``)."""

    shard: str
    entry: str
    start: int | None = None
    stop: int | None = None


class ShardWriter:
    """Writes ``params/shard_NNNNN`` orbax checkpoints one at a time and keeps the index."""

    def __init__(self, directory: str):
        self.directory = os.path.join(directory, PARAMS)
        os.makedirs(self.directory, exist_ok=True)
        self.leaves: dict[str, dict] = {}
        self.n_shards = 0
        self._checkpointer = ocp.StandardCheckpointer()

    def add_leaf(self, path: str, shape: tuple[int, ...], dtype) -> None:
        self.leaves[path] = {"shape": list(shape), "dtype": jnp.dtype(dtype).name, "pieces": []}

    def write(self, entries: Mapping[str, tuple[str, int | None, int | None, np.ndarray]]) -> str:
        """Saves one shard: ``entry name -> (leaf path, start, stop, array)``; returns its name."""
        name = f"shard_{self.n_shards:05d}"
        self.n_shards += 1
        arrays = {k: v[3] for k, v in entries.items()}
        # chunks of <= 64 MiB: tensorstore encodes chunk by chunk, never a whole 1 GiB array
        save_args = {k: ocp.SaveArgs(chunk_byte_size=64 << 20) for k in arrays}
        self._checkpointer.save(os.path.join(self.directory, name), arrays, save_args=save_args)
        self._checkpointer.wait_until_finished()
        for entry, (path, start, stop, _) in entries.items():
            piece = dataclasses.asdict(Piece(name, entry, start, stop))
            self.leaves[path]["pieces"].append(piece)
        return name

    def close(self, extra: Mapping | None = None) -> None:
        index = {"format": FORMAT, "leaves": self.leaves, **(extra or {})}
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump(index, f, indent=1)
        self._checkpointer.close()


# ---------------------------------------------------------------------------------------------
# restore


def read_json(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} is not a converted checkpoint: {name} is missing")
    with open(path) as f:
        return json.load(f)


def restore(
    directory: str | os.PathLike,
    precision: Precision,
    *,
    tokenizer: str | os.PathLike | None = None,
    device: jax.Device | None = None,
) -> tuple[config_lib.ModelConfig, voicechat.ModelParams, Callable[[np.ndarray], str] | None]:
    """(config, params on ``device``, text decoder or None) of a converted checkpoint.

    Each leaf is read by orbax straight onto the device in ``precision``'s dtype (orbax casts on
    the host while reading when the checkpoint was written in another policy). Without a
    precomputed text table it is computed here, on the device, from the checkpoint's char table,
    else from a text tokenizer: ``tokenizer``, the checkpoint's ``tokenizer.json``, or the release
    LLM's (a local directory, or the Hugging Face cache; never the network).
    """
    directory = os.fspath(directory)
    cfg = config_from_json(read_json(directory, MODEL_CONFIG))
    manifest = read_json(directory, MANIFEST)
    index = read_json(os.path.join(directory, PARAMS), INDEX)
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{directory}: format {index.get('format')!r}, expected {FORMAT!r}")
    stored = index["leaves"]
    has_table = TEXT_TABLE in stored
    abstract = voicechat.abstract(cfg, precision, text_table=has_table)
    paths = leaf_paths(abstract)
    targets, treedef = jax.tree_util.tree_flatten(abstract)
    expected = set(paths) | ({CHAR_TABLE} if CHAR_TABLE in stored else set())
    if set(stored) != expected:
        raise CheckpointError(
            f"{directory}: the stored parameters do not match model_config.json: "
            f"missing {sorted(set(paths) - set(stored))[:10]}, "
            f"unexpected {sorted(set(stored) - expected)[:10]}"
        )
    wrote = manifest.get("precision")
    if wrote is not None and wrote != precision_to_json(precision):
        logging.warning("checkpoint written in precision %s, restoring in %s", wrote, precision)
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
                f"{directory} has no text table and no tokenizer was found: convert with "
                f"--tokenizer, or pass the text tokenizer's tokenizer.json"
            )
        logging.info("computing the speech decoder's text table at load")
        with jax.default_device(device):
            params = params.replace(tts=ear_tts.with_text_table(params.tts, chars, cfg=cfg))
    return cfg, params, text_decoder(tok_path) if tok_path is not None else None


def _restore_leaves(directory: str, stored: Mapping, want: Mapping, sharding) -> dict:
    """Every leaf of ``want`` (path -> ShapeDtypeStruct), restored and joined on the device."""
    by_shard: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}
    for path, target in want.items():
        entry = stored[path]
        if tuple(entry["shape"]) != tuple(target.shape):
            raise CheckpointError(f"{path}: stored shape {entry['shape']} != {target.shape}")
        for piece in entry["pieces"]:
            shape = tuple(entry["shape"])
            if piece["start"] is not None:
                shape = (piece["stop"] - piece["start"], *shape[1:])
            by_shard.setdefault(piece["shard"], {})[piece["entry"]] = jax.ShapeDtypeStruct(
                shape, target.dtype, sharding=sharding
            )
    checkpointer = ocp.StandardCheckpointer()
    restored: dict[str, jax.Array] = {}
    for shard, targets in sorted(by_shard.items()):
        restored.update(checkpointer.restore(os.path.join(directory, shard), targets))
    checkpointer.close()
    out = {}
    for path in want:
        pieces = [restored.pop(p["entry"]) for p in stored[path]["pieces"]]
        out[path] = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0)
    return out


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
