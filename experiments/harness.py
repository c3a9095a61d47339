"""What every experiment's rows share: where they were measured, and a row log that keeps them.

``provenance()`` is the part every row carries: the commit of the checkout, the device, the jax
version, the command line that ran and the UTC time. ``RowLog`` appends each row to a JSON-lines
file as it is measured (a device call cut short keeps what it measured), with the provenance.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def commit() -> str:
    """The short commit of this checkout, with ``+dirty`` when it has uncommitted changes."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def provenance() -> dict:
    """The commit, the device, the jax version, the command and the time of a measurement."""
    import jax

    return {
        "commit": commit(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "command": shlex.join([pathlib.Path(sys.executable).name, *sys.argv]),
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


class RowLog:
    """JSON-lines rows appended to ``path`` as they are measured, each with the provenance."""

    def __init__(self, path: str | pathlib.Path | None):
        self.path = None if path is None else pathlib.Path(path)
        self.rows: list[dict] = []
        self._provenance: dict | None = None

    def write(self, row: dict) -> dict:
        if self._provenance is None:
            self._provenance = provenance()
        row = {**row, **self._provenance}
        self.rows.append(row)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        return row
