"""The CI entry point's own pieces: the suite-time guard and what ``.ci/run`` runs."""

from __future__ import annotations

import importlib.util
import pathlib
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("suite_time", REPO / ".ci" / "suite_time.py")
suite_time = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite_time)

QUIET = "628 passed, 3 skipped in 412.34s (0:06:52)"
RULED = "============ 1 failed, 627 passed, 3 skipped in 611.02s (0:10:11) ============"


@pytest.mark.parametrize(("line", "seconds"), [(QUIET, 412.34), (RULED, 611.02)])
def test_guard_reads_pytests_closing_line(line, seconds):
    text = f"slowest 25 durations\n30.1s call tests/test_x.py::test_y\n{line}\n"
    assert suite_time.suite_seconds(text) == seconds


def test_guard_passes_within_the_limit_and_fails_past_it(tmp_path, capsys):
    log = tmp_path / "pytest.log"
    log.write_text(f"....\n{QUIET}\n")
    assert suite_time.main(["suite_time.py", str(log), "600"]) == 0
    assert capsys.readouterr().err == ""  # pytest's line stays the last one
    assert suite_time.main(["suite_time.py", str(log), "400"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["suite time guard: the suite took 412 s, over the 400 s limit; "
                   "see the slowest tests above (pytest --durations)"]  # fmt: skip


def test_guard_fails_without_a_closing_line(tmp_path, capsys):
    log = tmp_path / "pytest.log"
    log.write_text("ImportError while loading conftest\n")
    assert suite_time.main(["suite_time.py", str(log), "600"]) == 1
    assert "no pytest closing line" in capsys.readouterr().err


def test_ci_runs_the_readme_command_and_the_guard():
    """``.ci/run`` runs the README's test command as written, then the guard (900 s); the suite's
    options print the 25 slowest tests."""
    readme = (REPO / "README.md").read_text()
    command = 'python3 -m pip install -e ".[test]" && python3 -m pytest -q'
    assert command in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert command in ci
    assert 'suite_time.py "$log" "${SUITE_LIMIT_S:-900}"' in ci
    opts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--durations=25" in opts["addopts"].split()
