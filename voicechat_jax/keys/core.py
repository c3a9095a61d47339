"""The parts of a key table and its strict application: ``Layout``, ``KeyRule``, ``fill``.

``fill`` applies a table strictly, one check per function: a release key the table names twice, a
source key with no rule, a rule whose key is missing, a tensor whose shape is not its slot's, a
parameter slot filled twice or never, and a parameter no rule reaches are all errors that name the
tensors; every problem found is reported in one ``KeyTableError``.
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
      KeyTableError: naming the release keys the table names twice, the keys that map nowhere,
        the rule keys that are missing, any shape mismatch, the slots filled twice or never, and
        the parameters no rule reaches.
    """
    rules = _relative_to(param_prefix, list(rules))
    load = tensors.__getitem__ if isinstance(tensors, Mapping) else tensors
    if shapes_only:
        load = _zeros_shaped(load)
    source_keys = set(keys if keys is not None else tensors.keys())
    named = [r.release for r in rules]
    # nothing is loaded while the table and the source disagree on the keys
    _raise_any(
        [
            _named_twice(named),
            _map_nowhere(source_keys - set(named)),
            _missing(set(named) - source_keys),
        ]
    )
    slots = _Slots(abstract_params, shapes_only)
    problems = [slots.put(rule, load, on_tensor) for rule in rules if rule.param is not None]
    _raise_any([*problems, *slots.never_filled(), _without_rule(abstract_params, slots.leaves)])
    if shapes_only:
        return abstract_params
    out = abstract_params
    for path, buf in slots.leaves.items():
        out = _set_path(out, path, buf)
    return out


def _relative_to(prefix: str, rules: list[KeyRule]) -> list[KeyRule]:
    """Rules whose params are relative to the sub-tree ``prefix`` of ModelParams (all under it)."""
    if not prefix:
        return rules
    strip = prefix + "."
    outside = [r.param for r in rules if r.param is not None and not r.param.startswith(strip)]
    if outside:
        raise KeyTableError(f"rules outside {prefix!r}: {outside[:5]}")
    return [
        r if r.param is None else dataclasses.replace(r, param=r.param[len(strip) :]) for r in rules
    ]


def _zeros_shaped(shapes: Callable[[str], tuple[int, ...]]) -> Callable[[str], np.ndarray]:
    """A loader of broadcast zeros (nothing allocated) of the shapes ``shapes`` gives."""
    return lambda k: np.broadcast_to(np.zeros((), np.float32), tuple(shapes(k)))


def _raise_any(problems: list[str | None]) -> None:
    """One ``KeyTableError`` listing every problem found, if any."""
    found = [p for p in problems if p]
    if found:
        raise KeyTableError("; ".join(found))


def _named_twice(named: list[str]) -> str | None:
    """Release keys the table names more than once."""
    seen: set[str] = set()
    twice = []
    for key in named:
        if key in seen:
            twice.append(key)
        seen.add(key)
    return f"key table names these release keys twice: {twice[:10]}" if twice else None


def _map_nowhere(unmapped: set[str]) -> str | None:
    """Source keys that no rule names."""
    keys = sorted(unmapped)
    return f"{len(keys)} source keys map nowhere: {keys[:10]}" if keys else None


def _missing(missing: set[str]) -> str | None:
    """Rule keys that the source lacks."""
    keys = sorted(missing)
    return f"{len(keys)} keys the model needs are missing: {keys[:10]}" if keys else None


def _shape_mismatch(rule: KeyRule, x: np.ndarray, slot_shape: tuple[int, ...]) -> str | None:
    """A tensor, in our layout, whose shape is not its slot's."""
    if tuple(x.shape) == tuple(slot_shape):
        return None
    return (
        f"{rule.release}: shape {tuple(x.shape)} != expected {tuple(slot_shape)} "
        f"for {rule.param}{list(rule.index) or ''}"
    )


def _filled_twice(rule: KeyRule, times: int) -> str | None:
    """A slot filled before, by a rule that does not sum into it."""
    if not times or rule.reduce == "sum":
        return None
    return f"{rule.release}: slot {rule.param}{list(rule.index)} filled twice"


def _without_rule(abstract_params, reached: Iterable[str]) -> str | None:
    """Leaves of the abstract tree that no rule reaches."""
    never = sorted(set(_leaf_paths(abstract_params)) - set(reached))
    return f"{len(never)} parameters have no rule: {never[:10]}" if never else None


class _Slots:
    """The leaves ``fill`` builds, and how often each one's leading slots were filled.

    A leaf's slots are its positions on the stacked axes the rules index (one slot when they
    index none); ``shapes_only`` keeps the abstract leaves and only counts.
    """

    def __init__(self, abstract_params, shapes_only: bool):
        self.abstract = abstract_params
        self.shapes_only = shapes_only
        self.leaves: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}  # per param path, int32 over its leading slots

    def put(
        self,
        rule: KeyRule,
        load: Callable[[str], np.ndarray],
        on_tensor: Callable[[KeyRule, np.ndarray], np.ndarray] | None,
    ) -> str | None:
        """Load ``rule``'s tensor into its slot; the problem, if it cannot be, instead."""
        target = _get_path(self.abstract, rule.param)
        if rule.param not in self.leaves:
            leaf = target if self.shapes_only else np.zeros(target.shape, target.dtype)
            self.leaves[rule.param] = leaf
            self.counts[rule.param] = np.zeros(target.shape[: len(rule.index)] or (1,), np.int32)
        x = to_layout(np.asarray(load(rule.release)), rule.layout)
        problem = _shape_mismatch(rule, x, target.shape[len(rule.index) :])
        if problem:
            return problem
        if on_tensor is not None:
            x = on_tensor(rule, x)
        count, pos = self.counts[rule.param], rule.index or (0,)
        problem = _filled_twice(rule, count[pos])
        if problem:
            return problem
        if not self.shapes_only:
            self._write(rule, x, add=bool(count[pos]))
        count[pos] += 1
        return None

    def _write(self, rule: KeyRule, x: np.ndarray, *, add: bool) -> None:
        """Set the slot to ``x`` in the leaf's dtype, or add ``x`` to it (``reduce="sum"``)."""
        buf = self.leaves[rule.param]
        x = x.astype(buf.dtype)
        if rule.index:
            buf[rule.index] = buf[rule.index] + x if add else x
        else:
            self.leaves[rule.param] = buf + x if add else x

    def never_filled(self) -> list[str]:
        """The slots of each leaf that no rule filled."""
        problems = []
        for path, count in self.counts.items():
            if not np.all(count):
                empty = [tuple(int(i) for i in idx) for idx in np.argwhere(count == 0)[:10]]
                problems.append(f"{path}: slots {empty} never filled")
        return problems


def _key_name(k) -> str:
    """One path component: a field name, a dict key or a tuple index."""
    return str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))


def _leaf_paths(tree) -> list[str]:
    paths = []
    for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        paths.append(".".join(_key_name(k) for k in keypath))
    return paths
