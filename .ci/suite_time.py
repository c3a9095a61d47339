"""The suite-time guard of ``.ci/run``: fails when pytest's run took longer than a limit.

    python3 .ci/suite_time.py PYTEST_LOG LIMIT_S

Reads the seconds from pytest's own closing line (``== 612 passed, 3 skipped in 412.34s ==``, or
with ``-q`` the same without the rules) and exits 1 with one line when they pass ``LIMIT_S``, or
when no closing line is found; prints nothing when the suite is within the limit (so that
pytest's line stays the last one).
"""

from __future__ import annotations

import re
import sys

CLOSING = re.compile(r"^=*\s*\d+ (?:passed|failed|error).* in ([0-9.]+)s\b")


def suite_seconds(text: str) -> float | None:
    """The seconds of the last pytest closing line in ``text`` (None if there is none)."""
    found = None
    for line in text.splitlines():
        m = CLOSING.match(line.strip())
        if m:
            found = float(m.group(1))
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: suite_time.py PYTEST_LOG LIMIT_S\n")
        return 2
    with open(argv[1], errors="replace") as f:
        seconds = suite_seconds(f.read())
    limit = float(argv[2])
    if seconds is None:
        sys.stderr.write("suite time guard: no pytest closing line in the log\n")
        return 1
    if seconds > limit:
        sys.stderr.write(
            f"suite time guard: the suite took {seconds:.0f} s, over the {limit:.0f} s limit; "
            "see the slowest tests above (pytest --durations)\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
