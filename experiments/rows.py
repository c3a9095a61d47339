"""The committed rows of every experiment: one format, read, normalised and printed as tables.

A row file is JSON lines, one measurement (or one simulated point) a line, and every row carries
its provenance: the ``commit`` of the checkout that measured it, the ``device``, the ``jax``
version, the ``command`` and the UTC time (``measured_at``), as ``experiments.harness.RowLog``
writes them. Rows written before that rule lack some of these; ``normalize`` gives each row every
key, from what the row says under another name or what the experiment's README says, and sets
the rest to ``null`` with a ``provenance`` note saying what was backfilled, when and from where
(``recorded_in``: the commit that added the row's line). It never invents a measurement commit
or a device: a value nobody recorded stays ``null``.

Every README table is printed from its rows by a command, as jax's ``benchmarks/`` do::

  PYTHONPATH=. python3 -m experiments.rows --table=experiments/X/results/Y.jsonl \\
      --where=kind=serve --columns=sessions,p50_ms:.1f,p99_ms:.1f --sort=sessions
  PYTHONPATH=. python3 -m experiments.rows --normalize=experiments/X/results/Y.jsonl \\
      --default=device=cpu --source=device=experiments/X/README.md

Columns are row keys (a dotted path reaches into a nested dict: ``stage_p99_ms.prepare``; a
number may be scaled by a constant: ``bytes/1e9``), each with an optional Python format spec
after a colon (``refused_frac:.2%``).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import pathlib
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]

# Every committed row carries these keys (``experiments.harness.provenance``), null if not known.
PROVENANCE = ("commit", "device", "jax", "command", "measured_at")

# A provenance key that older rows recorded under another name: the row's own value is used.
ALIASES: dict[str, tuple[str, ...]] = {
    "commit": ("engine_commit",),
    "measured_at": ("date",),
}

MISSING = "—"


def load(path: str | pathlib.Path) -> list[dict]:
    """The rows of a file: JSON lines (``.jsonl``), a JSON list of rows or one JSON object (a
    row) (``.json``), or a CSV file with a header (``.csv``, numbers parsed)."""
    path = pathlib.Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    elif path.suffix == ".csv":
        rows = [{k: _cell(v) for k, v in r.items()} for r in csv.DictReader(text.splitlines())]
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: row {i} is not an object: {r!r:.80}")
    return rows


def _cell(text: str | None) -> Any:
    """A CSV cell as the value it spells: null when empty, else a JSON number, boolean or null,
    else the text."""
    if text is None or text == "":
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def dump(rows: Iterable[Mapping], path: str | pathlib.Path) -> None:
    """Write ``rows`` to ``path`` as JSON lines (as ``RowLog`` writes them)."""
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def normalize(
    row: Mapping,
    defaults: Mapping[str, Any] | None = None,
    *,
    sources: Mapping[str, str] | None = None,
    today: str | None = None,
) -> dict:
    """``row`` with every provenance key (``PROVENANCE``); a row that has them all is returned
    as it is.

    A missing key takes, in order: the row's own value under an older name (``ALIASES``), then
    ``defaults[key]``, else null. ``defaults`` may also give ``recorded_in`` (the commit that
    added the row). The filled row gets a ``provenance`` note, ``"backfilled <today> from ..."``,
    naming the source of each value filled (``sources[key]``, else "defaults") and the keys left
    null. The measured values are not touched; new keys go last. Applying it twice changes
    nothing.
    """
    out = dict(row)
    missing = [k for k in PROVENANCE if k not in out]
    if not missing:
        return out
    defaults = defaults or {}
    sources = sources or {}
    found: dict[str, list[str]] = {}
    unknown: list[str] = []
    for key in missing:
        alias = next((a for a in ALIASES.get(key, ()) if out.get(a) is not None), None)
        if alias is not None:
            out[key] = out[alias]
            found.setdefault(f"the row's {alias!r}", []).append(key)
        elif defaults.get(key) is not None:
            out[key] = defaults[key]
            found.setdefault(sources.get(key, "defaults"), []).append(key)
        else:
            out[key] = None
            unknown.append(key)
    if "recorded_in" not in out and defaults.get("recorded_in") is not None:
        out["recorded_in"] = defaults["recorded_in"]
        found.setdefault(sources.get("recorded_in", "defaults"), []).append("recorded_in")
    parts = [f"{src} ({', '.join(keys)})" for src, keys in found.items()]
    note = f"backfilled {today or datetime.date.today().isoformat()}"
    if parts:
        note += " from " + "; ".join(parts)
    if unknown:
        note += f"; not recorded: {', '.join(unknown)}"
    out.setdefault("provenance", note)
    return out


def _git(*args: str) -> str | None:
    """A git command's output in this repository, None if it fails (a file git does not know)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout


def blame(path: str | pathlib.Path, ignore_revs: Sequence[str] = ()) -> list[str | None]:
    """The short commit that added each non-empty line of a committed file (``git blame``, past
    ``ignore_revs``: commits that rewrote rows without measuring them); None for a line not
    committed yet, every line None for a file git does not know."""
    path = pathlib.Path(path).resolve()
    ignore = [f"--ignore-rev={rev}" for rev in ignore_revs]
    out = _git("blame", "--line-porcelain", *ignore, "--", str(path))
    if out is None:
        return [None] * sum(1 for line in path.read_text().splitlines() if line.strip())
    commits: list[str | None] = []
    head: str | None = None
    for line in out.splitlines():
        if line.startswith("\t"):
            if line[1:].strip():
                commits.append(None if set(head or "0") == {"0"} else head)
        elif head is None or _is_header(line):
            head = line.split()[0][:7]
    return commits


def _is_header(line: str) -> bool:
    first = line.split(" ", 1)[0]
    return len(first) == 40 and all(c in "0123456789abcdef" for c in first)


def added_in(path: str | pathlib.Path) -> str | None:
    """The short commit that added ``path`` (``git log --diff-filter=A``), None if uncommitted."""
    out = (_git("log", "--diff-filter=A", "--format=%h", "--", str(path)) or "").split()
    return out[-1][:7] if out else None


def lookup(row: Mapping, key: str) -> Any:
    """``row[key]``, or a dotted path into nested dicts (``stage_p99_ms.prepare``; a key that
    itself holds a dot, ``server_latency_ms.p99.9``, is found too); None if absent."""
    if not isinstance(row, Mapping):
        return None
    if key in row:
        return row[key]
    for i, c in enumerate(key):
        if c == "." and key[:i] in row:
            value = lookup(row[key[:i]], key[i + 1 :])
            if value is not None:
                return value
    return None


_SCALED = re.compile(r"^(?P<key>.+?)(?P<op>[*/])(?P<factor>[0-9][0-9.]*(?:e[-+]?[0-9]+)?)$")


def column(row: Mapping, spec: str) -> Any:
    """A table column's value: ``lookup(row, spec)``, or a number scaled by a constant when the
    key is not in the row as written: ``bytes/1e9`` (GB), ``ms_per_frame_step*2``."""
    value = lookup(row, spec)
    m = _SCALED.match(spec)
    if value is not None or m is None:
        return value
    base = lookup(row, m["key"])
    if not isinstance(base, (int, float)) or isinstance(base, bool):
        return None
    factor = float(m["factor"])
    return base * factor if m["op"] == "*" else base / factor


def matches(row: Mapping, where: Sequence[str]) -> bool:
    """Whether ``row`` meets every condition: ``key=value``, ``key!=value``, where ``value`` is
    JSON (``56``, ``true``, ``null``: also a missing key) or else text, an empty value is null or
    empty text, and ``a|b`` means either."""
    for cond in where:
        key, op, text = _split_condition(cond)
        value = lookup(row, key)
        hit = any(_equal(value, v) for v in text.split("|"))
        if hit != (op == "="):
            return False
    return True


def _split_condition(cond: str) -> tuple[str, str, str]:
    if "!=" in cond:
        key, text = cond.split("!=", 1)
        return key, "!=", text
    if "=" not in cond:
        raise ValueError(f"a condition is key=value or key!=value: {cond!r}")
    key, text = cond.split("=", 1)
    return key, "=", text


def _equal(value: Any, text: str) -> bool:
    """Whether a row's value is the one a condition spells (``matches``)."""
    if text == "":
        return value in (None, "")
    wanted = _cell(text)
    if isinstance(value, bool) or isinstance(wanted, bool):
        return value is wanted
    return value == wanted or (value is not None and str(value) == str(wanted))


def cell(value: Any, spec: str = "") -> str:
    """A value as a table cell: ``spec`` (a format spec) if given; else an int as is, a float to
    four significant digits without an exponent (1e-4 to 1e9), text as is, a list or dict as
    compact JSON, null as a dash."""
    if value is None:
        return MISSING
    if spec and not isinstance(value, bool):
        try:
            return format(value, spec)
        except (TypeError, ValueError):
            pass
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0:
            return str(value) if value else "0"
        if not 1e-4 <= abs(value) < 1e9:
            return f"{value:.4g}"
        decimals = max(0, 3 - math.floor(math.log10(abs(value))))
        text = f"{value:.{decimals}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value).replace("|", "\\|")


def table(
    rows: Iterable[Mapping],
    columns: Sequence[str],
    *,
    headers: Sequence[str] | None = None,
    where: Sequence[str] = (),
    sort: Sequence[str] = (),
) -> str:
    """A markdown table of ``rows``: one line per row meeting ``where`` (``matches``), ordered
    by the ``sort`` keys (``-key``: descending; nulls first), one column per ``columns`` entry
    (``key`` or ``key:spec``, ``cell``; ``key`` may be scaled, ``column``), headed by
    ``headers`` (default: the keys). Columns whose values are all numbers are right-aligned."""
    specs = [c.split(":", 1) if ":" in c else (c, "") for c in columns]
    keys = [k for k, _ in specs]
    headers = list(headers) if headers else keys
    if len(headers) != len(keys):
        raise ValueError(f"{len(headers)} headers for {len(keys)} columns")
    chosen = [r for r in rows if matches(r, where)]
    for key in reversed(sort):
        name = key.removeprefix("-")
        chosen.sort(key=lambda r, n=name: _order(column(r, n)), reverse=key.startswith("-"))
    values = [[column(r, k) for k in keys] for r in chosen]
    numeric = [
        all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in col)
        for col in zip(*values, strict=True)
    ] or [False] * len(keys)
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    for vals in values:
        cells = [cell(v, s) for v, (_, s) in zip(vals, specs, strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _order(value: Any) -> tuple:
    if value is None:
        return (0, 0, "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (1, value, "")
    return (2, 0, str(value))


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags: defined only when this module runs as the program, so that
    importing it beside an experiment's own flags clashes with none of them."""
    flags.DEFINE_list("normalize", None, "Row files to rewrite in place as normalised JSON lines.")
    flags.DEFINE_multi_string(
        "default", [], "With --normalize: key=value, a provenance value for the rows that lack it."
    )
    flags.DEFINE_multi_string(
        "source", [], "With --normalize: key=text, where that --default value came from."
    )
    flags.DEFINE_string("today", None, "With --normalize: the date in the note (default: today).")
    flags.DEFINE_list("ignore_rev", [], "With --normalize: commits git blame looks past.")
    flags.DEFINE_list("table", None, "Row files whose rows --columns prints as a markdown table.")
    flags.DEFINE_list("columns", None, "With --table: key or key:format-spec, one per column.")
    flags.DEFINE_list("headers", None, "With --table: the column headers (default: the keys).")
    flags.DEFINE_multi_string("where", [], "With --table: key=value or key!=value (a|b: either).")
    flags.DEFINE_list("sort", [], "With --table: keys to order the rows by (-key: descending).")


def normalize_file(
    path: str | pathlib.Path,
    defaults: Mapping[str, Any] | None = None,
    *,
    sources: Mapping[str, str] | None = None,
    today: str | None = None,
    ignore_revs: Sequence[str] = (),
) -> pathlib.Path:
    """Rewrite a row file as normalised JSON lines (a ``.json`` or ``.csv`` file becomes the
    ``.jsonl`` beside it and is removed); each row's ``recorded_in`` is the commit that added its
    line (``blame``; the file's, for a ``.json`` or ``.csv``). Returns the path written."""
    path = pathlib.Path(path)
    rows = load(path)
    if path.suffix == ".jsonl":  # each line's own commit
        recorded = blame(path, ignore_revs)
        how = " ".join(["git blame", *(f"--ignore-rev={r}" for r in ignore_revs)])
    else:
        recorded, how = [added_in(path)] * len(rows), "git log --diff-filter=A"
    sources = {"recorded_in": how, **(sources or {})}
    out = [
        normalize(r, {**(defaults or {}), "recorded_in": c}, sources=sources, today=today)
        for r, c in zip(rows, recorded, strict=True)
    ]
    target = path.with_suffix(".jsonl")
    dump(out, target)
    if target != path:
        path.unlink()
    return target


def _pairs(items: Sequence[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def main(argv: Sequence[str]) -> None:
    del argv
    if FLAGS.normalize:
        # text as given (a commit of digits stays a string); "null" for a value not recorded
        defaults = {k: None if v == "null" else v for k, v in _pairs(FLAGS.default).items()}
        for path in FLAGS.normalize:
            target = normalize_file(
                path,
                defaults,
                sources=_pairs(FLAGS.source),
                today=FLAGS.today,
                ignore_revs=FLAGS.ignore_rev,
            )
            print(f"{path} -> {target}")
    if FLAGS.table:
        if not FLAGS.columns:
            raise app.UsageError("--table needs --columns")
        rows = [r for path in FLAGS.table for r in load(path)]
        print(table(rows, FLAGS.columns, headers=FLAGS.headers, where=FLAGS.where, sort=FLAGS.sort))


if __name__ == "__main__":
    define_flags()
    app.run(main)
