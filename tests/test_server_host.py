"""The server's host side on the tiny random model: GC policy, bounded memory, attribution, drain.

These runs use the real-time clock where the property is about time (when collections run, what a
stall costs), and the offline clock where it is about what is kept.
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import pathlib
import threading
import time
import tracemalloc
import wave

import numpy as np
import pytest

from tests import shared
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.precision import Precision
from voicechat_jax.serving import GcMonitor, read_wav
from voicechat_jax.serving.hub import Join
from voicechat_jax.serving.server import (
    Engine,
    Server,
    ServerConfig,
    SessionPlan,
    pick_loop,
    write_session_outputs,
)

CFG = tiny()
PREC = Precision.fp32()
SAMPLES_PER_OUT_FRAME = 1764


@pytest.fixture(scope="module")
def engine():
    # test_engine.py's engine too, where the two files share a worker
    return shared.engine(ServeConfig(slots=3, frames_per_tick=2, context_frames=64, precision=PREC))


def _speech(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal(int(seconds * 16000))).clip(-1, 1).astype(np.float32)


class Probe(io.StringIO):
    """A metrics sink that calls ``on_tick(row)`` for each tick line (in the writer thread)."""

    def __init__(self, on_tick=None):
        super().__init__()
        self.on_tick = on_tick
        self.rows: list[dict] = []

    def write(self, text: str) -> int:
        row = json.loads(text)
        self.rows.append(row)
        if row["type"] == "tick" and self.on_tick is not None:
            self.on_tick(row)
        return super().write(text)

    def ticks(self) -> dict[int, dict]:
        return {r["tick"]: r for r in self.rows if r["type"] == "tick"}


def _session_files_agree(directory) -> int:
    """A session's files read as they are (mid-run too): frames; the WAV holds as many frames."""
    rows = [json.loads(line) for line in (directory / "frames.jsonl").read_text().splitlines()]
    assert [r["frame"] for r in rows] == list(range(len(rows)))
    wav = read_wav(directory / "output.wav", expected_rate=22050)
    assert wav.shape == (len(rows) * SAMPLES_PER_OUT_FRAME,)
    return len(rows)


def test_serving_loop_runs_under_its_gc_policy(engine, tmp_path):
    """Automatic collection is off, the start-up heap frozen, and every collection during the run
    starts in a beat's slack; the files on disk are whole mid-run; the collector is given back."""
    seen, mid_run = [], {}

    def on_tick(row):
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        for _ in range(1500):  # cyclic garbage, past generation 0's threshold every beat
            a = []
            a.append(a)
        if row["tick"] == 12:
            mid_run.update({p.name: _session_files_agree(p) for p in tmp_path.iterdir()})
            mid_run["ran"] = sum(not r["skipped"] for r in probe.ticks().values())

    probe = Probe(on_tick)
    engine.reset()
    server = Server(
        engine, clock="realtime", loop="dispatch", warmup_ticks=2, metrics_sink=probe,
        output_dir=tmp_path, keep_outputs=False,
    )  # fmt: skip
    plans = [SessionPlan(id=f"g{i}", audio=_speech(4, i)) for i in range(2)]
    with GcMonitor() as monitor:
        server.run(plans, 24)
    pauses = monitor.drain()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    assert seen
    assert all(enabled is False and frozen > 0 for enabled, frozen in seen)
    summary = server.metrics.summary()
    assert summary["gc"]["automatic"] == [0, 0, 0]
    # The garbage was due every beat: the policy collected it in the slack, or, on a machine too
    # loaded to leave a beat any slack, deferred it (never collecting outside the slack).
    collected = sum(summary["gc"]["policy"])
    assert collected > 0 or server.gc.deferred > 0, summary["gc"]
    # Every collection during the run (all the policy's: none was automatic) started after the
    # previous beat's output was on the host and before the next beat began.
    ticks = probe.ticks()
    starts = sorted((r["start"], r["readable"]) for r in ticks.values())
    during = [p for p in pauses if starts[0][0] < p.start < starts[-1][0]]
    assert during or not collected
    for p in during:
        before = [(s, r) for s, r in starts if s <= p.start]
        assert before[-1][1] is None or before[-1][1] <= p.start, p
    # Mid-run, the files held every beat collected so far, and agreed with each other.
    assert mid_run["g0"] == mid_run["g1"] >= 2 * mid_run["ran"] > 0
    assert _session_files_agree(tmp_path / "g0") == 2 * sum(
        not r["skipped"] for r in ticks.values()
    )


def test_long_offline_run_keeps_memory_bounded(engine, tmp_path):
    """200 sessions come and go over 400 ticks: what the server keeps stays flat."""
    marks = {}

    def on_tick(row):
        if row["tick"] in (150, 399):
            gc.collect()
            marks[row["tick"]] = (tracemalloc.get_traced_memory()[0], server.retained())

    engine.reset()
    probe = Probe(on_tick)
    server = Server(
        engine, clock="offline", loop="dispatch", warmup_ticks=2, metrics_sink=probe,
        output_dir=tmp_path, keep_outputs=False, max_ended=8, metrics_window=64,
    )  # fmt: skip
    probe.write = _forget_lines(probe)  # the sink itself must not be what grows
    audio = _speech(1, 0)
    plans = [
        SessionPlan(id=f"m{i:03d}", audio=audio, join=2 * i, leave=2 * i + 5) for i in range(200)
    ]
    tracemalloc.start()
    try:
        server.run(plans, 400)
    finally:
        tracemalloc.stop()
    (mem_a, kept_a), (mem_b, kept_b) = marks[150], marks[399]
    limits = {
        **dict.fromkeys(("logs", "outputs", "metrics_sessions"), 8 + 3),  # 8 ended + 3 live
        **dict.fromkeys(("ended", "failures"), 8),
        **dict.fromkeys(("sinks", "live", "late_buffer", "fed", "silent"), 3),
        "inflight": 0,
        "metrics_window": 64,
        "metrics_recent": 256,
        "metrics_pauses": 4,
    }
    for key, limit in limits.items():
        assert kept_a[key] <= limit, key
        assert kept_b[key] <= limit, key
    assert kept_a["ended"] == kept_b["ended"] == 8  # 70 and 195 sessions had ended
    assert kept_b["metrics_window"] == 64
    assert kept_b["pool_allocated"] <= server.pool.capacity
    assert server.metrics.summary()["events"]["admitted"] == 200
    assert mem_b - mem_a < 512 * 1024, (mem_a, mem_b)
    assert len(list(tmp_path.iterdir())) == 200  # every session's files were still written


def _forget_lines(probe: Probe):
    """``probe.write`` that calls the hook but keeps nothing."""

    def write(text: str) -> int:
        row = json.loads(text)
        if row["type"] == "tick":
            probe.on_tick(row)
        return len(text)

    return write


def test_skipped_tick_attributed_to_the_host(engine):
    """A 450 ms stall preparing tick 6: tick 6 misses, the next one is skipped; both the host's."""
    engine.reset()
    probe = Probe()
    server = Server(engine, clock="realtime", loop="dispatch", warmup_ticks=2, metrics_sink=probe)
    prepare = server.prepare

    def slow_prepare(k):
        if k == 6:
            time.sleep(0.45)
        return prepare(k)

    server.prepare = slow_prepare
    server.run([SessionPlan(id="h", audio=_speech(3, 1))], 14)
    ticks = probe.ticks()
    assert ticks[6]["missed"]
    assert (ticks[6]["cause"], ticks[6]["host_stage"]) == ("host", "prepare")
    assert ticks[7]["skipped"]
    assert ticks[7]["cause"] == "host"
    summary = server.metrics.summary()
    assert summary["skipped_by_cause"]["host"] >= 1
    assert summary["missed_by_cause"]["host"] >= 1


@pytest.mark.parametrize("loop", ["dispatch", "resident"])
def test_idle_server_runs_no_tick_and_wakes_for_a_request(engine, loop):
    """Real time, nothing live past the warm-up: no tick runs (idle, neither run nor missed)
    until a scripted session's tick; after it leaves, none until a request through the hub,
    which is admitted at the next beat. The scripted session's output is the one it gets
    from a server that never idled (offline, joining at once)."""
    engine.reset()
    probe = Probe()
    asked = {}

    def on_tick(row):
        if row["tick"] == 12:  # the scripted session's release beat: idle from 13 on
            threading.Timer(0.5, ask).start()

    def ask():
        asked["at"] = time.monotonic()
        asked["slot"] = server.hub.admit(Join("w"))

    probe.on_tick = on_tick
    server = Server(engine, clock="realtime", loop=loop, warmup_ticks=2, metrics_sink=probe)
    server.run([SessionPlan(id="s", audio=_speech(1, 3), join=6, leave=12)], 30)
    ticks = probe.ticks()  # every tick run or skipped has a row; an idle one has none
    ran = sorted(ticks)
    # Two idle stretches: after the warm-up until the scripted join at 6, and after its release
    # beat (12, later where a loaded host skipped beats) until the request's beat, the first to
    # start after the beat thread woke; the new session is live from there to the end.
    gaps = [(a, b) for a, b in itertools.pairwise(ran) if b > a + 1]
    assert (ran[0], ran[-1]) == (0, 29)
    assert gaps[0] == (1, 6), ran
    assert len(gaps) == 2, ran
    released, woke = gaps[1]
    assert released >= 12
    assert asked["slot"].result(timeout=1) == 0
    assert 0 <= server.clock.tick_start(woke) - asked["at"] <= 1.0
    summary = server.metrics.summary()
    assert summary["idle_ticks"] == (6 - 2) + (woke - released - 1) == 30 - len(ran)
    # idle ticks are neither measured nor missed: the misses are those of the rows (none on a
    # host with time to spare)
    steady = [r for t, r in ticks.items() if t >= 2]
    assert summary["ticks"] == len(steady)
    assert summary["missed_ticks"] == sum(r["missed"] for r in steady)
    if any(ticks[t]["skipped"] for t in range(6, 12)):
        return  # an overloaded host skipped one of its beats: its frames differ from offline
    engine.reset()
    offline = Server(engine, clock="offline", loop="dispatch", warmup_ticks=0)
    offline.run([SessionPlan(id="s", audio=_speech(1, 3), join=0, leave=6)], 6)
    for k in ("text", "function", "codes", "wav"):
        np.testing.assert_array_equal(
            server.logs["s"].arrays()[k], offline.logs["s"].arrays()[k], err_msg=k
        )


class _SlowDevice:
    """The engine, with device iteration ``at`` of the resident loop taking ``extra`` s longer.

    The host learns a beat is done when the loop calls ``deliver``: delaying that call is, to the
    host, a slower device.
    """

    def __init__(self, engine: Engine, at: int, extra: float):
        self._engine, self._at, self._extra = engine, at, extra

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def compile_resident(self, next_beat, deliver):
        def slow_deliver(i, out):
            if i == self._at:
                time.sleep(self._extra)
            deliver(i, out)

        return self._engine.compile_resident(next_beat, slow_deliver)


def test_skipped_tick_attributed_to_the_device(engine):
    """Resident loop, beat 6's device work 450 ms late: tick 6 misses and tick 7 is skipped, both
    the device's; the host, on time, is blamed for neither."""
    engine.reset()
    probe = Probe()
    server = Server(
        _SlowDevice(engine, at=6, extra=0.45),
        clock="realtime",
        loop="resident",
        warmup_ticks=2,
        metrics_sink=probe,
    )
    server.run([SessionPlan(id="d", audio=_speech(3, 2))], 14)
    ticks = probe.ticks()
    assert ticks[6]["missed"]
    assert ticks[6]["cause"] == "device"
    assert ticks[6]["stages"]["device"] >= 0.45
    assert ticks[7]["skipped"]
    assert ticks[7]["cause"] == "device"
    assert server.metrics.summary()["skipped_by_cause"]["device"] >= 1


def test_request_stop_drains(engine, tmp_path):
    """A stop mid-run: no new session, the beat in flight is written, every live session ends
    with a shutdown event, its files closed and whole."""
    engine.reset()

    def on_tick(row):
        if row["tick"] == 6:
            server.request_stop()  # from the writer thread, as any thread may

    probe = Probe(on_tick)
    server = Server(
        engine, clock="realtime", loop="dispatch", warmup_ticks=0, metrics_sink=probe,
        output_dir=tmp_path,
    )  # fmt: skip
    plans = [SessionPlan(id=f"q{i}", audio=_speech(3, i)) for i in range(2)]
    plans.append(SessionPlan(id="late", audio=_speech(1, 9), join=15))
    server.run(plans, 40)
    ticks = probe.ticks()
    last = max(ticks)
    assert 6 <= last < 12  # it stopped within a few beats of the request
    assert dict(server.ended) == {"q0": "shutdown", "q1": "shutdown"}
    assert "late" not in server.logs
    assert "late" not in server.failures
    ended = [r for r in probe.rows if r["type"] == "event" and r["event"] == "ended"]
    assert sorted((r["session"], r["reason"]) for r in ended) == [
        ("q0", "shutdown"),
        ("q1", "shutdown"),
    ]
    ran = sum(not r["skipped"] for r in ticks.values())
    for sid in ("q0", "q1"):
        frames = _session_files_agree(tmp_path / sid)
        assert frames == 2 * ran == server.logs[sid].frames
        with wave.open(str(tmp_path / sid / "output.wav")) as w:
            assert w.getnframes() == frames * SAMPLES_PER_OUT_FRAME
    assert server.metrics.summary()["ended"] == {"shutdown": 2}
    # The frames kept in memory, written at once, give the same files as the stream did.
    again = tmp_path.parent / f"{tmp_path.name}_again"
    paths = write_session_outputs(str(again), "q0", server.logs["q0"], sample_rate=22050)
    for name in ("wav", "frames"):
        assert (
            pathlib.Path(paths[name]).read_bytes()
            == pathlib.Path(server.outputs["q0"][name]).read_bytes()
        )


def test_auto_loop_is_resident_where_it_can_serve():
    """``loop="auto"`` (every default): the resident loop on one device with one slot count, the
    dispatch loop on a mesh or with slot buckets; a named loop is kept, and the resident loop
    named where it cannot serve is refused."""
    assert ServerConfig().loop == "auto"
    assert pick_loop("auto", mesh=False, buckets=False) == "resident"
    assert pick_loop("auto", mesh=True, buckets=False) == "dispatch"
    assert pick_loop("auto", mesh=False, buckets=True) == "dispatch"
    assert pick_loop("dispatch", mesh=False, buckets=False) == "dispatch"
    with pytest.raises(ValueError, match=r"a mesh .* dispatch loop only"):
        pick_loop("resident", mesh=True, buckets=False)
    with pytest.raises(ValueError, match=r"slot buckets .* dispatch loop only"):
        pick_loop("resident", mesh=False, buckets=True)
    with pytest.raises(ValueError, match="loop must be one of"):
        ServerConfig(loop="eager")
