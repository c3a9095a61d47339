"""The release key table: each tensor of ``model.safetensors`` -> one place in our params.

The table is assembled from one module per sub-network (``keys.encoder``, ``keys.llm``, ...), each
exporting ``rules(cfg) -> list[KeyRule]``. A rule names one release tensor, the dotted path of the
parameter it fills (``llm.mamba.in_proj``), the position on that parameter's leading stacked axes
(the layer index for stacked layers), and the layout transform from torch's layout to ours
(model-spec §4). Release names appear nowhere else in the package.

``fill`` applies a table strictly: a source key with no rule, a rule whose key is missing, a
parameter slot filled twice or never, and a shape that does not match are all errors that name the
tensors. The converter (``voicechat-convert``) and the parity tests both load through here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np


class Layout(enum.Enum):
    """How a torch tensor is laid out in this project's params."""

    IDENTITY = "identity"
    LINEAR = "linear"  # [out, in] -> [in, out]
    CONV1D = "conv1d"  # [out, in/g, k] -> [k, in/g, out]
    CONV2D = "conv2d"  # [o, i/g, kh, kw] -> [kh, kw, i/g, o]
    SQUEEZE = "squeeze"  # drop all size-1 axes (e.g. mel filterbank [1, M, F] -> [M, F])
    TRANSPOSE = "transpose"  # reverse all axes (e.g. [M, F] -> [F, M])
    DEPTHWISE_CONV1D = "depthwise_conv1d"  # [C, 1, k] -> [k, C] (e.g. the Mamba conv1d)


def to_layout(x: np.ndarray, layout: Layout) -> np.ndarray:
    """Transform one torch-layout tensor into this project's layout."""
    if layout is Layout.IDENTITY:
        return x
    if layout is Layout.LINEAR:
        _expect_ndim(x, 2, layout)
        return x.T
    if layout is Layout.CONV1D:
        _expect_ndim(x, 3, layout)
        return np.transpose(x, (2, 1, 0))
    if layout is Layout.CONV2D:
        _expect_ndim(x, 4, layout)
        return np.transpose(x, (2, 3, 1, 0))
    if layout is Layout.SQUEEZE:
        return np.squeeze(x)
    if layout is Layout.TRANSPOSE:
        return x.T
    if layout is Layout.DEPTHWISE_CONV1D:
        _expect_ndim(x, 3, layout)
        return x[:, 0, :].T
    raise ValueError(f"unknown layout {layout}")


def _expect_ndim(x: np.ndarray, ndim: int, layout: Layout) -> None:
    if x.ndim != ndim:
        raise ValueError(f"layout {layout.value} expects a {ndim}-d tensor, got shape {x.shape}")


@dataclasses.dataclass(frozen=True)
class KeyRule:
    """One release tensor and where it lands.

    ``reduce`` combines several release tensors into one slot (the LSTM's ``bias_ih + bias_hh``):
    rules sharing ``param``/``index`` with ``reduce="sum"`` are summed, each consumed once.
    ``param=None`` drops a release tensor deliberately: ``fill`` requires it in the source and
    consumes it without loading it (e.g. the codec's training-only ``prvq._variance_list``).
    A path component that is a number indexes a tuple field (``codec.decoder.stages.0.up``).
    """

    release: str
    param: str | None
    index: tuple[int, ...] = ()
    layout: Layout = Layout.IDENTITY
    reduce: str | None = None


class KeyTableError(ValueError):
    """A release state dict does not match the key table."""


def _child(node, name: str):
    return node[int(name)] if isinstance(node, tuple) else getattr(node, name)


def _get_path(tree, path: str):
    node = tree
    for name in path.split("."):
        node = _child(node, name)
    return node


def _set_path(tree, path: str, value):
    name, _, rest = path.partition(".")
    new = _set_path(_child(tree, name), rest, value) if rest else value
    if isinstance(tree, tuple):
        i = int(name)
        return (*tree[:i], new, *tree[i + 1 :])
    return tree.replace(**{name: new})


def fill(
    abstract_params,
    rules: Iterable[KeyRule],
    tensors: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
    *,
    keys: Iterable[str] | None = None,
    on_tensor: Callable[[KeyRule, np.ndarray], np.ndarray] | None = None,
    param_prefix: str = "",
    shapes_only: bool = False,
):
    """Build concrete params (NumPy leaves) from release tensors, strictly.

    Args:
      abstract_params: the params pytree of ``jax.ShapeDtypeStruct`` (``abstract(cfg)``); leaves
        come back as NumPy arrays of the abstract dtype.
      rules: the key table.
      tensors: a mapping, or a function loading one tensor by name (for streaming loads).
      keys: every key present in the source; defaults to ``tensors.keys()``.
      on_tensor: an optional hook applied to each transformed tensor (the converter's checks).
      param_prefix: fill only this sub-tree of ModelParams (``abstract_params`` is that sub-tree).
      shapes_only: ``tensors`` maps each key to its shape; every check runs, nothing is
        allocated, and the abstract params come back (full-size checks of the table).

    Raises:
      KeyTableError: naming the keys that map nowhere, the rule keys that are missing, the slots
        filled twice or never, and any shape mismatch.
    """
    rules = list(rules)
    if param_prefix:
        # Fill one sub-tree (e.g. only ``llm``): rule paths are relative to the whole ModelParams.
        strip = param_prefix + "."
        bad = [r.param for r in rules if r.param is not None and not r.param.startswith(strip)]
        if bad:
            raise KeyTableError(f"rules outside {param_prefix!r}: {bad[:5]}")
        rules = [
            r if r.param is None else dataclasses.replace(r, param=r.param[len(strip) :])
            for r in rules
        ]
    load = tensors.__getitem__ if isinstance(tensors, Mapping) else tensors
    if shapes_only:
        shapes = load
        load = lambda k: np.broadcast_to(np.zeros((), np.float32), tuple(shapes(k)))  # noqa: E731
    source_keys = set(keys if keys is not None else tensors.keys())
    by_key: dict[str, KeyRule] = {}
    dup_rules = []
    for r in rules:
        if r.release in by_key:
            dup_rules.append(r.release)
        by_key[r.release] = r
    unmapped = sorted(source_keys - set(by_key))
    missing = sorted(set(by_key) - source_keys)
    problems = []
    if dup_rules:
        problems.append(f"key table names these release keys twice: {dup_rules[:10]}")
    if unmapped:
        problems.append(f"{len(unmapped)} source keys map nowhere: {unmapped[:10]}")
    if missing:
        problems.append(f"{len(missing)} keys the model needs are missing: {missing[:10]}")
    if problems:
        raise KeyTableError("; ".join(problems))

    leaves_by_path: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}  # per param path, a bool mask over its leading slots
    problems = []
    for rule in rules:
        if rule.param is None:  # a deliberately dropped tensor: consumed, never loaded
            continue
        target = _get_path(abstract_params, rule.param)
        if rule.param not in leaves_by_path:
            leaves_by_path[rule.param] = (
                target if shapes_only else np.zeros(target.shape, target.dtype)
            )
            filled[rule.param] = np.zeros(target.shape[: len(rule.index)] or (1,), np.int32)
        buf = leaves_by_path[rule.param]
        x = to_layout(np.asarray(load(rule.release)), rule.layout)
        slot_shape = target.shape[len(rule.index) :]
        if tuple(x.shape) != tuple(slot_shape):
            problems.append(
                f"{rule.release}: shape {tuple(x.shape)} != expected {tuple(slot_shape)} "
                f"for {rule.param}{list(rule.index) or ''}"
            )
            continue
        if on_tensor is not None:
            x = on_tensor(rule, x)
        mark = filled[rule.param]
        pos = rule.index if rule.index else (0,)
        if mark[pos] and rule.reduce != "sum":
            problems.append(f"{rule.release}: slot {rule.param}{list(rule.index)} filled twice")
            continue
        if shapes_only:
            pass
        elif rule.index:
            buf[rule.index] = (
                buf[rule.index] + x.astype(buf.dtype) if mark[pos] else x.astype(buf.dtype)
            )
        else:
            leaves_by_path[rule.param] = buf = (
                (buf + x.astype(buf.dtype)) if mark[pos] else x.astype(buf.dtype)
            )
        mark[pos] += 1
    for path, mark in filled.items():
        if not np.all(mark):
            empty = [tuple(int(i) for i in idx) for idx in np.argwhere(mark == 0)[:10]]
            problems.append(f"{path}: slots {empty} never filled")
    # every leaf of the abstract tree must be reached by some rule
    all_paths = _leaf_paths(abstract_params)
    never = sorted(set(all_paths) - set(leaves_by_path))
    if never:
        problems.append(f"{len(never)} parameters have no rule: {never[:10]}")
    if problems:
        raise KeyTableError("; ".join(problems))

    if shapes_only:
        return abstract_params
    out = abstract_params
    for path, buf in leaves_by_path.items():
        out = _set_path(out, path, buf)
    return out


def _key_name(k) -> str:
    """One path component: a field name, a dict key or a tuple index."""
    return str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))


def _leaf_paths(tree) -> list[str]:
    paths = []
    for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        paths.append(".".join(_key_name(k) for k in keypath))
    return paths
