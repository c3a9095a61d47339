"""Calls past the context cap: the conversation memory, its capsule, and the server's roll-overs.

Unit tests of ``serving.memory`` (turns, bounds, the capsule in both forms, the thresholds), then
serving runs of the tiny random model on the offline clock with a small cap: a long call rolls
over several times and loses and repeats no frame, each roll-over is reported once, the capsule
the device gets is at most U ids and comes from the memory, a neighbour's outputs do not change,
nothing recompiles; and ``voicechat-serve --at_cap=memory`` runs.
"""

from __future__ import annotations

import json
import pathlib
import wave

import chex
import numpy as np
import pytest

from tests import shared
from voicechat_jax import step as step_lib
from voicechat_jax.cli import serve as serve_cli
from voicechat_jax.config import BOS_ID, EOS_ID, PAD_ID, ServeConfig, tiny
from voicechat_jax.precision import Precision
from voicechat_jax.serving.memory import (
    AGENT,
    DIRECTIVE,
    USER,
    ConversationMemory,
    MemoryConfig,
    RolloverPolicy,
    Turn,
    build_capsule,
)
from voicechat_jax.serving.server import Engine, Server, SessionPlan

CFG = tiny()
PREC = Precision.fp32()
FPT = 2
CAP = 32
U = 8
SAMPLES_PER_OUT_FRAME = 1764
REPO = pathlib.Path(__file__).resolve().parent.parent


# ---- the memory ---------------------------------------------------------------------------------


def _observe(mem: ConversationMemory, agent: list[int | None], user: list[list[int]]):
    """One call of ``observe`` with T frames: agent ids (None: PAD) and each frame's RNNT ids."""
    T = len(agent)
    text = np.asarray([PAD_ID if a is None else a for a in agent], np.int32)
    M = max(1, max(len(u) for u in user))
    transcript = np.zeros((T, M), np.int32)
    n = np.zeros((T,), np.int32)
    for t, ids in enumerate(user):
        transcript[t, : len(ids)] = ids
        n[t] = len(ids)
    mem.observe(text, transcript, n)


def test_memory_splits_turns_by_silence():
    mem = ConversationMemory(MemoryConfig(turn_gap_frames=2))
    # The caller speaks (frames 0-2), a gap; the agent answers (frames 5-7), with PAD inside.
    _observe(mem, [None] * 5, [[3], [4, 5], [6], [], []])
    assert mem.silent_frames() == 2
    _observe(mem, [20, None, 21, BOS_ID, EOS_ID], [[], [], [], [], []])
    turns = mem.turns()
    assert turns == [Turn(USER, (3, 4, 5, 6), 0), Turn(AGENT, (20, 21), 5)]
    assert mem.silent_frames() == 2  # BOS/EOS are not words
    _observe(mem, [None, 22], [[7], []])  # both speak again: new turns, the old ones kept
    assert mem.silent_frames() == 0
    assert [t.ids for t in mem.turns()] == [(3, 4, 5, 6), (20, 21), (7,), (22,)]


def test_memory_is_bounded_in_turns_and_tokens():
    mem = ConversationMemory(MemoryConfig(turn_gap_frames=1, max_turns=3, max_turn_tokens=4))
    for i in range(10):  # ten agent turns of 6 ids each, one silent frame after each
        _observe(mem, [*range(100 * i, 100 * i + 6), None], [[]] * 7)
    turns = mem.turns()
    assert [t.ids for t in turns] == [
        (702, 703, 704, 705),
        (802, 803, 804, 805),
        (902, 903, 904, 905),
    ]
    assert mem.retained() == 12


# ---- the capsule --------------------------------------------------------------------------------


class CharTokenizer:
    """A toy LLM tokenizer: one id per character (ord + 100), decoded back."""

    def encode(self, text):
        return [ord(c) + 100 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 100) for i in ids)


def _asr_decode(ids):
    return "".join(chr(i) for i in ids)


TURNS = [
    Turn(AGENT, tuple(CharTokenizer().encode("hello there")), 0),
    Turn(USER, tuple(map(ord, "hi, my order is late")), 10),
    Turn(AGENT, tuple(CharTokenizer().encode("let me check")), 30),
]


def test_capsule_raw_ids_are_the_agent_turns_newest_first():
    turns = [Turn(AGENT, (30, 31, 32), 0), Turn(USER, (5, 6), 4), Turn(AGENT, (40, 41), 9)]
    got = build_capsule(turns, 96)
    np.testing.assert_array_equal(got, [BOS_ID, 30, 31, 32, EOS_ID, BOS_ID, 40, 41, EOS_ID])
    # Room for the newest turn only: the older one goes whole, not cut.
    np.testing.assert_array_equal(build_capsule(turns, 6), [BOS_ID, 40, 41, EOS_ID])
    # Not even the newest fits: its most recent ids.
    np.testing.assert_array_equal(build_capsule(turns, 3), [40, 41, EOS_ID])
    assert build_capsule(turns, 0).shape == (0,)
    assert build_capsule([Turn(USER, (5,), 0)], 8).shape == (0,)  # no agent turn: empty
    assert build_capsule(turns, 4).dtype == np.int32


def test_capsule_in_text_with_prefixes_and_directive():
    tok = CharTokenizer()
    got = build_capsule(TURNS, 200, llm_tokenizer=tok, asr_decode=_asr_decode)
    want = DIRECTIVE + "\nAgent: hello there\nUser: hi, my order is late\nAgent: let me check"
    assert tok.decode(got.tolist()) == want
    # Without the RNNT's tokenizer the caller's turn cannot be re-tokenized: left out.
    got = build_capsule(TURNS, 200, llm_tokenizer=tok)
    assert tok.decode(got.tolist()) == DIRECTIVE + "\nAgent: hello there\nAgent: let me check"
    # Bounded: the directive and the newest turns that fit.
    n = len(DIRECTIVE) + len("\nAgent: let me check")
    got = build_capsule(TURNS, n + 5, llm_tokenizer=tok, asr_decode=_asr_decode)
    assert got.shape[0] == n
    assert tok.decode(got.tolist()) == DIRECTIVE + "\nAgent: let me check"
    # Too small for the directive: the turns come first.
    got = build_capsule(TURNS, 12, llm_tokenizer=tok, asr_decode=_asr_decode)
    assert tok.decode(got.tolist()) == "let me check"


# ---- the policy ---------------------------------------------------------------------------------


def test_thresholds_scale_to_the_cap():
    full = RolloverPolicy.for_cap("memory", 1500, 2)
    assert (full.soft_frames, full.hard_frames, full.capsule_limit) == (1125, 1375, 96)
    small = RolloverPolicy.for_cap("memory", 32, 2, capsule_tokens=8)
    assert (small.soft_frames, small.hard_frames, small.capsule_limit) == (24, 28, 8)
    tight = RolloverPolicy.for_cap("reset", 6, 2)
    assert tight.hard_frames <= 4
    assert tight.soft_frames <= tight.hard_frames
    assert tight.capsule_limit == 0  # reset: always an empty capsule
    assert small.decide(23, 100) is None
    assert small.decide(24, 3) is None  # between the thresholds, no pause yet
    assert small.decide(24, 4) == "pause"
    assert small.decide(28, 0) == "hard"
    for mode in ("end", "rollover"):  # the host rolls nothing over
        assert RolloverPolicy.for_cap(mode, 32, 2).decide(1000, 1000) is None
    with pytest.raises(ValueError, match="at_cap must be one of"):
        RolloverPolicy(mode="wrap")
    with pytest.raises(ValueError, match="at_cap must be"):
        ServeConfig(at_cap="wrap")


def _simulate(policy: RolloverPolicy, sessions: int, beats: int, silent=lambda b, k: 0):
    """Sessions that all start at beat 0, served by ``policy.plan``: (beat, slot, reason,
    context at the roll-over) for every roll-over."""
    context = [0] * sessions
    rolled = []
    for k in range(beats):
        chosen = policy.plan([(b, context[b], silent(b, k)) for b in range(sessions)])
        for b, reason in chosen:
            rolled.append((k, b, reason, context[b]))
            context[b] = 0
        context = [c + policy.frames_per_tick for c in context]
    return rolled


def test_plan_spreads_sessions_that_started_together():
    """56 sessions admitted in one beat and never silent: one roll-over a beat, every one of them
    between the thresholds (the runtime's 1,125 / 1,375 frames), none at the same beat."""
    policy = RolloverPolicy.for_cap("reset", 1500, 2, max_per_beat=1)
    rolled = _simulate(policy, 56, 700)
    first = [r for r in rolled if r[0] < 690]
    assert sorted(b for _, b, _, _ in first[:56]) == list(range(56))  # each once, first round
    beats = [k for k, *_ in rolled]
    assert len(set(beats)) == len(beats)  # at most one a beat
    assert all(1125 <= c <= 1375 + 1 for *_, c in rolled)
    assert {r for _, _, r, _ in first[:56]} <= {"spread", "hard"}
    # With room for two a beat, the same load takes half the beats, still two at most per beat.
    two = _simulate(RolloverPolicy.for_cap("reset", 1500, 2, max_per_beat=2), 56, 700)
    counts = np.bincount([k for k, *_ in two])
    assert counts.max() == 2
    assert all(1125 <= c <= 1376 for *_, c in two)


def test_plan_takes_hard_then_pause_then_spread_within_its_budget():
    policy = RolloverPolicy.for_cap("memory", 1500, 2, max_per_beat=2)
    # slot 0 past hard, slot 1 at a pause, slot 2 past hard with more context, slot 3 too young
    got = policy.plan([(0, 1380, 0), (1, 1200, 9), (2, 1390, 0), (3, 1000, 9)])
    assert got == [(2, "hard"), (0, "hard")]
    got = policy.plan([(1, 1200, 9), (3, 1000, 9), (4, 1130, 0)])
    assert got == [(1, "pause")]  # slot 4 can wait: it has 123 beats to the hard threshold
    # More sessions past the soft threshold than the beats left can take: spread them now.
    crowd = [(b, 1370, 0) for b in range(8)]
    assert [r for _, r in policy.plan(crowd)] == ["spread", "spread"]
    assert RolloverPolicy.for_cap("rollover", 1500, 2).plan(crowd) == []  # the device's, at the cap
    with pytest.raises(ValueError, match="max_per_beat"):
        RolloverPolicy.for_cap("reset", 1500, 2, max_per_beat=0)


# ---- serving runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    params = shared.params(PREC)
    serve = ServeConfig(
        slots=2,
        frames_per_tick=FPT,
        context_frames=CAP,
        capsule_tokens=U,
        at_cap="memory",
        precision=PREC,
    )
    eng = Engine(params, CFG, serve)
    eng.compile_tick()
    return eng


def _speech(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal(int(seconds * 16000))).clip(-1, 1).astype(np.float32)


class Recording(Server):
    """A server that keeps what it asked of the device: tick -> {slot: capsule ids}."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked: dict[int, dict[int, np.ndarray]] = {}

    def prepare(self, k):
        beat = super().prepare(k)
        rolled = {
            int(b): beat.capsule[b, : beat.capsule_len[b]].copy()
            for b in np.nonzero(beat.reseed)[0]
        }
        if rolled:
            self.asked[k] = rolled
        return beat


class Rows:
    """A metrics sink keeping its JSON rows."""

    def __init__(self):
        self.rows: list[dict] = []

    def write(self, text: str) -> int:
        self.rows.append(json.loads(text))
        return len(text)

    def flush(self) -> None:
        pass


def _serve(engine, plans, n_ticks, **kw):
    kw.setdefault("loop", "dispatch")  # the resident loop has its own test below
    sink = Rows()
    server = Recording(
        engine, clock="offline", metrics_sink=sink, vanish_beats=None, max_backlog_beats=None, **kw
    )
    counter = step_lib.CompileCounter("tick")
    with counter:
        server.run(plans, n_ticks)
    assert counter.count == 0  # the tick was compiled once, before; a roll-over is data
    return server, sink.rows


def test_long_call_rolls_over_without_losing_a_frame(engine, tmp_path):
    n_ticks = 60
    server, rows = _serve(
        engine, [SessionPlan("a", _speech(n_ticks * 0.16, 1))], n_ticks, output_dir=tmp_path
    )
    events = [r for r in rows if r.get("event") == "rollover"]
    assert len(events) >= 2
    assert all(e["session"] == "a" for e in events)
    # Each roll-over is reported once, at the beat the host asked for it.
    assert [e["tick"] for e in events] == sorted(server.asked)
    assert len({e["tick"] for e in events}) == len(events) == server.rollovers
    soft, hard = server.rollover.soft_frames, server.rollover.hard_frames
    for e in events:
        # Asked a beat ahead (at most FPT - 1 frames past a threshold), applied a beat later.
        assert e["reason"] in ("pause", "hard")
        assert soft + FPT <= e["context"] <= hard + 2 * FPT - 1
        assert e["context"] <= CAP
        assert e["frame"] == FPT * (e["tick"] + 1)
    # No frame lost or repeated: the files hold every tick's frames, numbered 0..n-1.
    lines = [json.loads(x) for x in (tmp_path / "a" / "frames.jsonl").read_text().splitlines()]
    assert [r["frame"] for r in lines] == list(range(n_ticks * FPT))
    marked = {r["frame"] // FPT: r["rollover"] for r in lines if "rollover" in r}
    assert sorted(marked) == [e["tick"] for e in events]
    assert all(r["frame"] % FPT == 0 for r in lines if "rollover" in r)
    with wave.open(str(tmp_path / "a" / "output.wav")) as w:
        assert w.getnframes() == n_ticks * FPT * SAMPLES_PER_OUT_FRAME
    log = server.logs["a"]
    assert log.frames == n_ticks * FPT
    wav = log.audio()
    assert np.all(np.isfinite(wav))
    assert wav.shape[0] == n_ticks * FPT * SAMPLES_PER_OUT_FRAME
    # The capsule: at most U ids, the agent's own words (raw ids: no tokenizer here), each
    # framed BOS ... EOS, and each a run of ids the agent said before the roll-over.
    text = log.arrays()["text"]
    for e in events:
        capsule = server.asked[e["tick"]][0]
        assert capsule.shape[0] == e["capsule_len"] == marked[e["tick"]]["capsule_len"]
        assert capsule.shape[0] <= U
        said = [int(t) for t in text[: FPT * e["tick"]] if t not in (PAD_ID, BOS_ID, EOS_ID)]
        words = [int(t) for t in capsule if t not in (BOS_ID, EOS_ID)]
        if capsule.shape[0]:
            assert capsule[-1] == EOS_ID
            assert any(said[i : i + len(words)] == words for i in range(len(said)))
    assert any(server.asked[e["tick"]][0].shape[0] > 0 for e in events)
    kept = server.retained()  # the session is live at the end: one of each, no more
    assert (kept["memories"], kept["context"], kept["live"]) == (1, 1, 1)


def test_resident_loop_rolls_over_as_the_dispatch_loop(engine):
    """The resident loop prefills a capsule asked a beat ahead in its own lane (``step``'s
    ``_next_lane``), the staged dispatch loop in a program of its own: the same roll-overs, the
    same outputs bit for bit."""
    plans = [SessionPlan("a", _speech(40 * 0.16, 4))]
    runs = {}
    for loop in ("dispatch", "resident"):
        engine.reset()
        server, rows = _serve(engine, plans, 40, loop=loop)
        events = [(r["tick"], r["capsule_len"]) for r in rows if r.get("event") == "rollover"]
        runs[loop] = server.logs["a"].arrays(), events
    assert runs["dispatch"][1] == runs["resident"][1]
    assert any(n > 0 for _, n in runs["dispatch"][1])  # a capsule was prefilled
    chex.assert_trees_all_equal(runs["dispatch"][0], runs["resident"][0])


def test_neighbour_unchanged_by_a_rollover(engine):
    """Session b's outputs are the same whether or not its neighbour a rolls over beside it."""
    audio_a, audio_b = _speech(4.0, 2), _speech(4.0, 3)

    def run(a_leave):
        engine.reset()
        plans = [
            SessionPlan("a", audio_a, join=0, leave=a_leave),
            SessionPlan("b", audio_b, join=4, leave=16),  # leaves before its own roll-over
        ]
        server, rows = _serve(engine, plans, 20)
        return server, [r for r in rows if r.get("event") == "rollover"]

    rolled, events = run(None)
    assert [e["session"] for e in events][:1] == ["a"]
    assert events[0]["tick"] < 16
    assert not any(e["session"] == "b" for e in events)
    plain, none = run(8)  # a leaves before it would roll over
    assert none == []
    x, y = rolled.logs["b"].arrays(), plain.logs["b"].arrays()
    assert x["text"].shape[0] == 12 * FPT
    for name in ("text", "function", "codes", "wav", "transcript", "n_transcript"):
        np.testing.assert_array_equal(x[name], y[name])


def test_sessions_due_together_roll_over_in_different_beats(engine):
    """Two sessions admitted together reach the soft threshold together; the server rolls them
    over one a beat (the default budget), each by the hard threshold."""
    engine.reset()
    plans = [SessionPlan(s, _speech(6.4, i + 5)) for i, s in enumerate("ab")]
    server, rows = _serve(engine, plans, 40)
    events = [r for r in rows if r.get("event") == "rollover"]
    assert {e["session"] for e in events} == {"a", "b"}
    ticks = [e["tick"] for e in events]
    assert len(set(ticks)) == len(ticks)
    hard = server.rollover.hard_frames
    assert all(e["context"] <= hard + 2 * FPT - 1 for e in events)
    assert all(len(asked) == 1 for asked in server.asked.values())


def test_reset_rolls_over_with_an_empty_capsule():
    params = shared.params(PREC)
    serve = ServeConfig(
        slots=1,
        frames_per_tick=FPT,
        context_frames=16,
        capsule_tokens=U,
        at_cap="reset",
        precision=PREC,
    )
    eng = Engine(params, CFG, serve)
    eng.compile_tick()
    server, rows = _serve(eng, [SessionPlan("a", _speech(4.0, 4))], 24)
    events = [r for r in rows if r.get("event") == "rollover"]
    assert len(events) >= 2
    assert all(e["capsule_len"] == 0 for e in events)
    assert all(c.shape == (0,) for asked in server.asked.values() for c in asked.values())
    assert server.logs["a"].frames == 24 * FPT


def test_cli_at_cap_memory_runs(tmp_path):
    """``voicechat-serve --at_cap=memory`` (the app called in this process)."""
    out = tmp_path / "run"
    proc = shared.run_cli(
        serve_cli,
        "--at_cap=memory",
        "--context_frames=24",
        "--sessions=1",
        "--slots=1",
        "--seconds=5",
        "--clock=offline",  # the default precision: its programs are in the tests' shared cache
        "--loop=dispatch",  # (the resident loop of this size is kept by no other test)
        f"--output_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if r.get("event") == "rollover"]
    assert len(events) >= 2  # 62 frames past a cap of 24
    frames = (out / "s000" / "frames.jsonl").read_text().splitlines()
    assert len(frames) == 2 * round(5 / 0.16)
    assert not any(r.get("event") == "ended" and r.get("reason") == "context cap" for r in rows)


def test_four_minute_call_rolls_over_twice_at_the_real_thresholds(tmp_path):
    """A 4-minute call (1,500 beats) at the 1,500-frame cap and the runtime's thresholds (soft
    1,125, hard 1,375 frames): at least two roll-overs, each inside the thresholds with a capsule
    of at most 96 ids; no frame lost or repeated; the audio runs on across every boundary (the
    codec's streaming state is kept: the jump at a boundary is no larger than the call's own
    sample-to-sample steps); the tick compiled once. (On 2026-12-06 this call rolled over at
    beats 689 and 1,330, each at the hard threshold with a 96-id capsule.)"""
    n_ticks = 1500  # 240 s of 160 ms beats
    params = shared.params(PREC)
    serve = ServeConfig(
        slots=1, frames_per_tick=FPT, context_frames=1500, at_cap="memory", precision=PREC
    )
    eng = Engine(params, CFG, serve)
    eng.compile_tick()
    server, rows = _serve(
        eng, [SessionPlan("a", _speech(n_ticks * 0.16, 7))], n_ticks, output_dir=tmp_path
    )
    events = [r for r in rows if r.get("event") == "rollover"]
    assert (server.rollover.soft_frames, server.rollover.hard_frames) == (1125, 1375)
    assert len(events) >= 2
    for e in events:
        assert 1125 + FPT <= e["context"] <= 1375 + 2 * FPT - 1  # applied a beat after asked
        assert e["capsule_len"] <= 96
    lines = [json.loads(x) for x in (tmp_path / "a" / "frames.jsonl").read_text().splitlines()]
    assert [r["frame"] for r in lines] == list(range(n_ticks * FPT))
    wav = server.logs["a"].audio()
    assert wav.shape[0] == n_ticks * FPT * SAMPLES_PER_OUT_FRAME
    assert np.all(np.isfinite(wav))
    step = np.abs(np.diff(wav))
    for e in events:
        at = FPT * e["tick"] * SAMPLES_PER_OUT_FRAME  # the first sample after the roll-over
        assert step[at - 1] <= np.quantile(step, 0.999), (e, step[at - 1])
