"""The engine part's burst, replayed without audio or a device, and simulated on the H200 fit.

``run.py``'s engine part serves a scripted burst (``burst_schedule``: who joins and leaves when)
through ``scheduler.AdmissionControl`` on the real server. Here the same schedule is replayed:

- ``replay_burst``: beat by beat as the server admits it (``ScriptedSessions`` and
  ``AdmissionControl``: a call leaves at its scripted beat, whenever it was admitted), giving who
  was admitted when, the counts the engine rows carry, each beat's live count and cache fill;
- ``admit_calls_counts``: through the simulator's ``sim.admit_calls`` with the beat as time unit
  (an admitted call lasts its whole length from its admission);
- ``simulate_burst``: the dispatch loop (``sim.simulate_lockstep``) on a fit's step cost, host
  overhead and jitter, with that live count and fill.

Pure functions (no flags), so that tests can import them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from experiments.policy_sim import sim

BURST_SEED = 5  # the seed of the engine part's burst (``run.burst_plans``)
FRAMES_PER_TICK = 2
# The burst setup of the first H200 rows (2026-12-03, README's command), which do not carry it:
# rows without these fields are replayed with these values.
FIRST_ROWS_SETUP = {"burst_beats": 10, "mean_call_beats": 150, "ticks": 300}


def burst_schedule(
    n: int, burst_beats: int, mean_call_beats: float, seed: int = BURST_SEED
) -> list[tuple[int, int]]:
    """``(join, leave)`` beats of the burst's ``n`` calls, in the order drawn (call ``i`` is the
    engine part's session ``b{i:03d}``): each joins at a uniform beat below ``burst_beats`` and
    leaves ``1 + floor(exponential(mean_call_beats))`` beats later (released before that beat)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        join = int(rng.integers(0, burst_beats))
        leave = join + 1 + int(rng.exponential(mean_call_beats))
        out.append((join, leave))
    return out


@dataclasses.dataclass
class BurstReplay:
    """What the server's admission did to a burst, beat by beat (``replay_burst``)."""

    admitted_at: dict[int, int]  # call index -> beat admitted
    ended_at: dict[int, int]  # call index -> beat released (calls released within the run)
    refused: int
    queued: int  # calls that waited at least one beat (AdmissionControl.queued)
    waited_beats: int  # beats waited in all, admitted or not (AdmissionControl.waited_beats)
    live: np.ndarray  # [ticks] sessions live at each beat
    fill_frames: np.ndarray  # [ticks] mean cache fill over the slots, frames (free slots: 0)
    live_at_end_waits: list[int]  # admitted beat - join beat of each call live at the end
    withdrawn: int = 0  # calls whose leave came while they waited (refused then: a failure)

    @property
    def admitted(self) -> int:
        return len(self.admitted_at)

    @property
    def ended(self) -> int:
        return len(self.ended_at)

    def session_beats(self, warmup: int) -> int:
        """Session-beats served from beat ``warmup`` on (the metrics' steady ones)."""
        return int(self.live[warmup:].sum())


def live_and_fill(
    spans: Sequence[tuple[int, int | None]],
    ticks: int,
    slots: int,
    *,
    frames_per_tick: int = FRAMES_PER_TICK,
    context_frames: int = sim.CAP_FRAMES,
) -> tuple[np.ndarray, np.ndarray]:
    """Each beat's live count and mean cache fill (frames) over ``slots`` slots.

    ``spans``: ``(admitted, released)`` beats of each call (``None``: not released within the
    run). A call admitted at beat ``s`` is live at beats ``s <= k < released`` and holds
    ``frames_per_tick * (k - s)`` frames at beat ``k`` (capped at ``context_frames``); free slots
    hold 0.
    """
    live = np.zeros(ticks, np.int64)
    total = np.zeros(ticks)
    k = np.arange(ticks)
    for s, e in spans:
        on = (k >= s) & (k < (ticks if e is None else e))
        live += on
        total += np.where(on, np.minimum(frames_per_tick * (k - s), context_frames), 0)
    return live, total / slots


def replay_burst(
    schedule: Sequence[tuple[int, int]],
    *,
    slots: int,
    queue_beats: int,
    ticks: int,
    frames_per_tick: int = FRAMES_PER_TICK,
    context_frames: int = sim.CAP_FRAMES,
    withdraw_at_leave: bool = True,
) -> BurstReplay:
    """The server's admission of ``schedule`` (``burst_schedule``), beat by beat.

    ``withdraw_at_leave``: the server's rule since the H200 rows (a call whose leave comes while
    it waits is refused at that beat and gives up its place in the queue); False: the rule of
    ``b7b4b9a``, the rows' commit (its leave was dropped, and it was admitted later and held its
    slot to the end of the run).

    As ``Server.prepare`` with ``ScriptedSessions`` and ``AdmissionControl(Lockstep(),
    queue_beats=)`` (every slot is the limit): before beat ``k`` the calls whose scripted leave is
    ``k`` are released, if live; then the calls waiting (in the order they came) and those joining
    at ``k`` (in the order of the schedule sorted by join beat) are asked in turn: admitted if a
    slot is free and no one asked earlier is still waiting, else they wait until ``queue_beats``
    beats have passed since they first asked and are refused then. A call leaves at its scripted
    beat whenever it was admitted (with ``withdraw_at_leave=False``, one admitted at or after that
    beat is never released within the run). Every beat is assumed
    to run (no beat skipped: a skipped beat's joins would be lost). The server releases a call at
    the context cap, some beats after the writer sees it there; that is not modelled, so a run
    long enough for a call to reach the cap (``ticks * frames_per_tick > context_frames``) is
    refused with a ``ValueError``.
    """
    if ticks * frames_per_tick > context_frames:
        raise ValueError(
            f"{ticks} beats of {frames_per_tick} frames can reach the {context_frames}-frame "
            "context cap, where the server releases calls: not modelled here"
        )
    order = sorted(range(len(schedule)), key=lambda i: schedule[i][0])  # stable: as burst_plans
    by_join: dict[int, list[int]] = collections.defaultdict(list)
    by_leave: dict[int, list[int]] = collections.defaultdict(list)
    for i in order:
        by_join[schedule[i][0]].append(i)
        by_leave[schedule[i][1]].append(i)
    live: dict[int, int] = {}  # call -> beat admitted
    admitted_at: dict[int, int] = {}
    ended_at: dict[int, int] = {}
    first_asked: dict[int, int] = {}
    waiting: list[int] = []
    refused = queued = waited = withdrawn = 0
    for k in range(ticks):
        for i in by_leave.pop(k, ()):
            if i in live:
                del live[i]
                ended_at[i] = k
            elif withdraw_at_leave and i in waiting:  # hung up in the queue
                waiting.remove(i)
                del first_asked[i]
                withdrawn += 1
        asking, waiting = [*waiting, *by_join.get(k, ())], []
        for i in asking:
            first = first_asked.get(i)
            ahead = any(t < (k if first is None else first) for t in first_asked.values())
            if len(live) < slots and not ahead:
                first_asked.pop(i, None)
                live[i] = admitted_at[i] = k
                continue
            if first is None:
                first = first_asked[i] = k
                if queue_beats:
                    queued += 1
            if k - first < queue_beats:
                waited += 1
                waiting.append(i)
                continue
            del first_asked[i]
            refused += 1
    spans = [(s, ended_at.get(i)) for i, s in admitted_at.items()]
    live_k, fill = live_and_fill(
        spans, ticks, slots, frames_per_tick=frames_per_tick, context_frames=context_frames
    )
    return BurstReplay(
        admitted_at=admitted_at,
        ended_at=ended_at,
        refused=refused,
        queued=queued,
        waited_beats=waited,
        live=live_k,
        fill_frames=fill,
        live_at_end_waits=sorted(admitted_at[i] - schedule[i][0] for i in live),
        withdrawn=withdrawn,
    )


def admit_calls_counts(
    schedule: Sequence[tuple[int, int]], *, slots: int, queue_beats: int, ticks: int, warmup: int
) -> dict:
    """``sim.admit_calls`` on ``schedule`` with the beat as time unit (a call arrives at its join
    beat and lasts ``leave - join`` beats from its admission): the engine rows' counts.

    ``queued``: with a queue, the calls refused and those admitted after a wait (every call that
    found the server full waited); ``waited_beats``: ``queue_beats`` per refused call plus the
    admitted calls' waits; ``session_beats``: live calls summed from beat ``warmup`` on.
    """
    order = sorted(range(len(schedule)), key=lambda i: schedule[i][0])
    arr = np.asarray([schedule[i][0] for i in order], float)
    dur = np.asarray([schedule[i][1] - schedule[i][0] for i in order], float)
    ad = sim.admit_calls(
        arr, dur, max_live=slots, queue_s=float(queue_beats), n_beats=ticks, period_ms=1e3
    )
    waits = ad.waited_s
    return {
        "refused": ad.refused,
        "admitted": int(waits.size),
        "queued": ad.refused + int((waits > 0).sum()) if queue_beats else 0,
        "waited_beats": round(queue_beats * ad.refused + float(waits.sum())),
        "session_beats": int(ad.live[warmup:].sum()),
    }


def simulate_burst(
    fit: sim.H200Fit,
    replay: BurstReplay,
    *,
    slots: int,
    warmup: int,
    fill: bool,
    seeds: int = 5,
) -> dict:
    """The dispatch loop serving the replayed burst on ``fit`` (step cost, host overhead, jitter).

    Every tick runs all ``slots`` (lockstep); its step cost is at the beat's mean fill
    (``replay.fill_frames / 1500``) if ``fill``, else at full caches (``x = 1``). Latency
    percentiles over the beats from ``warmup`` on (the engine rows' steady ticks), each the mean
    over ``seeds`` seeds; ``missed``: the steady beats late or skipped, and ``late_frac``: the
    steady session-beats they held, per steady session-beat, each the mean over seeds.
    """
    frac = replay.fill_frames / sim.CAP_FRAMES
    ticks = len(replay.live)
    held = replay.live[warmup:].astype(float)
    runs = []
    for s in range(seeds):
        res = sim.simulate_lockstep(
            fit.cost, ticks, lambda k: int(replay.live[k]), slots=slots, tail=fit.tail,
            rng=np.random.default_rng(s), context_frac=(lambda k: float(frac[k])) if fill else 1.0,
        )  # fmt: skip
        lat = res.latency_ms[warmup:]
        lat = lat[~np.isnan(lat)]
        late = res.missed[warmup:]
        runs.append((np.percentile(lat, 50), np.percentile(lat, 99), lat.max(), int(late.sum()),
                     (late * held).sum() / max(held.sum(), 1.0)))  # fmt: skip
    p50, p99, mx, missed, late_frac = (float(np.mean(v)) for v in zip(*runs, strict=True))
    return {"sim_p50_ms": p50, "sim_p99_ms": p99, "sim_max_ms": mx, "sim_missed": missed,
            "sim_late_frac": late_frac}  # fmt: skip
