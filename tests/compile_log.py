"""Where the suite's compile time goes: a pytest plugin that logs JAX's trace, lowering and XLA
compile durations per test, and a summary of the logs.

    COMPILE_LOG_DIR=/tmp/complog python3 -m pytest -q -p tests.compile_log
    python3 -m tests.compile_log /tmp/complog

Each pytest process (every pytest-xdist worker) writes ``<pid>.jsonl`` into ``COMPILE_LOG_DIR``
at its end: one row per event of ``jax.monitoring`` whose name holds "compile", "trace" or
"mlir", as ``[test node id, event, function name, seconds]``, and two rows a test of the CPU
seconds it took (setup, call and teardown), its own (``cpu_self``, every thread of the worker)
and its finished subprocesses' (``cpu_children``); a module- or session-scoped fixture's compiles
and CPU count against the first test that set it up. Subprocesses' events (the mesh worker,
``voicechat-serve`` runs) are not logged, only their CPU. The events' seconds are wall time
inside the process: with three workers on two cores they include the wait for a core.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys

import pytest

_EVENT_WORDS = ("compile", "trace", "mlir")

_current = {"test": "<collection>"}
_rows: list[list] = []


def _listen(event: str, seconds: float, **kwargs) -> None:
    if any(w in event for w in _EVENT_WORDS) and "saved" not in event:
        _rows.append([_current["test"], event.rsplit("/", 1)[-1], kwargs.get("fun_name", ""),
                      round(seconds, 4)])  # fmt: skip


def pytest_configure(config) -> None:
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listen)


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def pytest_runtest_setup(item) -> None:
    _current["test"] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    own, children = _cpu(resource.RUSAGE_SELF) - start[0], _cpu(resource.RUSAGE_CHILDREN) - start[1]
    _rows.append([item.nodeid, "cpu_self", "", round(own, 3)])
    _rows.append([item.nodeid, "cpu_children", "", round(children, 3)])


def pytest_sessionfinish(session) -> None:
    out = os.environ.get("COMPILE_LOG_DIR")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{os.getpid()}.jsonl"), "w") as f:
        for row in _rows:
            f.write(json.dumps(row) + "\n")


def summary(log_dir: str, top: int = 20) -> str:
    """The logs of ``log_dir`` summed: by event, by file, and the programs compiled most."""
    rows = []
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".jsonl"):
            with open(os.path.join(log_dir, name)) as f:
                rows += [json.loads(line) for line in f]
    by_event, by_file = collections.Counter(), collections.Counter()
    by_fn, count = collections.Counter(), collections.Counter()
    cpu_file, cpu_test = collections.Counter(), collections.Counter()
    for test, event, fn, seconds in rows:
        if event.startswith("cpu_"):
            cpu_file[test.split("::")[0]] += seconds
            cpu_test[test] += seconds
            continue
        by_event[event] += seconds
        by_file[test.split("::")[0]] += seconds
        if event == "backend_compile_duration":
            by_fn[fn] += seconds
            count[fn] += 1
    lines = [f"{len(rows)} events in {log_dir}", "", "seconds by event:"]
    lines += [f"  {v:8.1f}  {k}" for k, v in by_event.most_common()]
    lines += ["", f"seconds by test file (top {top}):"]
    lines += [f"  {v:8.1f}  {k}" for k, v in by_file.most_common(top)]
    # a primitive run outside jit compiles as jit(<primitive>): jit(add), jit(broadcast_in_dim), ...
    lines += ["", f"XLA compiles by function (top {top}): seconds, count"]
    lines += [f"  {v:8.1f}  {count[k]:5d}  {k}" for k, v in by_fn.most_common(top)]
    if cpu_file:
        total = sum(cpu_file.values())
        lines += ["", f"CPU seconds (the workers' and their subprocesses'): {total:.1f}"]
        lines += [f"by test file (top {top}):"]
        lines += [f"  {v:8.1f}  {k}" for k, v in cpu_file.most_common(top)]
        lines += [f"by test (top {top}):"]
        lines += [f"  {v:8.1f}  {k}" for k, v in cpu_test.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 -m tests.compile_log LOG_DIR")
    sys.stdout.write(summary(sys.argv[1]) + "\n")
