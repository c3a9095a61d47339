"""The exclusive, non-blocking ``flock`` behind the converter's and the server's locks.

``take(path)`` opens (making it if needed) and locks ``path`` without waiting, and returns the
open descriptor: the lock lasts until it is closed. When another process holds it,
``HeldError`` says who, as that holder wrote it with ``claim``. A holder that is killed leaves
the file unlocked.
Used by ``convert.DstLock`` (one conversion to a ``--dst`` at a time) and
``serving.outdir.OutputLock`` (one run in an output directory at a time).
"""

from __future__ import annotations

import fcntl
import os
import socket


class HeldError(Exception):
    """Another process holds the lock; ``owner`` is what it wrote there ("pid N on HOST")."""

    def __init__(self, owner: str):
        super().__init__(owner)
        self.owner = owner


def take(path: str) -> int:
    """An open descriptor of ``path`` holding its exclusive lock.

    Raises:
      HeldError: another process holds it.
      OSError: the file cannot be opened or made.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise HeldError(owner) from None
    return fd


def claim(fd: int) -> None:
    """Writes this process into the locked file as its holder (what ``HeldError`` tells others)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
