"""JAX's persistent compilation cache, extended to a program that calls the host (the resident
loop).

JAX keeps every compiled program in its persistent cache (``jax_compilation_cache_dir``) but one
with host callbacks: an ``io_callback`` is a Python function of this process, and JAX neither
writes nor reads such an entry (``jax._src.compiler._cache_write``: "Not writing persistent cache
entry ... because it uses host callbacks"). So the resident loop, the whole model in one program,
compiled again on every start of a server (195 s at 84 slots on an H100, 2026-12-06), while the
dispatch loop's tick loaded from the cache.

Yet the compiled program holds no Python object: each callback is a custom call
(``xla_ffi_python_{cpu,gpu}_callback``) naming its place in the lowering's list of callbacks, and
jaxlib's ``deserialize_executable`` takes the list to bind (``host_callbacks``). This module keeps
such an executable on disk and loads it with the new process's callbacks, in order, for the
compiles made inside ``kept(directory)`` on the calling thread. An entry's key is JAX's own
(``compilation_cache.get_cache_key``: the program, compile options, XLA flags, jaxlib and device),
and the callbacks of one program always lower in the same order, so the same key binds the same
places. Anything the cache cannot do (an unreadable entry, a JAX whose compile path differs) is
logged in one line and the program compiled, never an error: the cache only saves time.

The hook is the one function JAX calls to compile a lowered program
(``jax._src.compiler.compile_or_get_cached``); it is swapped in while some thread is inside
``kept`` and delegates to JAX's own for every other compile.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import threading
from collections.abc import Iterator

from absl import logging
from jax._src import compilation_cache
from jax._src import compiler as jax_compiler

# The entries of a directory kept, newest by use first, while their bytes fit (the newest always):
# one per program, slot count and precision a user serves.
KEEP_BYTES = 2 * 2**30
SUFFIX = ".xla"

_local = threading.local()  # .directory: where this thread's compiles are kept, or None
_lock = threading.Lock()
_users = 0  # threads inside ``kept``; the hook is in place while any is
_jax_compile = jax_compiler.compile_or_get_cached
_jax_signature = inspect.signature(_jax_compile)
_stats = {"loaded": 0, "stored": 0}


def stats() -> dict[str, int]:
    """Entries loaded and stored by this process, so far (tests and logs)."""
    return dict(_stats)


@contextlib.contextmanager
def kept(directory: str | None) -> Iterator[None]:
    """While inside, this thread's compiles of programs with host callbacks are loaded from, or
    stored in, ``directory`` (created if missing). None: nothing kept (a plain compile)."""
    global _users
    if directory is None:
        yield
        return
    os.makedirs(directory, exist_ok=True)
    with _lock:
        _users += 1
        jax_compiler.compile_or_get_cached = _compile_or_load
    _local.directory = directory
    try:
        yield
    finally:
        _local.directory = None
        with _lock:
            _users -= 1
            if not _users:
                jax_compiler.compile_or_get_cached = _jax_compile


def _compile_or_load(*args, **kwargs):
    """``compile_or_get_cached`` for this thread's programs with host callbacks; JAX's own for
    the rest."""
    directory = getattr(_local, "directory", None)
    try:
        a = _jax_signature.bind(*args, **kwargs).arguments
        callbacks = a["host_callbacks"]
        backend, devices, options = a["backend"], a["executable_devices"], a["compile_options"]
    except (TypeError, KeyError):  # a JAX whose compile takes other arguments
        callbacks = None
    if directory is None or not callbacks:
        return _jax_compile(*args, **kwargs)
    try:
        key = compilation_cache.get_cache_key(a["computation"], a["devices"], options, backend)
    except Exception as e:  # a key JAX cannot make: compile, keep nothing
        logging.warning("compile cache: no key for a program with host callbacks (%s)", e)
        return _jax_compile(*args, **kwargs)
    path = os.path.join(directory, key + SUFFIX)
    executable = _load(path, backend, devices, options, callbacks)
    if executable is not None:
        return executable
    executable = _jax_compile(*args, **kwargs)
    _store(path, backend, executable)
    return executable


def _load(path, backend, devices, options, callbacks):
    """The executable at ``path`` bound to ``callbacks``; None if absent or unloadable (then
    removed, so that the compile after it replaces it)."""
    try:
        with open(path, "rb") as f:
            data = compilation_cache.decompress_executable(f.read())
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged entry: compiled again
        logging.warning("compile cache: %s unreadable (%s); compiling", path, e)
        _remove(path)
        return None
    try:
        executable = backend.deserialize_executable(
            data, devices, options, host_callbacks=list(callbacks)
        )
    except Exception as e:  # another jaxlib's or device's entry: compiled again
        logging.warning("compile cache: %s did not load (%s); compiling", path, e)
        _remove(path)
        return None
    os.utime(path)  # newest by use: the last to go
    _stats["loaded"] += 1
    logging.info("compile cache: loaded %s (a program with host callbacks)", path)
    return executable


def _store(path, backend, executable) -> None:
    """``executable`` written to ``path`` whole (a temporary file renamed), the oldest entries
    beyond ``KEEP_BYTES`` removed. A failure is logged: the program runs all the same."""
    directory = os.path.dirname(path)
    try:
        data = compilation_cache.compress_executable(backend.serialize_executable(executable))
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except Exception as e:  # a full disk, a backend that cannot serialize
        logging.warning("compile cache: could not keep %s (%s)", path, e)
        return
    _stats["stored"] += 1
    logging.info("compile cache: kept %s (%.1f MiB)", path, len(data) / 2**20)
    entries = sorted(
        ((e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(directory)
         if e.name.endswith(SUFFIX)),
        reverse=True,
    )  # fmt: skip
    total = 0
    for i, (_, size, entry) in enumerate(entries):
        total += size
        if i and total > KEEP_BYTES:
            _remove(entry)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
