"""The policy simulator's figure from its rows, through the experiments' one plotting path
(``experiments.plot``): ``run.py`` calls ``plot``, or run it on a file::

  PYTHONPATH=. python3 experiments/policy_sim/plot.py \
      experiments/policy_sim/results/rows_current.jsonl out.png
"""

from __future__ import annotations

import sys
from typing import Any

from experiments import plot as lines_lib
from experiments import rows as rows_lib

BEAT_MS = 160.0


def plot(rows: list[dict], path: str) -> None:
    """Four panels: the fit, the validation, p99 against sessions per policy, the hour of calls."""

    def kind(k: str) -> list[dict]:
        return [r for r in rows if r["kind"] == k]

    def beat(a: Any) -> None:
        lines_lib.rule(a, BEAT_MS, color="grey", lw=0.8, ls="--")

    fig, ax = lines_lib.figure(2, 2, size=(11, 8))
    Y = lines_lib.Y

    a = ax[0, 0]
    m = kind("model")[0]
    curve = [
        {"slots": b, "ms": 2 * (m["a_ms"] + (m["b_ms"] + m["c_ms"]) * b)} for b in range(1, 129)
    ]
    lines_lib.lines(
        a, kind("fit"), "slots", [Y("measured_ms*2", "o", label="measured")], sort=False
    )
    lines_lib.lines(a, curve, "slots", [Y("ms", "-", label="fit")])
    beat(a)
    rows_of = {"capacity": "capacity rows, x = 1", "beat_profile": "beat_profile rows"}
    title = f"step cost, cap 1,500 ({rows_of.get(m.get('source', 'beat_profile'))})"
    a.set(xlabel="slots B", ylabel="tick device ms (2 frames)", title=title)
    a.legend()

    a = ax[0, 1]
    lines_lib.lines(a, kind("validation"), "sessions", [
        Y("real_p50_ms", "o-", label="real p50"), Y("sim_p50_ms", "s--", label="sim p50"),
        Y("real_p99_ms", "o-", label="real p99"), Y("sim_p99_ms", "s--", label="sim p99"),
    ], sort=False)  # fmt: skip
    beat(a)
    a.set(xlabel="sessions (= slots)", ylabel="beat latency ms", title="lockstep: sim vs H200")
    a.legend()

    a = ax[1, 0]
    lines_lib.lines(a, kind("policy"), "sessions", [Y("p99_ms", ".-", label="{group}")],
                    group="policy")  # fmt: skip
    beat(a)
    a.set(xscale="log", yscale="log", xlabel="sessions", ylabel="p99 latency ms",
          title="policies (simulated)")  # fmt: skip
    a.legend(fontsize=8)

    a = ax[1, 1]
    hour = kind("hour")
    lines_lib.lines(a, hour, "erlangs", [Y("busy_frac", ".-", label="device busy, {group}")],
                    group="variant", sort=False)  # fmt: skip
    refused = [{**r, "frac": r["refused"] / max(r["offered"], 1)} for r in hour
               if r["variant"] == "fixed"]  # fmt: skip
    lines_lib.lines(a, refused, "erlangs", [Y("frac", "x-", label="refused fraction")], sort=False)
    a.set(xlabel="offered load (Erlangs)", ylabel="fraction", title="an hour of Poisson calls")
    a.legend(fontsize=8)
    lines_lib.save(fig, path, dpi=110)


if __name__ == "__main__":
    plot(rows_lib.load(sys.argv[1]), sys.argv[2])
