"""What every experiment's rows share: where they were measured, and a row log that keeps them.

``provenance()`` is the part every row carries: the commit of the checkout, the device, the jax
version, the command line that ran and the UTC time. ``RowLog`` appends each row to a JSON-lines
file as it is measured (a device call cut short keeps what it measured), with the provenance.
Rows that no device measured (a simulation fitted to measured rows) say so: ``device`` is
``SIMULATION``.
``experiments.rows`` reads the committed rows, holds older ones to the same keys and prints the
READMEs' tables from them.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SIMULATION = "simulation"  # the device of a simulated row


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


def provenance(device: str | None = None) -> dict:
    """The commit, the device, the jax version, the command and the time of a measurement;
    ``device`` (e.g. ``SIMULATION``) in place of the first JAX device's kind."""
    import jax

    return {
        "commit": commit(),
        "device": device or jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "command": shlex.join([pathlib.Path(sys.executable).name, *sys.argv]),
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def latency_fields(summary: dict) -> dict:
    """The serving summary's beat latency, misses and host stages (``MetricsRecorder.summary``),
    under the keys the capacity rows use."""
    lat, stages = summary["latency_ms"], summary["host_stages_ms"]
    return {
        "steady_ticks": summary["ticks"],
        "p50_ms": lat["p50"],
        "p99_ms": lat["p99"],
        "p99.9_ms": lat.get("p99.9"),
        "max_ms": lat["max"],
        "missed_ticks": summary["missed_ticks"],
        "ticks_skipped": summary["ticks_skipped"],
        "missed_by_cause": summary["missed_by_cause"],
        "skipped_by_cause": summary["skipped_by_cause"],
        "stage_p99_ms": {k: v["p99"] for k, v in stages.items()},
        "stage_max_ms": {k: v["max"] for k, v in stages.items()},
    }


def _plain(value):
    """A value JSON has no form for: a numpy (or jax) scalar or array as numbers, else its text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


class RowLog:
    """JSON-lines rows appended to ``path`` as they are measured, each with the provenance (taken
    at the first row; ``device`` as ``provenance``'s). No ``path``: the rows are only kept."""

    def __init__(self, path: str | pathlib.Path | None, device: str | None = None):
        self.path = pathlib.Path(path) if path else None
        self.device = device
        self.rows: list[dict] = []
        self._provenance: dict | None = None

    def write(self, row: dict) -> dict:
        if self._provenance is None:
            self._provenance = provenance(self.device)
        row = {**row, **self._provenance}
        self.rows.append(row)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=_plain) + "\n")
        return row
