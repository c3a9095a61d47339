r"""NVIDIA's public release -> an orbax checkpoint, streaming and strict (``convert``).

The command line is ``voicechat-convert`` (``voicechat_jax.cli.convert``). The release
(docs/model.md §4) is a directory holding NeMo's nested ``config.json`` and one
``model.safetensors`` (1,632 tensors, fp32 plus 6 int64 buffers, 44.4 GB). The LLM's sizes are
not in it: NeMo reads them from ``nvidia/NVIDIA-Nemotron-Nano-9B-v2`` by id; ``llm_config`` gives
that ``config.json``, and without it the built-in 9B values are used (the tensors must agree).

Each parameter leaf of ``voicechat.abstract`` is filled from its release tensors through the one
key table (``keys.table.release_table``), cast to the precision policy's dtype for that leaf and
written with orbax (layout: ``voicechat_jax.checkpoint``). Host memory stays bounded: leaves are
filled and written one shard (~1 GiB) at a time, a stacked leaf larger than a shard is split along
its layer axis, big source tensors are read in row blocks, and every read goes through its own
short-lived ``safe_open`` (safetensors maps the whole file; pages read through a handle that stays
open stay resident).

Strict: a source key that maps nowhere, a parameter (or stacked slot) never filled, a slot filled
twice, a shape or dtype that contradicts the config, a truncated or corrupt file and a config that
cannot be read are found from the header before anything is written; NaN/Inf and all-zero tensors
(a public revision of the release has 21 all-zero tensors and outputs only PAD) while streaming,
every such tensor named at the end. Any failure raises ``ConversionError`` and leaves nothing at
``dst``: the checkpoint is written into a temporary directory beside it (``.<dst>.partial-*``) and
renamed at the end, after ``integrity.json`` (every file's size and sha256) is written.

One conversion at a time per ``dst``: ``convert`` holds an exclusive ``flock`` on ``.<dst>.lock``
beside it (a second is refused at once), and, holding it, removes the ``.<dst>.partial-*``
directories of conversions that died (killed, or a second signal during cleanup): while the lock
is held no other conversion to ``dst`` can be running, so nothing it removes is in use. A caller
that turns signals into ``Interrupted`` (the CLI does, for SIGINT and SIGTERM) gets the partial
directory removed too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from safetensors import SafetensorError, safe_open

from voicechat_jax import checkpoint as ckpt
from voicechat_jax import flock
from voicechat_jax.config import ModelConfig
from voicechat_jax.keys import KeyRule, KeyTableError, Layout, fill, to_layout
from voicechat_jax.keys.table import release_table
from voicechat_jax.model import char_encoder, ear_tts, voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.release_config import NANO_9B_V2, STT, read_release

SHARD_BYTES = 1 << 30  # host memory per written shard (a bigger single leaf gets its own)
BLOCK_BYTES = 64 << 20  # source rows read at once from a big tensor
_FLOAT_TAGS = {"F16": np.float16, "F32": np.float32, "F64": np.float64}
_INT_TAGS = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8}
_LLM_KEYS = re.compile(r"stt_model\.(llm|embed_tokens|lm_head|function_head)|\bllm\.")


class ConversionError(ValueError):
    """The release cannot be converted; the message names the files and tensors at fault."""


class Interrupted(BaseException):
    """A signal asked the conversion to stop (raised by the CLI's handler).

    A ``BaseException``, like ``KeyboardInterrupt``: no ``except Exception`` swallows it, and
    ``convert`` removes its partial directory on the way out.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


# ---------------------------------------------------------------------------------------------
# the destination: its lock and its partial directories


def _beside(dst: str, suffix: str) -> str:
    return os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.{suffix}")


class DstLock:
    """An exclusive ``flock`` on ``.<dst>.lock`` beside ``dst``, for one conversion at a time.

    Taken without waiting: when another process holds it, ``ConversionError`` names that process.
    The holder removes the lock file while still holding it; a process that locked the file just
    before it was removed sees that the path no longer names its file and starts again on a new
    one, so removing it never lets two holders in. A killed holder leaves the file, unlocked.
    """

    def __init__(self, dst: str):
        self.dst, self.path = dst, _beside(dst, "lock")
        self._fd: int | None = None

    def __enter__(self) -> DstLock:
        while True:
            try:
                fd = flock.take(self.path)
            except flock.HeldError as e:
                raise ConversionError(
                    f"{self.dst} is being converted by {e.owner} (lock {self.path}); "
                    f"wait for it to finish or stop it"
                ) from None
            except OSError as e:
                raise ConversionError(f"cannot create the lock {self.path}: {e.strerror}") from e
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed this file after we opened it
        flock.claim(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        assert self._fd is not None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None


def _partial_prefix(dst: str) -> str:
    return os.path.basename(_beside(dst, "partial-"))


def remove_stale_partials(dst: str) -> list[str]:
    """Removes the ``.<dst>.partial-*`` directories beside ``dst``; returns their paths.

    Call only while holding ``DstLock(dst)``: every conversion to ``dst`` holds it for as long as
    its partial directory exists, so these are left by conversions that died.
    """
    parent, prefix = os.path.dirname(dst), _partial_prefix(dst)
    removed = []
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if name.startswith(prefix) and os.path.isdir(path) and not os.path.islink(path):
            logging.warning("removing %s, left by a conversion to %s that died", path, dst)
            _remove_tree(path)
            removed.append(path)
    return removed


def _remove_tree(path: str, attempts: int = 20) -> None:
    """``rmtree`` that outlasts files still landing (from an orbax save that failed midway)."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.1)
    logging.error("could not remove %s", path)


# ---------------------------------------------------------------------------------------------
# the source


@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """One tensor of ``model.safetensors``, from the header."""

    name: str
    dtype: str  # safetensors dtype tag: F32, I64, ...
    shape: tuple[int, ...]

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype({**_FLOAT_TAGS, **_INT_TAGS}[self.dtype])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.numpy_dtype.itemsize


class Release:
    """The release's ``model.safetensors``: its header, and reads of one tensor (or rows)."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise ConversionError(f"{path} is missing")
        self.size = os.path.getsize(path)
        try:
            with safe_open(path, framework="numpy") as f:
                self.metadata = f.metadata() or {}
                self.tensors = {}
                for k in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                    sl = f.get_slice(k)
                    self.tensors[k] = SourceTensor(k, sl.get_dtype(), tuple(sl.get_shape()))
        except SafetensorError as e:
            raise ConversionError(f"{path} is truncated or corrupt: {e}") from e
        odd = sorted(k for k, t in self.tensors.items() if t.dtype not in _FLOAT_TAGS | _INT_TAGS)
        if odd:
            kinds = {k: self.tensors[k].dtype for k in odd[:10]}
            raise ConversionError(f"{path}: {len(odd)} tensors of unsupported dtype: {kinds}")

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor ``name`` (or its rows ``[a, b)``), through a handle closed right after."""
        try:
            with safe_open(self.path, framework="numpy") as f:
                return f.get_tensor(name) if rows is None else f.get_slice(name)[rows[0] : rows[1]]
        except SafetensorError as e:
            raise ConversionError(f"{self.path}: reading {name} failed: {e}") from e


def read_config(src: str, llm_config: str | None) -> tuple[ModelConfig, dict, dict | None]:
    """(ModelConfig, release config, LLM config) of a release directory, or ConversionError."""
    path = os.path.join(src, "config.json")
    release_cfg = _read_json(path)
    llm_cfg = _read_json(llm_config) if llm_config else None
    try:
        cfg, unused = read_release(release_cfg, llm_cfg)
    except ValueError as e:
        where = path + (f" + {llm_config}" if llm_config else "")
        raise ConversionError(f"{where}: {e}") from e
    if unused:
        logging.info("config keys the port does not use (%d): %s", len(unused), unused)
    return cfg, release_cfg, llm_cfg


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from e


# ---------------------------------------------------------------------------------------------
# the plan: what goes where, checked from the header alone


@dataclasses.dataclass(frozen=True)
class Entry:
    """One array of a shard: a whole leaf, or rows ``[start, stop)`` of its stacked axis."""

    path: str
    start: int | None
    stop: int | None
    shape: tuple[int, ...]
    dtype: np.dtype
    rules: tuple[KeyRule, ...]

    @property
    def name(self) -> str:
        return self.path if self.start is None else f"{self.path}.{self.start}_{self.stop}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class Plan:
    cfg: ModelConfig
    precision: Precision
    release: Release
    rules: list[KeyRule]
    leaves: dict[str, jax.ShapeDtypeStruct]  # path -> target, in table order
    shards: list[list[Entry]]

    @property
    def read_bytes(self) -> int:
        return sum(self.release.tensors[r.release].nbytes for r in self.rules if r.param)

    def listing(self) -> str:
        """The dry run's report: every release tensor's destination, then every shard."""
        tensors = self.release.tensors
        lines = [
            f"source {self.release.path}: {self.release.size:,} bytes, {len(tensors)} tensors",
            f"precision {ckpt.precision_to_json(self.precision)}",
            "mapping (release tensor -> parameter[slot] layout):",
        ]
        for r in self.rules:
            t = tensors[r.release]
            src = f"{r.release} {t.dtype}{list(t.shape)}"
            if r.param is None:
                lines.append(f"  {src} -> dropped")
                continue
            leaf = self.leaves[r.param]
            slot = list(leaf.shape[len(r.index) :])
            dst = f"{r.param}{list(r.index) if r.index else ''} {jnp.dtype(leaf.dtype).name}{slot}"
            extra = f" {r.layout.value}" + (f" {r.reduce}" if r.reduce else "")
            lines.append(f"  {src} -> {dst}{extra}")
        total = sum(e.nbytes for s in self.shards for e in s)
        lines.append(
            f"would write {len(self.leaves)} parameters, {total:,} bytes in "
            f"{len(self.shards)} shards (reading {self.read_bytes:,} bytes):"
        )
        for i, shard in enumerate(self.shards):
            for e in shard:
                rows = "" if e.start is None else f" rows {e.start}:{e.stop}"
                lines.append(
                    f"  shard_{i:05d} {e.path}{rows} {e.dtype.name}{list(e.shape)} {e.nbytes:,} B"
                )
        return "\n".join(lines)


def make_plan(
    cfg: ModelConfig,
    precision: Precision,
    release: Release,
    *,
    table: Callable[[ModelConfig], list[KeyRule]] = release_table,
    shard_bytes: int = SHARD_BYTES,
    llm_note: str = "",
) -> Plan:
    """Checks the release header against the key table and plans the shards.

    Raises ``ConversionError`` naming the keys that map nowhere, the parameters or slots never
    filled, the slots filled twice, and the shapes or dtype kinds that contradict the config.
    """
    abstract = voicechat.abstract(cfg, precision, text_table=False)
    rules = table(cfg)
    shapes = {k: t.shape for k, t in release.tensors.items()}
    try:
        fill(abstract, rules, shapes, shapes_only=True)
    except KeyTableError as e:
        hint = ""
        if llm_note and _LLM_KEYS.search(str(e)):
            hint = f" ({llm_note})"
        raise ConversionError(
            f"{release.path}: the tensors contradict the config{hint}: {e}"
        ) from e
    leaves = dict(zip(ckpt.leaf_paths(abstract), jax.tree_util.tree_leaves(abstract), strict=True))
    order = list(dict.fromkeys(r.param for r in rules if r.param is not None))
    bad = []
    for r in rules:
        if r.param is None:
            continue
        src_float = release.tensors[r.release].dtype in _FLOAT_TAGS
        if src_float != bool(jnp.issubdtype(leaves[r.param].dtype, jnp.floating)):
            bad.append(f"{r.release} ({release.tensors[r.release].dtype} -> {r.param})")
    if bad:
        raise ConversionError(
            f"{release.path}: {len(bad)} tensors are of the wrong kind (float vs int): {bad[:10]}"
        )
    return Plan(
        cfg=cfg,
        precision=precision,
        release=release,
        rules=rules,
        leaves={p: leaves[p] for p in order},
        shards=_pack(order, leaves, rules, shard_bytes),
    )


def _pack(order: Sequence[str], leaves, rules: Sequence[KeyRule], shard_bytes: int):
    """Entries in table order, packed into shards of at most ``shard_bytes`` (or one leaf)."""
    by_param: dict[str, list[KeyRule]] = {}
    for r in rules:
        if r.param is not None:
            by_param.setdefault(r.param, []).append(r)
    shards, current, size = [], [], 0
    for path in order:
        target, rs = leaves[path], by_param[path]
        dtype = np.dtype(target.dtype)
        nbytes = math.prod(target.shape) * dtype.itemsize
        parts: list[tuple[int | None, int | None]] = [(None, None)]
        if nbytes > shard_bytes and all(r.index for r in rs):
            per = max(1, shard_bytes // (nbytes // target.shape[0]))
            parts = [(a, min(a + per, target.shape[0])) for a in range(0, target.shape[0], per)]
        for a, b in parts:
            shape = target.shape if a is None else (b - a, *target.shape[1:])
            mine = tuple(r for r in rs if a is None or a <= r.index[0] < b)
            entry = Entry(path, a, b, tuple(shape), dtype, mine)
            if current and size + entry.nbytes > shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append(entry)
            size += entry.nbytes
    if current:
        shards.append(current)
    return shards


# ---------------------------------------------------------------------------------------------
# streaming fill with value checks


@dataclasses.dataclass
class _Findings:
    """Value problems, collected over the whole file so that all are named at once."""

    nonfinite: list[str] = dataclasses.field(default_factory=list)
    zero: list[str] = dataclasses.field(default_factory=list)
    overflow: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.nonfinite or self.zero or self.overflow)

    def message(self, path: str) -> str:
        parts = []
        if self.nonfinite:
            parts.append(f"{len(self.nonfinite)} tensors hold NaN or Inf: {self.nonfinite}")
        if self.zero:
            parts.append(
                f"{len(self.zero)} tensors are all zeros: {self.zero} (a public revision of the "
                f"release has 21 all-zero tensors and outputs only PAD; use a known-good revision)"
            )
        if self.overflow:
            parts.append(f"{len(self.overflow)} int tensors overflow int32: {self.overflow}")
        return f"{path}: " + "; ".join(parts)


class _Scan:
    """Running value checks over the blocks of one tensor (no temporaries: min and max only)."""

    def __init__(self, floating: bool):
        self.floating = floating
        self.finite, self.nonzero, self.lo, self.hi = True, False, 0, 0

    def update(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        hi, lo = x.max(), x.min()  # NaN propagates through both
        if self.floating:
            self.finite &= bool(np.isfinite(hi) and np.isfinite(lo))
            self.nonzero |= bool(hi != 0 or lo != 0)
        else:
            self.lo, self.hi = min(self.lo, int(lo)), max(self.hi, int(hi))

    def record(self, name: str, dest_dtype: np.dtype, findings: _Findings) -> None:
        if self.floating:
            if not self.finite:
                findings.nonfinite.append(name)
            elif not self.nonzero:
                findings.zero.append(name)
        else:
            info = np.iinfo(dest_dtype)
            if self.lo < info.min or self.hi > info.max:
                findings.overflow.append(name)


def _load_into(release: Release, rule: KeyRule, dest: np.ndarray, add: bool, findings, write):
    """Reads ``rule.release`` into ``dest`` (its slot), in row blocks when it is big."""
    src = release.tensors[rule.release]
    scan = _Scan(src.dtype in _FLOAT_TAGS)
    rows = None
    if src.nbytes > BLOCK_BYTES and rule.layout in (Layout.IDENTITY, Layout.LINEAR):
        per = max(1, BLOCK_BYTES // (src.nbytes // src.shape[0]))
        rows = [(a, min(a + per, src.shape[0])) for a in range(0, src.shape[0], per)]
    for span in rows or [None]:
        x = release.read(rule.release, span)
        scan.update(x)
        if not write:
            continue
        x = x.astype(dest.dtype)  # cast first: the transpose then moves half the bytes
        if span is None:
            target, x = dest, to_layout(x, rule.layout)
        elif rule.layout is Layout.IDENTITY:
            target = dest[span[0] : span[1]]
        else:  # LINEAR: source rows are our columns
            target, x = dest[:, span[0] : span[1]], x.T
        if add:
            target += x
        else:
            target[...] = x
    scan.record(rule.release, dest.dtype, findings)


def _fill_entry(release: Release, entry: Entry, findings: _Findings, on_bytes) -> np.ndarray:
    buf = np.zeros(entry.shape, entry.dtype)
    seen = set()
    for rule in entry.rules:
        slot = rule.index
        if entry.start is not None:
            slot = (rule.index[0] - entry.start, *rule.index[1:])
        dest = buf[(*slot, Ellipsis)]  # a view, also for a 0-d slot
        add = rule.reduce == "sum" and slot in seen
        _load_into(release, rule, dest, add, findings, write=not findings)
        seen.add(slot)
        on_bytes(release.tensors[rule.release].nbytes)
    return buf


class _Hasher(threading.Thread):
    """sha256 of the source file, in a thread beside the conversion (hashlib drops the GIL)."""

    def __init__(self, path: str):
        super().__init__(daemon=True)
        self.path, self.digest, self.error = path, None, None
        self.cancel = threading.Event()

    def run(self) -> None:
        h, buf = hashlib.sha256(), bytearray(8 << 20)
        view = memoryview(buf)
        try:
            with open(self.path, "rb", buffering=0) as f:
                while not self.cancel.is_set():
                    n = f.readinto(buf)
                    if not n:
                        self.digest = h.hexdigest()
                        return
                    h.update(view[:n])
        except OSError as e:
            self.error = e


class LogProgress:
    """Logs conversion progress every ``step`` percent (the library's default progress)."""

    def __init__(self, step: int = 5):
        self.step, self.last, self.t0 = step, -1, time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        pct = int(100 * done / max(total, 1)) // self.step * self.step
        if pct > self.last:
            self.last = pct
            rate = done / max(time.perf_counter() - self.t0, 1e-9) / 1e6
            logging.info("converted %3d%% (%s / %s bytes, %.0f MB/s)", pct, done, total, rate)


# ---------------------------------------------------------------------------------------------
# the conversion


@dataclasses.dataclass
class Conversion:
    """What ``convert`` did (``dst`` is None for a dry run)."""

    dst: str | None
    listing: str
    manifest: dict
    seconds: float


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike | None,
    *,
    tokenizer: str | os.PathLike | None = None,
    llm_config: str | os.PathLike | None = None,
    dry_run: bool = False,
    precision: Precision | None = None,
    progress: Callable[[int, int], None] | None = None,
    revision: str | None = None,
    text_table: bool = True,
    table: Callable[[ModelConfig], list[KeyRule]] = release_table,
    shard_bytes: int = SHARD_BYTES,
    uninterrupted: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Conversion:
    """Converts the release at ``src`` into a checkpoint at ``dst`` (see the module docstring).

    Args:
      tokenizer: the text tokenizer's ``tokenizer.json`` (or its folder). It is copied into the
        checkpoint; with ``text_table`` the speech decoder's text table is precomputed (on a CPU
        at full size this is slow: pass ``text_table=False`` and the server computes it at load).
      llm_config: the LLM's ``config.json``; default: the built-in Nemotron-Nano-9B-v2 sizes.
      dry_run: check the header and plan, write nothing; the plan is in ``Conversion.listing``.
      precision: the dtype policy written (default ``Precision.reference()``).
      progress: called as ``progress(bytes_done, bytes_total)``; default: logged every 5%.
      table: the key table (tests substitute broken ones).
      uninterrupted: wraps each orbax save; the CLI's ``Signals.held`` keeps SIGINT and SIGTERM
        from stopping a save midway (they are raised when it is done).
    """
    t0 = time.perf_counter()
    src, precision = os.fspath(src), precision or Precision.reference()
    tokenizer = _tokenizer_file(tokenizer)
    llm_config = os.fspath(llm_config) if llm_config else None
    if dry_run:
        plan, _, _ = _plan(src, llm_config, precision, table, shard_bytes)
        return Conversion(None, plan.listing(), {}, time.perf_counter() - t0)
    if dst is None:
        raise ConversionError("no destination given")
    dst = os.path.abspath(os.fspath(dst))
    inside = os.path.realpath(dst), os.path.realpath(src)
    if os.path.commonpath(inside) == inside[1]:
        raise ConversionError(
            f"{dst} is inside the release directory {os.path.abspath(src)}: write the "
            "checkpoint elsewhere"
        )
    if os.path.lexists(dst):
        raise ConversionError(f"{dst} already exists; refusing to overwrite it")
    parent = os.path.dirname(dst)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ConversionError(f"cannot create {parent}: {e}") from e
    with DstLock(dst):
        if os.path.lexists(dst):  # a conversion that held the lock until just now made it
            raise ConversionError(f"{dst} already exists; refusing to overwrite it")
        remove_stale_partials(dst)
        plan, release_cfg, llm_cfg = _plan(src, llm_config, precision, table, shard_bytes)
        release = plan.release
        hasher = _Hasher(release.path)
        tmp = None
        try:
            tmp = tempfile.mkdtemp(prefix=_partial_prefix(dst), dir=parent)
            hasher.start()
            os.chmod(tmp, 0o755)
            progress = progress or LogProgress()
            table_mode, digests = _write_params(
                plan, ckpt.ShardWriter(tmp, uninterrupted), tokenizer, text_table, progress
            )
            hasher.join()
            if hasher.error is not None:
                raise ConversionError(f"reading {release.path} failed: {hasher.error}")
            manifest = _manifest(plan, release_cfg, hasher.digest, revision, llm_config, tokenizer)
            manifest["text_table"] = table_mode
            with uninterrupted():  # a signal while these are written is raised before the rename
                _write_meta(tmp, plan.cfg, manifest, release_cfg, llm_cfg, tokenizer)
                ckpt.write_integrity(tmp, digests)
            os.rename(tmp, dst)
            tmp = None
        except OSError as e:  # the disk: full, read-only, removed under us
            raise ConversionError(f"writing {dst} failed: {e}") from e
        finally:
            if tmp is not None:  # failed or interrupted (SIGINT, SIGTERM): leave nothing
                hasher.cancel.set()
                _remove_tree(tmp)
    logging.info("wrote %s in %.1f s", dst, time.perf_counter() - t0)
    return Conversion(dst, plan.listing(), manifest, time.perf_counter() - t0)


def _plan(src: str, llm_config: str | None, precision: Precision, table, shard_bytes: int):
    """(plan, release config, LLM config) of the release at ``src``, checked from its header."""
    cfg, release_cfg, llm_cfg = read_config(src, llm_config)
    release = Release(os.path.join(src, "model.safetensors"))
    note = "" if llm_config else f"LLM sizes built in for {NANO_9B_V2}; pass --llm_config"
    plan = make_plan(cfg, precision, release, table=table, shard_bytes=shard_bytes, llm_note=note)
    return plan, release_cfg, llm_cfg


def _tokenizer_file(tokenizer) -> str | None:
    if tokenizer is None:
        return None
    path = os.fspath(tokenizer)
    if os.path.isdir(path):
        path = os.path.join(path, ckpt.TOKENIZER)
    if not os.path.isfile(path):
        raise ConversionError(f"tokenizer {path} is missing")
    return path


def _write_params(
    plan: Plan, writer: ckpt.ShardWriter, tokenizer, text_table: bool, progress
) -> tuple[str, dict[str, dict]]:
    """Fills and writes every shard; returns how the text table is provided, and the shards'
    file digests."""
    try:
        mode = _fill_and_write(plan, writer, tokenizer, text_table, progress)
    except BaseException:
        try:
            writer.abort()  # orbax's writes land before the directory is removed
        except Exception:  # the failure being raised says more than this one
            logging.exception("waiting for orbax after the conversion failed")
        raise
    return mode, writer.digests()


def _fill_and_write(plan: Plan, writer: ckpt.ShardWriter, tokenizer, text_table, progress) -> str:
    for path, target in plan.leaves.items():
        writer.add_leaf(path, target.shape, target.dtype)
    findings, done, total = _Findings(), 0, plan.read_bytes
    keep: dict[str, list[np.ndarray]] = {}  # the char encoder's leaves (pieces), for the table

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        progress(done, total)

    for shard in plan.shards:
        entries = {}
        for e in shard:
            entries[e.name] = (
                e.path,
                e.start,
                e.stop,
                _fill_entry(plan.release, e, findings, on_bytes),
            )
            if e.path.startswith("tts.char_encoder."):
                keep.setdefault(e.path, []).append(entries[e.name][3])
        if not findings:
            _write_shard(writer, entries)
    if findings:
        raise ConversionError(findings.message(plan.release.path))
    mode = "at load (from the tokenizer of the release's LLM)"
    if tokenizer is not None:
        chars = char_encoder.char_table(tokenizer)
        extra = {ckpt.CHAR_TABLE: (ckpt.CHAR_TABLE, None, None, chars)}
        writer.add_leaf(ckpt.CHAR_TABLE, chars.shape, chars.dtype)
        mode = "at load (from the stored char table)"
        if text_table:
            table = _text_table(plan, keep, chars)
            extra[ckpt.TEXT_TABLE] = (ckpt.TEXT_TABLE, None, None, table)
            writer.add_leaf(ckpt.TEXT_TABLE, table.shape, table.dtype)
            mode = "precomputed"
        _write_shard(writer, extra)
    writer.close()
    return mode


def _write_shard(writer: ckpt.ShardWriter, entries) -> None:
    try:
        writer.write(entries)
    except ValueError as e:  # tensorstore's errors (a full disk among them) are ValueErrors
        raise ConversionError(f"orbax could not write shard {writer.n_shards - 1}: {e}") from e


def _text_table(plan: Plan, keep: dict, chars: np.ndarray) -> np.ndarray:
    """The speech decoder's [V, D] text table, from the char encoder just converted."""
    cfg = plan.cfg
    tts = voicechat.abstract(cfg, plan.precision, text_table=False).tts
    prefix = "tts.char_encoder."
    paths = [prefix + p for p in ckpt.leaf_paths(tts.char_encoder)]
    enc = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(tts.char_encoder),
        [jnp.concatenate(keep[p]) if len(keep[p]) > 1 else jnp.asarray(keep[p][0]) for p in paths],
    )
    logging.info("precomputing the text table (%d ids x %d chars)", *chars.shape)
    try:
        tts = ear_tts.with_text_table(tts.replace(char_encoder=enc), jnp.asarray(chars), cfg=cfg)
    except ValueError as e:
        raise ConversionError(f"the tokenizer does not fit the model: {e}") from e
    return np.asarray(tts.text_table)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _manifest(plan: Plan, release_cfg, digest, revision, llm_config, tokenizer) -> dict:
    by_key = {r.release: r for r in plan.rules}
    tensors = []
    for name, t in sorted(plan.release.tensors.items()):
        r = by_key[name]
        tensors.append(
            {
                "name": name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "param": r.param,  # None: dropped on purpose
                "index": list(r.index),
                "layout": r.layout.value,
            }
        )
    return {
        "format": ckpt.FORMAT,
        "source": {
            "file": os.path.abspath(plan.release.path),
            "bytes": plan.release.size,
            "sha256": digest,
            "revision": revision,
            "metadata": plan.release.metadata,
        },
        "pretrained_llm": _dotted(release_cfg, f"{STT}.pretrained_llm"),
        "llm_config": os.path.abspath(llm_config) if llm_config else f"built-in {NANO_9B_V2}",
        "tokenizer": {"sha256": _sha256(tokenizer)} if tokenizer else None,
        "precision": ckpt.precision_to_json(plan.precision),
        "tensors": tensors,
        "params": {
            p: {"shape": list(t.shape), "dtype": jnp.dtype(t.dtype).name}
            for p, t in plan.leaves.items()
        },
    }


def _dotted(tree: dict, path: str):
    for part in path.split("."):
        tree = tree[part]
    return tree


def _write_meta(directory, cfg, manifest, release_cfg, llm_cfg, tokenizer) -> None:
    files = {
        ckpt.MODEL_CONFIG: ckpt.config_to_json(cfg),
        ckpt.MANIFEST: manifest,
        ckpt.RELEASE_CONFIG: release_cfg,
    }
    if llm_cfg is not None:
        files[ckpt.LLM_CONFIG] = llm_cfg
    for name, content in files.items():
        with open(os.path.join(directory, name), "w") as f:
            json.dump(content, f, indent=1)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(directory, ckpt.TOKENIZER))
