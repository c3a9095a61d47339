"""experiments/rows.py: every committed row file in the one row format, and the README tables it
prints; every figure drawn through experiments/plot.py. Fast (no JAX): rows are read, normalised
and tabled in this process."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from experiments import rows

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
ROW_FILES = sorted(EXPERIMENTS.glob("*/results/**/*.jsonl"))


def test_every_row_file_is_json_lines_under_results():
    assert len(ROW_FILES) > 70
    # no rows in the older forms, nor beside an experiment's results folder
    older = [p for p in EXPERIMENTS.glob("*/results/**/*") if p.suffix in (".json", ".csv")]
    loose = [p for p in EXPERIMENTS.glob("*/*") if p.suffix in (".jsonl", ".json", ".csv")]
    assert not older, older
    assert not loose, loose


@pytest.mark.parametrize("path", ROW_FILES, ids=lambda p: str(p.relative_to(EXPERIMENTS)))
def test_every_committed_row_has_its_provenance(path):
    found = rows.load(path)
    assert found
    for r in found:
        missing = [k for k in rows.PROVENANCE if k not in r]
        assert not missing, (r, missing)
        # a value nobody recorded is null, and the row says what was backfilled and from where
        if any(r[k] is None for k in rows.PROVENANCE):
            assert r["provenance"].startswith("backfilled "), r
        assert rows.normalize(r) == r  # nothing left to fill


def test_normalize_fills_from_aliases_then_defaults_and_is_idempotent():
    row = {"kind": "serve", "p50_ms": 1.5, "device": "cpu", "date": "2026-12-02"}
    once = rows.normalize(
        row,
        {"jax": "0.10.2", "command": None, "recorded_in": "abc1234"},
        sources={"jax": "README.md", "recorded_in": "git blame"},
        today="2026-12-05",
    )
    assert once == {
        "kind": "serve",
        "p50_ms": 1.5,
        "device": "cpu",
        "date": "2026-12-02",
        "commit": None,
        "jax": "0.10.2",
        "command": None,
        "measured_at": "2026-12-02",
        "recorded_in": "abc1234",
        "provenance": "backfilled 2026-12-05 from README.md (jax); the row's 'date' "
        "(measured_at); git blame (recorded_in); not recorded: commit, command",
    }
    assert rows.normalize(once, {"commit": "ffff000"}, today="2027-01-01") == once
    assert row == {"kind": "serve", "p50_ms": 1.5, "device": "cpu", "date": "2026-12-02"}
    complete = {
        "x": 1,
        "commit": "c",
        "device": "d",
        "jax": "j",
        "command": "m",
        "measured_at": "t",
    }
    assert rows.normalize(complete, {"recorded_in": "r"}) == complete


def test_load_reads_the_older_forms(tmp_path):
    (tmp_path / "a.json").write_text('[{"x": 1}, {"x": 2.5}]')
    (tmp_path / "b.json").write_text('{"x": 3, "y": [1, 2]}')
    (tmp_path / "c.csv").write_text("x,y,z\n1,2.5,a\n,true,\n")
    assert rows.load(tmp_path / "a.json") == [{"x": 1}, {"x": 2.5}]
    assert rows.load(tmp_path / "b.json") == [{"x": 3, "y": [1, 2]}]
    assert rows.load(tmp_path / "c.csv") == [
        {"x": 1, "y": 2.5, "z": "a"},
        {"x": None, "y": True, "z": None},
    ]


def test_normalize_file_turns_an_older_form_into_json_lines(tmp_path):
    old = tmp_path / "rows.json"
    old.write_text('{"tensors": 1632, "convert_s": 130.5}')
    path = rows.normalize_file(old, {"device": "cpu"}, sources={"device": "README"}, today="D")
    assert path == tmp_path / "rows.jsonl"
    assert not old.exists()
    (row,) = rows.load(path)
    assert row == {
        "tensors": 1632,
        "convert_s": 130.5,
        "commit": None,
        "device": "cpu",
        "jax": None,
        "command": None,
        "measured_at": None,
        "provenance": "backfilled D from README (device); not recorded: commit, jax, command, "
        "measured_at",
    }
    text = path.read_text()
    assert rows.normalize_file(path, {"device": "gpu"}) == path
    assert path.read_text() == text


def test_table_renders_a_known_input_exactly():
    found = [
        {"kind": "serve", "sessions": 64, "p50_ms": 136.518, "stage": {"prepare": 2.25}},
        {"kind": "probe", "sessions": 56, "p50_ms": 0.0123456},
        {"kind": "serve", "sessions": 56, "p50_ms": 128.137, "stage": {"prepare": 1.5}, "ok": True},
        {"kind": "serve", "sessions": 72, "p50_ms": None, "note": "a|b", "ok": False},
    ]
    got = rows.table(
        found,
        ["sessions", "p50_ms", "p50_ms*2:.1f", "stage.prepare:.2f", "ok", "note"],
        headers=["n", "p50", "beat", "prepare", "ok", "note"],
        where=["kind=serve"],
        sort=["sessions"],
    )
    assert got == (
        "| n | p50 | beat | prepare | ok | note |\n"
        "|---:|---:|---:|---:|---|---|\n"
        "| 56 | 128.1 | 256.3 | 1.50 | yes | — |\n"
        "| 64 | 136.5 | 273.0 | 2.25 | — | — |\n"
        "| 72 | — | — | — | no | a\\|b |"
    )
    assert rows.cell(0.0123456) == "0.01235"
    assert rows.cell(10393.0) == "10393"
    assert rows.table(found, ["sessions"], where=["kind!=serve", "sessions=56|64"]) == (
        "| sessions |\n|---:|\n| 56 |"
    )


def _readme_commands() -> list[tuple[str, list[str]]]:
    """Every ``python3 -m experiments.rows`` command in the experiments' READMEs, its lines
    joined, as (README, arguments)."""
    out = []
    for readme in sorted(EXPERIMENTS.glob("*/README.md")):
        text = readme.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if "-m experiments.rows" in line:
                words = shlex.split(line.split("-m experiments.rows", 1)[1])
                out.append((readme.parent.name, words))
    return out


README_COMMANDS = _readme_commands()


def test_the_readmes_print_their_tables_from_rows():
    """Each README command reads committed rows, keeps at least one, and every column it asks
    for has a value in at least one of them (no misspelt key)."""
    assert len(README_COMMANDS) > 90
    for readme, words in README_COMMANDS:
        args: dict[str, list[str]] = {"where": []}
        for w in words:
            key, _, value = w.removeprefix("--").partition("=")
            if key == "where":
                args["where"].append(value)
            else:
                args[key] = value.split(",")
        found = [r for path in args["table"] for r in rows.load(REPO / path)]
        chosen = [r for r in found if rows.matches(r, args["where"])]
        assert chosen, (readme, words)
        for spec in args["columns"]:
            key = spec.split(":", 1)[0]
            assert any(rows.column(r, key) is not None for r in chosen), (readme, key)
        printed = rows.table(found, args["columns"], where=args["where"], sort=args.get("sort", []))
        assert printed.count("\n") == len(chosen) + 1


def test_matplotlib_is_imported_only_by_the_one_plotting_path():
    """Every experiment figure goes through ``experiments/plot.py`` (experiments/README.md, "One
    plotting path"): no other experiment file imports matplotlib."""
    imports = re.compile(r"^\s*(import|from)\s+matplotlib\b", re.MULTILINE)
    found = [
        str(p.relative_to(REPO)) for p in sorted(EXPERIMENTS.rglob("*.py"))
        if imports.search(p.read_text())
    ]  # fmt: skip
    assert found == ["experiments/plot.py"]


def test_a_device_call_names_the_commit_it_sent(monkeypatch):
    """A lent device's checkout keeps older git metadata: ``EXPERIMENTS_COMMIT`` names the tree."""
    from experiments import harness

    monkeypatch.setenv(harness.COMMIT_ENV, "752356b")
    assert harness.commit() == "752356b"
    monkeypatch.delenv(harness.COMMIT_ENV)
    assert harness.commit() != "752356b"
