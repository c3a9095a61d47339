"""A batching-policy simulator of the serving clock, driven by step-cost models fitted to the H200.

Three pieces:

- **Step-cost model** ``StepCost``: device time of one tick of ``B`` slots,
  ``frames_per_tick * (a + b*B + c*B*x)`` ms with ``x = context_cap / 1500`` (weights streamed
  once: ``a``; per-session state read and written: ``b``; per-session attention caches, which every
  frame-step reads whole: ``c``). ``fit_step_cost`` fits it with ``optax`` to measured ticks.
- **Tail model** ``Tail``: per-tick jitter (with probability ``SPIKE_PROB`` a tick runs longer by
  an exponential of scale ``s(B) = exp(u + v*B)``, so the median is untouched and
  ``p99 - p50 = s(B) * ln(SPIKE_PROB / 0.01)`` matches the serving rows) and rare host stalls
  (probability ``stall_prob`` per beat: the host wakes in the slot after next, so one beat is
  skipped and the next starts up to 0.4 of a period late, as the real rows' skipped ticks and
  maxima show), plus the host's own overhead per beat (prepare, copy out), added to the latency
  but not to the device's time.
- **Policies** simulated on that clock:
  ``simulate_lockstep`` mirrors ``Server._run_dispatch``: the real ``BeatClock`` (on a simulated
  time source) decides which tick runs next and skips the ticks whose slot has passed; a tick that
  comes due while ``max_inflight`` earlier ones are still on the device is skipped; ticks run
  first-in first-out on one device; every tick costs ``t(slots)`` whatever is live (the engine
  today) or ``t(bucket)`` of the smallest compiled bucket that holds the live sessions.
  ``simulate_requests`` is the request-server way: each session's frame request arrives at its own
  phase of the beat, a batcher waits up to ``window_ms`` after the oldest waiting request (or until
  ``max_batch`` are waiting) and launches them as one batch; a request whose deadline has passed
  before it could launch is dropped (missed), as the clock drops a beat. ``max_batch = 1`` is
  per-session stepping (batch 1, one session after another).

Times are milliseconds throughout. Everything here is host code (numpy); no device is touched.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from voicechat_jax.serving.clock import BeatClock

BEAT_MS = 160.0  # two 80 ms frames per tick
CAP_FRAMES = 1500  # the context cap the H200 rows were measured at (two minutes)


# ---- step-cost model --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Device ms of one tick: ``frames_per_tick * (a + b*B + c*B*x)``, ``x = cap / 1500``."""

    a_ms: float  # per frame-step, independent of B: weights streamed once, launches
    b_ms: float  # per frame-step per slot: state read and written
    c_ms: float  # per frame-step per slot at the 1500-frame cap: caches read whole
    frames_per_tick: int = 2

    def frame_step_ms(self, batch: float, context_frac: float = 1.0) -> float:
        """Device ms of one frame-step of ``batch`` slots at caches ``context_frac`` of 1500."""
        return self.a_ms + batch * (self.b_ms + self.c_ms * context_frac)

    def tick_ms(self, batch: float, context_frac: float = 1.0) -> float:
        """Device ms of one tick (``frames_per_tick`` frame-steps)."""
        return self.frames_per_tick * self.frame_step_ms(batch, context_frac)


def _fit(loss: Callable, init: jnp.ndarray, steps: int, lr: float) -> np.ndarray:
    """Minimises ``loss(params)`` with Adam from ``init``; returns the parameters."""
    opt = optax.adam(lr)
    grad = jax.jit(jax.value_and_grad(loss))

    @jax.jit
    def run(p):
        def body(_, carry):
            p, s = carry
            _, g = grad(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.lax.fori_loop(0, steps, body, (p, opt.init(p)))[0]

    return np.asarray(run(jnp.asarray(init, jnp.float32)))


def fit_step_cost(
    batches: Sequence[float],
    ms_per_frame_step: Sequence[float],
    *,
    context_share: float,
    context_frac: Sequence[float] | None = None,
    steps: int = 3000,
) -> StepCost:
    """Fits ``a`` and the per-slot slope ``b + c`` to measured frame-steps (relative squared error).

    ``context_share``: the fraction ``c / (b + c)`` of a slot's bytes that are context-sized
    caches (from the component rows' bytes); it is not fitted, since every tick row was measured
    at the same cap. Parameters are fitted in log space, so they stay positive.
    """
    B = jnp.asarray(batches, jnp.float32)
    y = jnp.asarray(ms_per_frame_step, jnp.float32)
    x = jnp.ones_like(B) if context_frac is None else jnp.asarray(context_frac, jnp.float32)
    share = float(context_share)

    def predict(p):
        a, slope = jnp.exp(p[0]), jnp.exp(p[1])
        return a + B * slope * ((1 - share) + share * x)

    def loss(p):
        return jnp.mean(jnp.square(predict(p) / y - 1))

    # Start from the line through the end points.
    slope0 = max(float((y[-1] - y[0]) / (B[-1] - B[0])), 1e-3) if len(y) > 1 else 1.0
    a0 = max(float(y[0] - slope0 * B[0]), 1e-3)
    p = _fit(loss, jnp.log(jnp.asarray([a0, slope0])), steps, 0.01)
    a, slope = math.exp(p[0]), math.exp(p[1])
    return StepCost(a_ms=a, b_ms=slope * (1 - share), c_ms=slope * share)


def leave_one_out(
    batches: Sequence[float], ms_per_frame_step: Sequence[float], *, context_share: float
) -> list[float]:
    """Each point's prediction from a fit to the others (ms per frame-step)."""
    out = []
    for i in range(len(batches)):
        keep = [j for j in range(len(batches)) if j != i]
        m = fit_step_cost(
            [batches[j] for j in keep],
            [ms_per_frame_step[j] for j in keep],
            context_share=context_share,
        )
        out.append(m.frame_step_ms(batches[i]))
    return out


# ---- tail model -------------------------------------------------------------------------------

SPIKE_PROB = 0.05  # share of ticks that get a spike; p50 is then the spike-free tick
_P99_PER_SCALE = math.log(SPIKE_PROB / 0.01)  # p99 - p50 of the jitter, per unit of scale
STALL_LATE_MAX = 0.4  # a stalled host wakes up to this share of a period into its slot


@dataclasses.dataclass(frozen=True)
class Tail:
    """Per-tick jitter, host stalls and the host's overhead per beat."""

    log_sigma0: float = -math.inf  # spike scale s(B) = exp(log_sigma0 + log_sigma1 * B) ms
    log_sigma1: float = 0.0
    stall_prob: float = 0.0  # per beat: the host stalls past the next beat (a GC, the OS)
    host_ms: float = 0.0  # host work per beat, inside the latency, off the device
    sigma_batch_max: float = math.inf  # sigma(B) is held at sigma(this) beyond it (no data there)

    def sigma_ms(self, batch: float) -> float:
        """Scale of the exponential spike added to a tick of ``batch`` slots."""
        return math.exp(self.log_sigma0 + self.log_sigma1 * min(batch, self.sigma_batch_max))

    def p99_minus_p50_ms(self, batch: float) -> float:
        """What the jitter alone adds between the median and the 99th percentile."""
        return _P99_PER_SCALE * self.sigma_ms(batch)

    def draw_ms(self, batch: float, rng: np.random.Generator) -> float:
        """One tick's jitter: a spike with probability ``SPIKE_PROB``, else nothing."""
        if self.log_sigma0 == -math.inf or rng.random() >= SPIKE_PROB:
            return 0.0
        return float(rng.exponential(self.sigma_ms(batch)))


def fit_jitter(
    batches: Sequence[float], p99_minus_p50_ms: Sequence[float], steps: int = 3000
) -> tuple[float, float]:
    """Fits ``log s(B) = u + v*B`` so that the jitter's p99 - p50 matches; returns (u, v)."""
    B = jnp.asarray(batches, jnp.float32)
    target = jnp.log(jnp.asarray(p99_minus_p50_ms, jnp.float32) / _P99_PER_SCALE)
    scale = float(jnp.max(B))

    def loss(p):  # fitted in B / max(B) so that the two parameters have a like scale
        return jnp.mean(jnp.square(p[0] + p[1] * B / scale - target))

    p = _fit(loss, jnp.zeros(2), steps, 0.05)
    return float(p[0]), float(p[1] / scale)


# ---- results ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """Per-tick (lockstep) or per-request (request policies) outcomes of one simulated run."""

    latency_ms: np.ndarray  # [n] ms from the beat's (request's) start to its output; nan: skipped
    missed: np.ndarray  # [n] bool: output after the deadline, or skipped
    live: np.ndarray  # [n] sessions the tick served (1 for a request)
    busy_ms: float  # device time spent
    span_ms: float  # simulated wall time
    skipped: int = 0
    launches: int = 0

    def summary(self) -> dict:
        """p50/p99/max latency, missed ticks, miss rate over ticks and over session-beats."""
        lat = self.latency_ms[~np.isnan(self.latency_ms)]
        n = len(self.missed)
        sess_beats = float(self.live.sum())
        conv_hours = sess_beats * BEAT_MS / 3.6e6
        pct = (lambda q: float(np.percentile(lat, q))) if len(lat) else (lambda q: math.nan)
        return {
            "p50_ms": pct(50),
            "p99_ms": pct(99),
            "max_ms": float(lat.max()) if len(lat) else math.nan,
            "missed": int(self.missed.sum()),
            "n": n,
            "miss_rate": float(self.missed.mean()) if n else math.nan,
            "missed_session_beat_rate": (
                float((self.missed * self.live).sum() / sess_beats) if sess_beats else math.nan
            ),
            "skipped": self.skipped,
            "launches": self.launches,
            "busy_frac": self.busy_ms / self.span_ms if self.span_ms else math.nan,
            # device-busy seconds per conversation-hour (what the work costs, not the GPU held)
            "busy_gpu_s_per_conv_h": self.busy_ms / 1e3 / conv_hours if conv_hours else math.nan,
        }


# ---- lockstep: the engine's dispatch loop -----------------------------------------------------


class _SimTime:
    """A simulated monotonic time source (seconds) with a sleep that advances it."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(0.0, s)


def bucket_for(live: int, buckets: Sequence[int]) -> int:
    """The smallest compiled bucket that holds ``live`` sessions (the largest if none does)."""
    for b in sorted(buckets):
        if b >= live:
            return b
    return max(buckets)


def simulate_lockstep(
    cost: StepCost,
    n_beats: int,
    live: Callable[[int], int] | int,
    *,
    slots: int,
    tail: Tail = Tail(),
    rng: np.random.Generator | None = None,
    deadline_ms: float = BEAT_MS,
    max_inflight: int = 2,
    buckets: Sequence[int] | None = None,
    context_frac: float = 1.0,
    stalls: Sequence[tuple[int, float]] = (),
    device_ms: Callable[[int], float] | None = None,
) -> Result:
    """The dispatch loop on a simulated clock: all slots every beat (the engine today).

    Args:
      live: sessions live at tick ``k`` (a number, or a function of ``k``).
      slots: the compiled slot count; the tick costs ``t(slots)`` whatever is live, unless
        ``buckets`` are given (then ``t(smallest bucket >= live)``).
      stalls: ``(tick, ms)``: the host stalls this long right after dispatching ``tick``
        (hand-made cases); random stalls come from ``tail.stall_prob``.
      device_ms: overrides the device time of tick ``k`` (hand-made cases); no jitter then.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    live_at = (lambda k: live) if isinstance(live, int) else live
    clock_time = _SimTime()
    clock = BeatClock(
        BEAT_MS / 1e3, "realtime", deadline_s=deadline_ms / 1e3, now=clock_time.now,
        sleep=clock_time.sleep,
    )  # fmt: skip
    clock.begin(0.0)
    stall_at = dict(stalls)
    lat = np.full(n_beats, np.nan)
    missed = np.zeros(n_beats, bool)
    served = np.zeros(n_beats)
    device_free = 0.0  # ms
    busy = 0.0
    sent: collections.deque[tuple[int, float]] = collections.deque()  # (tick, readable ms)
    last: int | None = None
    skipped = launches = 0
    host = tail.host_ms
    while True:
        k = clock.next_tick(last)
        if k >= n_beats:
            break
        timing = clock.wait_for_tick(k)
        now = clock_time.t * 1e3
        for j in range(k - (k if last is None else last + 1), 0, -1):  # clock-skipped beats
            missed[k - j] = True
            served[k - j] = live_at(k - j)
            skipped += 1
        last = k
        n_live = live_at(k)
        served[k] = n_live
        while sent and sent[0][1] <= now:  # outputs the reader has picked up
            sent.popleft()
        if len(sent) >= max_inflight:  # the device is still on earlier beats: skipped
            missed[k] = True
            skipped += 1
            continue
        batch = slots if buckets is None else bucket_for(n_live, buckets)
        if device_ms is not None:
            d = device_ms(k)
        else:
            d = cost.tick_ms(batch, context_frac) + tail.draw_ms(batch, rng)
        start = max(now + host / 2, device_free)  # prepare on the host, then queued in order
        device_free = start + d
        busy += d
        launches += 1
        readable = device_free + host / 2
        sent.append((k, readable))
        lat[k] = readable - timing.start * 1e3
        missed[k] = lat[k] > deadline_ms
        # The host is free again once the beat is dispatched; a stall delays its next wait.
        free = now + host / 2 + stall_at.get(k, 0.0)
        if tail.stall_prob and rng.random() < tail.stall_prob:
            free = max(free, (k + 2 + STALL_LATE_MAX * rng.random()) * BEAT_MS)
        clock_time.t = free / 1e3
    span = n_beats * BEAT_MS
    return Result(lat, missed, served, busy, span, skipped=skipped, launches=launches)


# ---- request-style batching -------------------------------------------------------------------


def simulate_requests(
    cost: StepCost,
    n_sessions: int,
    n_beats: int,
    *,
    window_ms: float,
    max_batch: int,
    phases_ms: Sequence[float] | None = None,
    tail: Tail = Tail(),
    rng: np.random.Generator | None = None,
    deadline_ms: float = BEAT_MS,
    context_frac: float = 1.0,
    buckets: Sequence[int] | None = None,
) -> Result:
    """Request-server batching: each session's frame request at ``k*P + phase``; see the module.

    A batch of ``b`` requests costs ``t(b)`` on the device (``t(bucket)`` with ``buckets``);
    ``max_batch = 1`` and ``window_ms = 0`` is per-session stepping. ``phases_ms``: each
    session's offset in the beat (default: all 0, every request at the beat's start).
    """
    rng = np.random.default_rng(0) if rng is None else rng
    phases = np.zeros(n_sessions) if phases_ms is None else np.asarray(phases_ms, float)
    arrivals = np.sort((np.arange(n_beats)[:, None] * BEAT_MS + phases[None, :]).ravel())
    n = len(arrivals)
    lat = np.full(n, np.nan)
    missed = np.zeros(n, bool)
    host = tail.host_ms
    device_free = 0.0
    busy = 0.0
    launches = 0
    i = 0  # next arrival not yet queued
    queue: list[int] = []  # indices of waiting requests, oldest first
    while i < n or queue:
        if not queue:
            queue.append(i)
            i += 1
        # The host decides a batch (and prepares it, host/2) so that it is ready as the device
        # frees: the decision is at ``ready``, or later if the window or a full batch says so.
        ready = device_free - host / 2
        if len(queue) >= max_batch:  # a full batch is already waiting
            t = max(ready, arrivals[queue[max_batch - 1]])
        else:  # launch when the device is free and the oldest's window has passed, or when full
            t = max(ready, arrivals[queue[0]] + window_ms)
            while i < n and arrivals[i] <= t:
                queue.append(i)
                i += 1
                if len(queue) >= max_batch:
                    t = max(ready, arrivals[i - 1])
                    break
        # Requests already past their deadline are dropped, as the clock drops a late beat.
        late = [r for r in queue if arrivals[r] + deadline_ms <= t + host / 2]
        missed[late] = True
        queue = [r for r in queue if arrivals[r] + deadline_ms > t + host / 2]
        if not queue:
            continue
        batch, queue = queue[:max_batch], queue[max_batch:]
        b = len(batch) if buckets is None else bucket_for(len(batch), buckets)
        d = cost.tick_ms(b, context_frac) + tail.draw_ms(b, rng)
        start = max(t + host / 2, device_free)
        device_free = start + d
        busy += d
        launches += 1
        done = device_free + host / 2
        for r in batch:
            lat[r] = done - arrivals[r]
            missed[r] = lat[r] > deadline_ms
    span = n_beats * BEAT_MS
    return Result(lat, missed, np.ones(n), busy, span, skipped=0, launches=launches)


# ---- traffic: sessions arriving and leaving, one or several engines ---------------------------


@dataclasses.dataclass
class Traffic:
    """Per-engine live counts per beat after admission, and what was refused."""

    live: np.ndarray  # [engines, beats]
    offered: int
    refused: int


def poisson_traffic(
    rng: np.random.Generator,
    *,
    rate_per_s: float,
    mean_duration_s: float,
    max_duration_s: float,
    n_beats: int,
    engines: int,
    slots: int,
    router: str = "least_loaded",
) -> Traffic:
    """Poisson arrivals, exponential call lengths capped at ``max_duration_s``; admission by router.

    ``router``: ``"least_loaded"`` (the engine with the fewest live sessions) or ``"first_fit"``
    (the lowest-numbered engine with a free slot); a call with no free slot anywhere is refused.
    """
    span_s = n_beats * BEAT_MS / 1e3
    t, arrivals = 0.0, []
    while True:
        t += rng.exponential(1.0 / rate_per_s)
        if t >= span_s:
            break
        arrivals.append(t)
    live = np.zeros((engines, n_beats), np.int32)
    ends: list[list[float]] = [[] for _ in range(engines)]  # heap of end times per engine
    refused = 0
    for a in arrivals:
        for e in range(engines):
            while ends[e] and ends[e][0] <= a:
                heapq.heappop(ends[e])
        free = [e for e in range(engines) if len(ends[e]) < slots]
        if not free:
            refused += 1
            continue
        e = min(free, key=lambda e: len(ends[e])) if router == "least_loaded" else free[0]
        d = min(rng.exponential(mean_duration_s), max_duration_s)
        heapq.heappush(ends[e], a + d)
        k0 = math.ceil(a * 1e3 / BEAT_MS)
        k1 = min(n_beats, math.ceil((a + d) * 1e3 / BEAT_MS))
        live[e, k0:k1] += 1
    return Traffic(live=live, offered=len(arrivals), refused=refused)
