"""A batching-policy simulator of the serving clock, driven by step-cost models fitted to the H200.

Three pieces (fitted by ``fit_h200`` to the older engine's ``experiments/beat_profile`` rows, or by
``fit_capacity`` to the current engine's ``experiments/capacity`` rows):

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

from voicechat_jax import config as config_lib
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
    # a 1-slot engine's frame-step where it is another configuration off the line (``auto`` picks
    # all XLA at one slot; ``fit_tick_line``); None: the line holds there too
    one_slot_ms: float | None = None
    # ``(a, s, below)``: the frame-step ``a + s*B`` of the engines of 2 to ``below - 1`` slots,
    # another configuration again (``auto`` runs all XLA below 8 slots; ``fit_tick_line``, from
    # their measured ticks); None: the line holds there too
    small_line: tuple[float, float, int] | None = None

    def frame_step_ms(self, batch: float, context_frac: float = 1.0) -> float:
        """Device ms of one frame-step of ``batch`` slots at caches ``context_frac`` of 1500."""
        if self.one_slot_ms is not None and batch <= 1:
            return self.one_slot_ms
        if self.small_line is not None and batch < self.small_line[2]:
            return self.small_line[0] + self.small_line[1] * batch
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
    period_ms: float = BEAT_MS  # the beat: one session-beat is this much conversation

    def summary(self) -> dict:
        """p50/p99/max latency, missed ticks, miss rate over ticks and over session-beats."""
        lat = self.latency_ms[~np.isnan(self.latency_ms)]
        n = len(self.missed)
        sess_beats = float(self.live.sum())
        conv_hours = sess_beats * self.period_ms / 3.6e6
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
    deadline_ms: float | None = None,
    max_inflight: int = 2,
    buckets: Sequence[int] | None = None,
    context_frac: float | Callable[[int], float] = 1.0,
    stalls: Sequence[tuple[int, float]] = (),
    device_ms: Callable[[int], float] | None = None,
    period_ms: float = BEAT_MS,
    tick_cost: Callable[[int], float] | None = None,
    resize_ms: Callable[[int, int], float] | None = None,
) -> Result:
    """The dispatch loop on a simulated clock: all slots every beat (the engine today).

    Args:
      live: sessions live at tick ``k`` (a number, or a function of ``k``).
      slots: the compiled slot count; the tick costs ``t(slots)`` whatever is live, unless
        ``buckets`` are given (then ``t(smallest bucket >= live)``).
      context_frac: the caches' fill, a share of 1500 frames (a number, or a function of ``k``:
        tick ``k``'s mean fill over the compiled slots, free ones counting 0).
      stalls: ``(tick, ms)``: the host stalls this long right after dispatching ``tick``
        (hand-made cases); random stalls come from ``tail.stall_prob``.
      device_ms: overrides the device time of tick ``k`` (hand-made cases); no jitter then.
      period_ms: the beat (``frames_per_tick * 80``); the deadline defaults to it.
      tick_cost: device ms of a tick of ``B`` slots, instead of ``cost.tick_ms(B, context_frac)``
        (another frames-per-tick); jitter is added as usual.
      resize_ms: with ``buckets``, device ms of moving the state from one bucket to another
        (old, new), added to the first tick in the new bucket.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    live_at = (lambda k: live) if isinstance(live, int) else live
    frac_at = context_frac if callable(context_frac) else (lambda k: context_frac)
    if deadline_ms is None:
        deadline_ms = period_ms
    clock_time = _SimTime()
    clock = BeatClock(
        period_ms / 1e3, "realtime", deadline_s=deadline_ms / 1e3, now=clock_time.now,
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
    bucket_now = None
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
            base = cost.tick_ms(batch, frac_at(k)) if tick_cost is None else tick_cost(batch)
            d = base + tail.draw_ms(batch, rng)
        if resize_ms is not None and bucket_now is not None and batch != bucket_now:
            d += resize_ms(bucket_now, batch)
        bucket_now = batch
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
            free = max(free, (k + 2 + STALL_LATE_MAX * rng.random()) * period_ms)
        clock_time.t = free / 1e3
    span = n_beats * period_ms
    return Result(
        lat, missed, served, busy, span, skipped=skipped, launches=launches, period_ms=period_ms
    )


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


# ---- the fit to the H200 rows, in one call ----------------------------------------------------

# The components whose bytes scale with the context cap (caches read whole every frame-step).
CONTEXT_COMPONENTS = ("LLM attention", "TTS backbone")


def context_share(components: list[dict]) -> float:
    """Share of a slot's bytes (growth from 16 to 32 slots) in context-sized caches."""
    by = {(r["component"], r["slots"]): r["bytes"] for r in components}
    names = {c for c, _ in by}
    grow = {c: by[(c, 32)] - by[(c, 16)] for c in names if (c, 16) in by and (c, 32) in by}
    ctx = sum(v for c, v in grow.items() if c.startswith(CONTEXT_COMPONENTS))
    return ctx / sum(grow.values())


@dataclasses.dataclass(frozen=True)
class H200Fit:
    """The step-cost and tail models fitted to H200 rows (``fit_h200``: ``experiments/beat_profile``
    on the older engine; ``fit_capacity``: ``experiments/capacity`` on the current one)."""

    cost: StepCost
    tail: Tail  # jitter, host stalls and host overhead
    quiet: Tail  # the same without host stalls (load-independent misses no policy removes)
    share: float  # context share of a slot's bytes
    host_each: dict[int, float]  # host ms per beat, per serving row
    ticks: list[dict]  # the rows the step cost is fitted to (kind=tick; or baseline and probe)
    serves: list[dict]  # the serving rows (validation, jitter, host overhead and stalls)
    components: list[dict]  # the kind=component rows (the context share)
    # (B, measured ms per frame-step) the step cost is fitted to, one per row of ``ticks``
    step_points: tuple[tuple[float, float], ...] = ()
    # (B, p99 - p50 ms) the jitter is fitted to
    jitter_points: tuple[tuple[float, float], ...] = ()
    source: str = "beat_profile"  # which rows: "beat_profile" or "capacity"
    config: str = ""  # the capacity rows' engine configuration (CAPACITY_CONFIGS); "" otherwise
    tick_of: dict[int, float] = dataclasses.field(default_factory=dict)  # tick ms per B measured
    tick_line: bool = False  # the step cost refitted to the scheduling experiments' ticks


def fit_h200(rows: list[dict]) -> H200Fit:
    """Fits the models as ``policy_sim/run.py`` does (README there): step cost to the tick rows,
    jitter and host overhead to the serving rows the server kept up with, host stalls to the
    missed ticks of the rows whose jitter reaches no deadline."""
    ticks = sorted((r for r in rows if r["kind"] == "tick"), key=lambda r: r["slots"])
    serves = sorted((r for r in rows if r["kind"] == "serve"), key=lambda r: r["sessions"])
    comps = [r for r in rows if r["kind"] == "component"]
    share = context_share(comps)
    cost = fit_step_cost(
        [r["slots"] for r in ticks], [r["ms_per_frame_step"] for r in ticks], context_share=share
    )
    ok = [r for r in serves if r["p50_ms"] < BEAT_MS]
    jit = [(r["sessions"], r["p99_ms"] - r["p50_ms"]) for r in ok]
    tick_of = {r["slots"]: float(np.median(r["ms"])) for r in ticks}
    tail, quiet, host_each = _fit_tail(ok, jit, tick_of)
    return H200Fit(
        cost=cost,
        tail=tail,
        quiet=quiet,
        share=share,
        host_each=host_each,
        ticks=ticks,
        serves=serves,
        components=comps,
        step_points=tuple((r["slots"], r["ms_per_frame_step"]) for r in ticks),
        jitter_points=tuple(jit),
        source="beat_profile",
        tick_of=tick_of,
    )


def _fit_tail(
    ok: list[dict],
    jitter_points: list[tuple[float, float]],
    tick_of: dict[int, float],
    steps: int = 3000,
) -> tuple[Tail, Tail, dict[int, float]]:
    """The tail models of a fit, and each serving row's host overhead.

    ``ok``: the serving rows the server kept up with; ``jitter_points``: (B, p99 - p50 ms) the
    jitter is fitted to, held past the largest ``ok`` row; ``tick_of``: the tick ms measured per
    session count. Host overhead: each ``ok`` row's p50 less its tick (their mean in the tails).
    Host stalls: the missed ticks of the ``ok`` rows whose jitter reaches no deadline, per steady
    tick (0 when there is no such row). Returns (tail, the same without stalls, host per row).
    """
    u, v = fit_jitter([b for b, _ in jitter_points], [d for _, d in jitter_points], steps=steps)
    sigma_max = max(r["sessions"] for r in ok)
    jitter = Tail(log_sigma0=u, log_sigma1=v, sigma_batch_max=sigma_max)
    hosts: dict[int, list[float]] = collections.defaultdict(list)
    for r in ok:  # a session count served more than once: the mean of its rows
        hosts[r["sessions"]].append(r["p50_ms"] - tick_of[r["sessions"]])
    host_each = {n: float(np.mean(h)) for n, h in hosts.items()}
    host = float(np.mean(list(host_each.values())))
    quiet_rows = [r for r in ok if r["p50_ms"] + 3 * jitter.sigma_ms(r["sessions"]) < BEAT_MS]
    quiet_ticks = sum(r["steady_ticks"] for r in quiet_rows)
    stall = sum(r["missed_ticks"] for r in quiet_rows) / quiet_ticks if quiet_ticks else 0.0
    return Tail(u, v, stall, host, sigma_max), Tail(u, v, 0.0, host, sigma_max), host_each


# ---- the fit to the capacity rows (the current engine), in one call ---------------------------


@dataclasses.dataclass(frozen=True)
class CapacityRows:
    """The rows of ``experiments/capacity`` that describe one engine configuration."""

    serves: list[dict]  # kind=serve, hold_full, one loop, by sessions
    probes: list[dict]  # kind=probe of the same runs (same sessions and commit), by sessions
    baselines: list[dict]  # kind=baseline (1-slot engine) of the same commits


# The configurations a capacity fit can describe: the kernels and codec products of its rows, as
# a function of a row's slot count (its ``sessions``; 1 for a batch-1 baseline). A row without one
# of these fields (older rows) is taken as having the value given.


def auto_config(slots: int) -> dict:
    """The engine's GPU default: the ``auto`` kernels as ``ServeConfig.resolved`` picks them on a
    GPU at ``slots`` (``config.AUTO_KERNELS``; all XLA on the 1-slot baseline engine), full fp32
    codec products (the faithful ``reference`` policy)."""
    k = config_lib.ServeConfig(slots=slots).kernels(platform="gpu", slots=slots).row()
    return {f: k[f] for f in ("ssm_kernel", "attention", "tts_attention")} | {
        "codec_matmul": "float32"
    }


def xla_tts_config(slots: int) -> dict:
    """The engine of the rows at ``5386a4f`` and ``d846496``: the Pallas SSM update and
    LLM attention, XLA's speech-decoder attention, at every slot count (its baseline rows name no
    kernel), full fp32 codec products."""
    del slots
    return {"ssm_kernel": "pallas", "attention": "pallas", "tts_attention": "xla",
            "codec_matmul": "float32"}  # fmt: skip


CAPACITY_CONFIGS: dict[str, Callable[[int], dict]] = {
    "auto": auto_config,
    "xla_tts": xla_tts_config,
}


def _of_config(r: dict, config: Callable[[int], dict]) -> bool:
    slots = 1 if r.get("kind") == "baseline" else r.get("sessions", 1)
    return all(r.get(k, v) == v for k, v in config(slots).items())


def select_capacity_rows(
    rows: Sequence[dict],
    *,
    loop: str = "dispatch",
    policy: str = "reference",
    config: str = "auto",
) -> CapacityRows:
    """Picks the worst-case rows of the current engine out of ``capacity/results`` rows.

    Serving rows: ``kind=serve`` with ``hold_full`` true (every cache full on every tick, so
    ``x = 1``), of ``loop``, ``policy`` and ``config`` (a name in ``CAPACITY_CONFIGS``: kernels and
    codec products at the row's slot count; any row, probes and baselines included, that names
    another value of one of its fields is left out). Probes (the tick timed back to back before
    serving) and batch-1 baselines carry no ``hold_full`` field, so a probe is kept only where a
    kept serving row has its session count and commit (it was timed in that run), a baseline only
    where a kept serving row has its commit; rows without a commit (older runs) are never kept.
    """
    rows = [r for r in rows if _of_config(r, CAPACITY_CONFIGS[config])]
    serves = sorted(
        (r for r in rows if r.get("kind") == "serve" and r.get("hold_full") is True
         and r.get("loop") == loop and r.get("policy", policy) == policy and r.get("commit")),
        key=lambda r: r["sessions"],
    )  # fmt: skip
    runs = {(r["sessions"], r["commit"]) for r in serves}
    commits = {r["commit"] for r in serves}
    probes = sorted(
        (r for r in rows if r.get("kind") == "probe" and r.get("policy", policy) == policy
         and (r.get("sessions"), r.get("commit")) in runs),
        key=lambda r: r["sessions"],
    )  # fmt: skip
    baselines = [
        r for r in rows
        if r.get("kind") == "baseline" and r.get("policy", policy) == policy
        and r.get("commit") in commits
    ]  # fmt: skip
    return CapacityRows(serves=serves, probes=probes, baselines=baselines)


def fit_capacity(
    rows: Sequence[dict],
    components: list[dict],
    *,
    loop: str = "dispatch",
    config: str = "auto",
    steps: int = 3000,
) -> H200Fit:
    """Fits the models to the current engine's ``experiments/capacity`` rows (README here).

    Step cost: the batch-1 baselines' tick p50 (``B = 1``) and the probes' back-to-back tick p50,
    halved to a frame-step. Every row is at ``x = 1`` (``hold_full``), so only ``a`` and the slope
    ``b + c`` are identified; ``c / (b + c)`` is the component rows' byte share, as in
    ``fit_h200``. Jitter: ``p99 - p50`` of the serving rows the server kept up with, and of the
    baselines' timed ticks at ``B = 1`` (the only spread measured below 56 slots); held beyond the
    largest serving row. Host overhead: serving p50 minus its run's probe. Host stalls: missed
    ticks of the rows whose jitter reaches no deadline, per steady tick. ``config``: the
    engine configuration whose rows are fitted (``CAPACITY_CONFIGS``).
    """
    sel = select_capacity_rows(rows, loop=loop, config=config)
    if not sel.probes:
        raise ValueError("no probe row matches a hold_full serving row")
    share = context_share(components)
    step_rows = sel.baselines + sel.probes
    B = [1] * len(sel.baselines) + [r["sessions"] for r in sel.probes]
    y = [r["ms_p50"] / 2 for r in sel.baselines] + [r["tick_ms_p50"] / 2 for r in sel.probes]
    cost = fit_step_cost(B, y, context_share=share, steps=steps)
    ok = [r for r in sel.serves if r["p50_ms"] < BEAT_MS]
    jit = [(r["sessions"], r["p99_ms"] - r["p50_ms"]) for r in ok]
    jit += [(1, r["ms_p99"] - r["ms_p50"]) for r in sel.baselines]
    by_n: dict[int, list[float]] = collections.defaultdict(list)
    for r in sel.probes:
        by_n[r["sessions"]].append(r["tick_ms_p50"])
    tick_of = {n: float(np.median(t)) for n, t in by_n.items()}
    tail, quiet, host_each = _fit_tail(ok, jit, tick_of, steps)
    return H200Fit(
        cost=cost,
        tail=tail,
        quiet=quiet,
        share=share,
        host_each=host_each,
        ticks=step_rows,
        serves=sel.serves,
        components=components,
        step_points=tuple(zip(B, y, strict=True)),
        jitter_points=tuple(jit),
        source="capacity",
        config=config,
        tick_of=tick_of,
    )


def measured_ticks(rows: Sequence[dict]) -> list[dict]:
    """One point per back-to-back tick timed in the scheduling experiments' engine rows
    (``batching_policy``, ``slot_buckets``, ``phase_stagger``, and 2-frame ticks timed by
    ``frames_per_tick``'s script): its source, slot count, tick ms."""
    out = []
    for r in rows:
        if r["kind"] == "lockstep":
            out.append({"row": "batching_policy lockstep", "slots": r["sessions"],
                        "tick_ms": r["tick_ms"]})  # fmt: skip
        elif r["kind"] == "per_session" and r["sessions"] == 1:
            out.append({"row": "batching_policy batch 1", "slots": 1, "tick_ms": r["tick1_ms"]})
        elif r["kind"] == "tick" and "engine" in r:
            out.append({"row": f"slot_buckets {r['engine']} ({r['live']} live)",
                        "slots": r["slots"], "tick_ms": r["tick_ms"]})  # fmt: skip
        elif r["kind"] == "groups":
            out.append({"row": f"phase_stagger {r['groups']} x {r['group_slots']}",
                        "slots": r["group_slots"], "tick_ms": r["tick_ms"]})  # fmt: skip
        elif r["kind"] == "tick" and r.get("frames_per_tick") == 2:  # frames_per_tick's script
            out.append({"row": f"{r['slots']}-slot tick", "slots": r["slots"],
                        "tick_ms": r["tick_ms"]})  # fmt: skip
    return out


def fit_tick_line(fit: H200Fit, points: Sequence[dict], *, min_slots: int = 8) -> H200Fit:
    """``fit`` (a capacity fit) with its step cost refitted to the measured ticks.

    One line ``a + s*B`` a frame-step, with no context term, through every point of at least
    ``min_slots`` slots (``measured_ticks``, caches nearly empty) and the fit's probes (every cache
    full): the multi-slot engine's tick barely depends on the fill (README here). A 1-slot engine
    is ``auto``'s all-XLA configuration, off that line: its frame-step is the mean of the 1-slot
    points (``StepCost.one_slot_ms``). The engines of 2 to ``min_slots - 1`` slots (all XLA too
    under ``auto``) get a line of their own through their points where two slot counts were
    measured (``StepCost.small_line``); else the main line holds there. Tail and host models are
    kept.
    """
    multi = [(p["slots"], p["tick_ms"] / 2) for p in points if p["slots"] >= min_slots]
    multi += [(B, y) for B, y in fit.step_points if B > 1]
    one = [y for B, y in fit.step_points if B == 1]
    one += [p["tick_ms"] / 2 for p in points if p["slots"] == 1]
    B, y = zip(*multi, strict=True)
    line = fit_step_cost(B, y, context_share=0.0)
    small = [(p["slots"], p["tick_ms"] / 2) for p in points if 1 < p["slots"] < min_slots]
    small_line = None
    if len({b for b, _ in small}) >= 2:
        s, a = np.polyfit(*zip(*small, strict=True), 1)
        small_line = (float(a), float(s), min_slots)
    cost = dataclasses.replace(line, one_slot_ms=float(np.mean(one)) if one else None,
                               small_line=small_line)  # fmt: skip
    return dataclasses.replace(fit, cost=cost, tick_line=True,
                               step_points=tuple(multi) + tuple((1, v) for v in one))  # fmt: skip


def validate(fit: H200Fit, seeds: int = 5) -> list[dict]:
    """Simulated lockstep against each real serving row (host overhead from the other rows)."""
    out = []
    for r in fit.serves:
        n = r["sessions"]
        others = [h for m, h in fit.host_each.items() if m != n] or [fit.tail.host_ms]
        t = dataclasses.replace(fit.tail, host_ms=float(np.mean(others)))
        runs = [
            simulate_lockstep(fit.cost, r["steady_ticks"], n, slots=n, tail=t,
                              rng=np.random.default_rng(s)).summary()
            for s in range(seeds)
        ]  # fmt: skip
        p50 = float(np.mean([x["p50_ms"] for x in runs]))
        out.append({
            "sessions": n, "real_p50_ms": r["p50_ms"], "sim_p50_ms": p50,
            "p50_error": p50 / r["p50_ms"] - 1, "real_p99_ms": r["p99_ms"],
            "sim_p99_ms": float(np.mean([x["p99_ms"] for x in runs])),
            "real_missed": r["missed_ticks"],
            "sim_missed": float(np.mean([x["missed"] for x in runs])), "ticks": r["steady_ticks"],
        })  # fmt: skip
    return out


# ---- phase-staggered slot groups --------------------------------------------------------------


def simulate_groups(
    cost: StepCost,
    n_beats: int,
    sizes: Sequence[int],
    offsets_ms: Sequence[float],
    *,
    tail: Tail = Tail(),
    rng: np.random.Generator | None = None,
    period_ms: float = BEAT_MS,
    deadline_ms: float | None = None,
    max_inflight: int = 2,
    context_frac: float = 1.0,
) -> list[Result]:
    """Slot groups of ``sizes[g]`` slots, each on its own beat clock offset by ``offsets_ms[g]``,
    sharing one device: group g's tick k starts at ``k*P + offsets_ms[g]``, the host prepares it
    (``host_ms / 2``, one beat at a time), the device runs ticks first come first served, each
    costing ``t(sizes[g])`` plus jitter; a tick due while ``max_inflight`` of its group's are on
    the device is skipped. Host stalls are not modelled. One ``Result`` per group; one group at
    offset 0 is ``simulate_lockstep`` without stalls."""
    rng = np.random.default_rng(0) if rng is None else rng
    deadline_ms = period_ms if deadline_ms is None else deadline_ms
    G = len(sizes)
    events = sorted((k * period_ms + offsets_ms[g], g, k) for g in range(G) for k in range(n_beats))
    lat = np.full((G, n_beats), np.nan)
    missed = np.zeros((G, n_beats), bool)
    busy = np.zeros(G)
    launches = np.zeros(G, int)
    skipped = np.zeros(G, int)
    sent: list[collections.deque[float]] = [collections.deque() for _ in range(G)]
    host_free = device_free = 0.0
    h = tail.host_ms
    for start, g, k in events:
        now = max(start, host_free)
        while sent[g] and sent[g][0] <= now:
            sent[g].popleft()
        if len(sent[g]) >= max_inflight:
            missed[g, k] = True
            skipped[g] += 1
            continue
        d = cost.tick_ms(sizes[g], context_frac) + tail.draw_ms(sizes[g], rng)
        host_free = now + h / 2
        begin = max(host_free, device_free)
        device_free = begin + d
        busy[g] += d
        launches[g] += 1
        readable = device_free + h / 2
        sent[g].append(readable)
        lat[g, k] = readable - start
        missed[g, k] = lat[g, k] > deadline_ms
    span = n_beats * period_ms
    return [
        Result(lat[g], missed[g], np.full(n_beats, float(sizes[g])), float(busy[g]), span,
               skipped=int(skipped[g]), launches=int(launches[g]), period_ms=period_ms)
        for g in range(G)
    ]  # fmt: skip


# ---- calls arriving, admission with a threshold and a queue -----------------------------------


def arrival_times(
    rng: np.random.Generator,
    rate_per_s: Callable[[np.ndarray], np.ndarray] | float,
    span_s: float,
    *,
    peak_per_s: float | None = None,
) -> np.ndarray:
    """Arrival times (s) in ``[0, span_s)`` of a Poisson process of rate ``rate_per_s`` (a constant,
    or a function of time drawn by thinning a process of rate ``peak_per_s``)."""
    if not callable(rate_per_s):
        r = float(rate_per_s)
        return _cut(np.cumsum(rng.exponential(1.0 / r, int(r * span_s * 1.5) + 50)), span_s, rng, r)
    peak = float(peak_per_s)
    draws = np.cumsum(rng.exponential(1.0 / peak, int(peak * span_s * 1.5) + 50))
    cand = _cut(draws, span_s, rng, peak)
    return cand[rng.random(cand.size) < rate_per_s(cand) / peak]


def _cut(times: np.ndarray, span_s: float, rng: np.random.Generator, rate: float) -> np.ndarray:
    """``times`` below ``span_s``, drawing more if they did not reach it."""
    while times[-1] < span_s:
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, int(rate * span_s * 0.5) + 50))
        times = np.concatenate([times, more])
    return times[times < span_s]


@dataclasses.dataclass
class Admitted:
    """What admission did to a stream of calls."""

    live: np.ndarray  # [beats] calls live at each beat
    offered: int
    refused: int  # refused at once or after waiting ``queue_s``
    waited_s: np.ndarray  # [admitted] how long each admitted call waited
    abandoned_after_s: float  # the queue timeout (a refused call waited this long, or 0)


def admit_calls(
    arrivals_s: np.ndarray,
    durations_s: np.ndarray,
    *,
    max_live: int,
    queue_s: float,
    n_beats: int,
    period_ms: float = BEAT_MS,
) -> Admitted:
    """Admission in front of one engine: a call is admitted if fewer than ``max_live`` are live
    and nobody waits; else it waits, first come first served, for up to ``queue_s`` (0: refused
    at once) and is refused when that passes. An admitted call lasts its whole duration from its
    admission. (``scheduler.AdmissionControl`` on the server.)"""
    ends: list[float] = []  # heap of end times of live calls
    queue: collections.deque[tuple[float, float]] = collections.deque()  # (arrival, duration)
    spans: list[tuple[float, float]] = []
    waited: list[float] = []
    refused = 0

    def start(t: float, a: float, d: float) -> None:
        heapq.heappush(ends, t + d)
        spans.append((t, t + d))
        waited.append(t - a)

    def drain_until(t: float) -> None:
        """Ends calls up to ``t``; each freed slot goes to the oldest caller still waiting."""
        nonlocal refused
        while ends and ends[0] <= t:
            e = heapq.heappop(ends)
            while queue and queue[0][0] + queue_s < e:
                queue.popleft()
                refused += 1
            if queue:
                a, d = queue.popleft()
                start(e, a, d)
        while queue and queue[0][0] + queue_s < t:
            queue.popleft()
            refused += 1

    for a, d in zip(arrivals_s, durations_s, strict=True):
        drain_until(a)
        if len(ends) < max_live and not queue:
            start(a, a, d)
        elif queue_s > 0:
            queue.append((a, d))
        else:
            refused += 1
    drain_until(math.inf)
    live = np.zeros(n_beats + 1)
    P = period_ms / 1e3
    for t0, t1 in spans:
        k0, k1 = min(n_beats, math.ceil(t0 / P)), min(n_beats, math.ceil(t1 / P))
        live[k0] += 1
        live[k1] -= 1
    return Admitted(
        live=np.cumsum(live)[:n_beats].astype(np.int32),
        offered=len(arrivals_s),
        refused=refused,
        waited_s=np.asarray(waited),
        abandoned_after_s=queue_s,
    )
