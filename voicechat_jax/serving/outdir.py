"""A run's output directory: one run at a time in it, and no finished run written over.

``OutputLock(path)`` holds an exclusive ``flock`` on ``path/.voicechat-serve.lock`` for as long
as the run writes there: a second run given the same directory is refused at once, naming the
holder (``OutputDirBusyError``). A directory that already holds a finished run (its
``sessions.json`` or ``metrics.jsonl``) is refused too (``OutputDirFinishedError``) unless
``overwrite`` is given. The lock file stays behind, empty; a killed run leaves it unlocked.

``new_run_dir(parent)`` makes a fresh folder for a run that was given no directory:
``parent/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3`` ... when two start in one second), with
``parent/latest`` pointed at it, so that the same command run twice keeps both runs.
"""

from __future__ import annotations

import os
import time

from absl import logging

from voicechat_jax import flock

LOCK = ".voicechat-serve.lock"
FINISHED = ("sessions.json", "metrics.jsonl")  # a run writes these; either marks a run done
LATEST = "latest"


class OutputDirError(RuntimeError):
    """The output directory cannot take this run; ``str()`` is one line."""


class OutputDirBusyError(OutputDirError):
    """Another run holds the directory's lock."""


class OutputDirFinishedError(OutputDirError):
    """The directory holds a finished run, and overwriting it was not asked for."""


class OutputLock:
    """The exclusive lock of a run's output directory (made if missing), held until exit."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False):
        self.path = os.fspath(path)
        self.lock_path = os.path.join(self.path, LOCK)
        self.overwrite = overwrite
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = flock.take(self.lock_path)
        except flock.HeldError as e:
            raise OutputDirBusyError(
                f"{self.path} is in use by another run ({e.owner}; lock {self.lock_path}): "
                "choose another --output_dir, or wait for it to finish"
            ) from None
        except OSError as e:
            raise OutputDirError(f"cannot lock {self.path}: {e.strerror or e}") from None
        done = [n for n in FINISHED if os.path.lexists(os.path.join(self.path, n))]
        if done and not self.overwrite:
            os.close(fd)
            raise OutputDirFinishedError(
                f"{self.path} holds a finished run ({', '.join(done)}): pass --overwrite to "
                "write over it, or choose another --output_dir"
            )
        flock.claim(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None


def new_run_dir(parent: str | os.PathLike) -> str:
    """A new, empty ``parent/<YYYYmmdd-HHMMSS>[-N]`` for one run; ``parent/latest`` links to it
    (where links can be made: a ``latest`` that is not a link is left alone, with a warning)."""
    parent = os.fspath(parent)
    os.makedirs(parent, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        name = stamp if n == 1 else f"{stamp}-{n}"
        path = os.path.join(parent, name)
        try:
            os.mkdir(path)
            break
        except FileExistsError:
            continue
    else:
        raise OutputDirError(f"cannot make a run folder under {parent}: {stamp}-* all taken")
    latest = os.path.join(parent, LATEST)
    if os.path.lexists(latest) and not os.path.islink(latest):
        logging.warning("%s is not a link: left alone (this run is in %s)", latest, path)
        return path
    tmp = os.path.join(parent, f".{LATEST}.{os.getpid()}")
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(name, tmp)
        os.replace(tmp, latest)  # atomic: a reader sees the old run or the new, never neither
    except OSError as e:
        logging.warning("could not point %s at %s: %s", latest, path, e)
    return path
