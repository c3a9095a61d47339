"""The beat clock: when tick ``k`` starts and when its output is due (docs/serving.md §2).

Realtime mode: tick ``k`` starts at ``t0 + k * P`` on a monotonic clock. A host that is early
sleeps until the start; a host that is late starts at once and is told how late. The clock never
runs ticks back to back to catch up: after a stall the next tick is the one whose slot the wall
clock is in now (``next_tick``), and the beats in between are *skipped*, i.e. missed for every live
session. A live call cannot be paused, so the server keeps to the wall clock rather than let a
backlog (and the call's latency) grow.

Offline mode (file runs, benchmarks of raw throughput): ticks run back to back; tick ``k`` starts
when ``wait_for_tick(k)`` is called, which the host does as soon as tick ``k - 1``'s output is
read. Nothing is skipped and nothing is late.

The time source and the sleep are injectable so that tests run on a fake clock.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

REALTIME = "realtime"
OFFLINE = "offline"
_MODES = (REALTIME, OFFLINE)
_KEEP_STARTS = 64  # offline start times remembered for ``deadline(k)`` of recent ticks


@dataclasses.dataclass(frozen=True)
class TickTiming:
    """When one tick started, how late the host was for it, and when its output is due.

    Times are seconds on the clock's time source.
    """

    tick: int
    start: float  # realtime: the scheduled start t0 + k*P; offline: when the tick began
    began: float  # when ``wait_for_tick`` returned (>= start)
    deadline: float  # start + deadline_s
    late_s: float  # began - start: how late the host was for this tick (0 when on time)
    skipped: int  # ticks skipped between the previous waited tick and this one


class BeatClock:
    """A monotonic beat clock with period ``period_s``; see the module docstring.

    Args:
      period_s: ``P``, seconds per tick (``frames_per_tick * 0.08``).
      mode: ``"realtime"`` or ``"offline"``.
      deadline_s: seconds from a tick's start to its deadline; defaults to ``period_s``. A tighter
        deadline (< ``P``) leaves room for the network; a looser one is refused.
      now: the monotonic time source (seconds).
      sleep: blocks for the given seconds; tests pass one that advances a fake ``now``.
    """

    def __init__(
        self,
        period_s: float,
        mode: str = REALTIME,
        *,
        deadline_s: float | None = None,
        now: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        deadline_s = period_s if deadline_s is None else deadline_s
        if not 0 < deadline_s <= period_s:
            raise ValueError(f"deadline_s must be in (0, period_s={period_s}], got {deadline_s}")
        self.period_s = period_s
        self.mode = mode
        self.deadline_s = deadline_s
        self._now = now
        self._sleep = sleep
        self._t0: float | None = None
        self._starts: dict[int, float] = {}  # offline: recent tick starts
        self._last_tick: int | None = None
        self.skipped_total = 0
        self.late_ticks = 0

    @property
    def t0(self) -> float | None:
        """The start of tick 0 (None before ``begin``)."""
        return self._t0

    def begin(self, t0: float | None = None) -> float:
        """Starts the clock: tick 0 starts at ``t0`` (default: now). Returns ``t0``."""
        self._t0 = self._now() if t0 is None else t0
        self._starts.clear()
        self._last_tick = None
        return self._t0

    def tick_start(self, k: int) -> float:
        """The start of tick ``k`` (offline: only for a tick already waited for)."""
        if self.mode == REALTIME:
            return self._require_t0() + k * self.period_s
        if k not in self._starts:
            raise KeyError(f"offline tick {k} has not started (or is too old to be remembered)")
        return self._starts[k]

    def deadline(self, k: int) -> float:
        """The deadline of tick ``k``: its start plus ``deadline_s``."""
        return self.tick_start(k) + self.deadline_s

    def due_tick(self) -> int:
        """Realtime: the latest tick whose start has passed (-1 before tick 0)."""
        t0 = self._require_t0()
        now = self._now()
        k = math.floor((now - t0) / self.period_s)
        # Float division can land just below an exact boundary; the start times decide.
        if t0 + (k + 1) * self.period_s <= now:
            k += 1
        elif t0 + k * self.period_s > now:
            k -= 1
        return k

    def next_tick(self, last_tick: int | None) -> int:
        """The tick to run after ``last_tick`` (None: the first).

        Realtime: ``last_tick + 1`` or, if the host is so late that a later tick has already
        started, that later tick: the beats in between are skipped, never run as a burst.
        Offline: always ``last_tick + 1``.
        """
        after = -1 if last_tick is None else last_tick
        if self.mode == OFFLINE:
            return after + 1
        return max(after + 1, self.due_tick())

    def wait_for_tick(self, k: int) -> TickTiming:
        """Blocks until tick ``k`` starts (realtime) and returns its timing.

        Realtime: sleeps until ``t0 + k*P`` if early; if late, returns at once with ``late_s``
        set. It runs nothing and catches nothing up: ask ``next_tick`` which tick to run.
        Offline: returns at once; tick ``k`` starts now.
        """
        if self.mode == REALTIME:
            start = self.tick_start(k)
            # Loop because a sleep may wake early; the monotonic source decides.
            while (remaining := start - self._now()) > 0:
                self._sleep(remaining)
            began = self._now()
        else:
            began = start = self._now()
            self._starts[k] = start
            for old in [t for t in self._starts if t <= k - _KEEP_STARTS]:
                del self._starts[old]
        skipped = 0 if self._last_tick is None else max(0, k - self._last_tick - 1)
        self._last_tick = k
        self.skipped_total += skipped
        late_s = began - start
        if late_s > 0:
            self.late_ticks += 1
        return TickTiming(
            tick=k,
            start=start,
            began=began,
            deadline=start + self.deadline_s,
            late_s=late_s,
            skipped=skipped,
        )

    def _require_t0(self) -> float:
        if self._t0 is None:
            raise RuntimeError("BeatClock.begin() must be called before realtime ticks")
        return self._t0
