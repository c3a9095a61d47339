"""The policy simulator's figure from its rows (``run.py`` calls ``plot``, or run it on a file)."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(rows: list[dict], path: str) -> None:
    """Four panels: the fit, the validation, p99 against sessions per policy, the hour of calls."""

    def kind(k):
        return [r for r in rows if r["kind"] == k]

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    a = ax[0, 0]
    fit = kind("fit")
    m = kind("model")[0]
    bs = list(range(1, 129))
    a.plot([r["slots"] for r in fit], [2 * r["measured_ms"] for r in fit], "o", label="measured")
    a.plot(bs, [2 * (m["a_ms"] + (m["b_ms"] + m["c_ms"]) * b) for b in bs], "-", label="fit")
    a.axhline(160, color="grey", lw=0.8, ls="--")
    rows_of = {"capacity": "capacity rows, x = 1", "beat_profile": "beat_profile rows"}
    title = f"step cost, cap 1,500 ({rows_of.get(m.get('source', 'beat_profile'))})"
    a.set(xlabel="slots B", ylabel="tick device ms (2 frames)", title=title)
    a.legend()

    a = ax[0, 1]
    val = kind("validation")
    n = [r["sessions"] for r in val]
    a.plot(n, [r["real_p50_ms"] for r in val], "o-", label="real p50")
    a.plot(n, [r["sim_p50_ms"] for r in val], "s--", label="sim p50")
    a.plot(n, [r["real_p99_ms"] for r in val], "o-", label="real p99")
    a.plot(n, [r["sim_p99_ms"] for r in val], "s--", label="sim p99")
    a.axhline(160, color="grey", lw=0.8, ls="--")
    a.set(xlabel="sessions (= slots)", ylabel="beat latency ms", title="lockstep: sim vs H200")
    a.legend()

    a = ax[1, 0]
    pol = kind("policy")
    for name in dict.fromkeys(r["policy"] for r in pol):
        rs = sorted((r for r in pol if r["policy"] == name), key=lambda r: r["sessions"])
        a.plot([r["sessions"] for r in rs], [r["p99_ms"] for r in rs], ".-", label=name)
    a.axhline(160, color="grey", lw=0.8, ls="--")
    a.set(xscale="log", yscale="log", xlabel="sessions", ylabel="p99 latency ms",
          title="policies (simulated)")  # fmt: skip
    a.legend(fontsize=8)

    a = ax[1, 1]
    hr = kind("hour")
    for variant in dict.fromkeys(r["variant"] for r in hr):
        rs = [r for r in hr if r["variant"] == variant]
        a.plot([r["erlangs"] for r in rs], [r["busy_frac"] for r in rs], ".-",
               label=f"device busy, {variant}")  # fmt: skip
    rs = [r for r in hr if r["variant"] == "fixed"]
    a.plot([r["erlangs"] for r in rs], [r["refused"] / max(r["offered"], 1) for r in rs], "x-",
           label="refused fraction")  # fmt: skip
    a.set(xlabel="offered load (Erlangs)", ylabel="fraction", title="an hour of Poisson calls")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot([json.loads(line) for line in f if line.strip()], sys.argv[2])
