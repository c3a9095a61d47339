"""Python's garbage collector on the beat: every pause recorded, collections moved into the slack.

A serving process holds some 300,000 GC-tracked objects (JAX, flax, NumPy, absl); one automatic
full (generation-2) collection walks them all and took 100-180 ms on this project's CPUs, with the
GIL held: a beat-sized stall at an arbitrary moment (docs/serving.md §6). Two pieces:

- ``GcMonitor`` records every collection of the process (``gc.callbacks``): when it started and
  ended, its generation, and whether the serving policy asked for it. The metrics attribute the
  pauses to the ticks they fell in.
- ``GcPolicy`` decides when collections run. ``"slack"`` (the server's default): once the engine is
  built and compiled, one full collection, then ``gc.freeze()`` (everything alive at start-up is
  moved to the permanent generation, which no later collection walks) and automatic collection off.
  The beat thread then collects only in a beat's slack (after the last beat's output is on the host,
  before the next beat starts), the generation that CPython's own thresholds say is due, and only if
  that generation's measured cost fits in the time left. ``"default"`` leaves the collector as
  Python runs it (automatic, at any allocation, in any thread): main's behaviour before this policy,
  kept for comparison (``experiments/host_jitter``).

Both are process-wide, as the collector is; ``GcPolicy.stop`` restores what it found.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import gc
import time
from collections.abc import Callable

_GENERATIONS = 3


class GcMode(enum.StrEnum):
    DEFAULT = "default"  # Python's automatic collector, untouched
    SLACK = "slack"  # frozen start-up heap; collections only in a beat's slack


@dataclasses.dataclass(frozen=True)
class GcPause:
    """One collection. Times in seconds on the monitor's time source."""

    start: float
    end: float
    generation: int
    collected: int  # unreachable objects found
    policy: bool  # run by ``GcPolicy`` in a beat's slack (False: automatic, or anyone's gc.collect)

    @property
    def seconds(self) -> float:
        return self.end - self.start


class GcMonitor:
    """Records every collection of the process while installed.

    Collections are produced by ``gc.callbacks`` in whichever thread collects and consumed by
    ``drain`` in one thread (the server's writer): the hand-over is a bounded deque, whose
    ``append`` and ``popleft`` are atomic, so neither side takes a lock (a lock taken inside a GC
    callback could deadlock against the thread the collection interrupted). At most ``maxlen``
    undrained pauses are kept; older ones are dropped and counted in ``dropped``.
    """

    def __init__(self, *, maxlen: int = 4096, now: Callable[[], float] = time.monotonic):
        self._now = now
        self._pauses: collections.deque[GcPause] = collections.deque(maxlen=maxlen)
        self._maxlen = maxlen
        self._started: float | None = None
        self._produced = 0
        self._drained = 0
        self.policy_active = False  # set by GcPolicy around its own collections
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def __enter__(self) -> GcMonitor:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _callback(self, phase: str, info: dict) -> None:
        # One collection runs at a time in the whole process (CPython's gc is not reentrant).
        if phase == "start":
            self._started = self._now()
            return
        end = self._now()
        start = end if self._started is None else self._started
        self._pauses.append(
            GcPause(start, end, info["generation"], info["collected"], self.policy_active)
        )
        self._produced += 1

    def drain(self) -> list[GcPause]:
        """The pauses recorded since the last call, oldest first (one consumer thread only)."""
        out = []
        while True:
            try:
                out.append(self._pauses.popleft())
            except IndexError:
                break
        self._drained += len(out)
        return out

    @property
    def dropped(self) -> int:
        """Pauses lost because ``drain`` fell more than ``maxlen`` behind."""
        return self._produced - self._drained - len(self._pauses)


class GcPolicy:
    """When the collector runs during a serving run; see the module docstring.

    Use ``start()`` once the engine is built and compiled (before the clock begins), ``in_slack``
    from the beat thread whenever it has time to spare before the next beat, and ``stop()`` at the
    end of the run (it restores the collector as ``start`` found it).

    Args:
      mode: ``"slack"`` or ``"default"`` (``GcMode``).
      monitor: marks the collections this policy runs as ``policy`` pauses.
      margin_s: time kept free before the next beat: a collection runs only if its estimated
        cost plus this margin fits in the slack.
    """

    def __init__(
        self,
        mode: str = GcMode.SLACK,
        *,
        monitor: GcMonitor | None = None,
        margin_s: float = 0.01,
        now: Callable[[], float] = time.monotonic,
    ):
        self.mode = GcMode(mode)
        self.monitor = monitor
        self.margin_s = margin_s
        self._now = now
        self._was_enabled: bool | None = None
        # Cost estimates per generation (seconds): a decaying maximum of the measured pauses.
        self.estimate_s = [0.002, 0.005, 0.05]
        self.collections = [0] * _GENERATIONS  # run in slack, per generation
        self.deferred = 0  # a due collection that did not fit in the slack it was offered
        self.running = False

    def start(self) -> None:
        """Full collection, freeze, automatic collection off (``slack``); ``default``: nothing."""
        if self.running:
            return
        self.running = True
        if self.mode != GcMode.SLACK:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._collect(2)
        gc.freeze()
        # What a full collection costs now that the start-up heap is frozen.
        t = self._now()
        self._collect(2)
        self.estimate_s[2] = max(self._now() - t, 0.001)

    def stop(self) -> None:
        """Unfreezes and gives the collector back as it was before ``start``."""
        if not self.running:
            return
        self.running = False
        if self.mode != GcMode.SLACK:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()

    def __enter__(self) -> GcPolicy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def due(self) -> int | None:
        """The generation CPython's thresholds say is due (the oldest one), or None."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        for generation in (2, 1, 0):
            if thresholds[generation] and counts[generation] > thresholds[generation]:
                return generation
        return None

    def in_slack(self, budget_s: float) -> float:
        """Runs the due collection if it fits in ``budget_s``; returns the seconds spent.

        Called by the beat thread only, when the previous beat's output is on the host and the next
        beat starts ``budget_s`` from now (offline runs pass ``math.inf``).
        """
        if self.mode != GcMode.SLACK or not self.running:
            return 0.0
        generation = self.due()
        if generation is None:
            return 0.0
        # A younger generation is better than nothing when the due one does not fit.
        while generation >= 0 and self.estimate_s[generation] + self.margin_s > budget_s:
            generation -= 1
        if generation < 0:
            self.deferred += 1
            return 0.0
        t = self._now()
        self._collect(generation)
        spent = self._now() - t
        self.estimate_s[generation] = max(spent, 0.9 * self.estimate_s[generation])
        self.collections[generation] += 1
        return spent

    def _collect(self, generation: int) -> None:
        if self.monitor is not None:
            self.monitor.policy_active = True
        try:
            gc.collect(generation)
        finally:
            if self.monitor is not None:
                self.monitor.policy_active = False
