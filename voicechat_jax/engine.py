"""The device side of a serving run: parameters, the fresh-session template, the slot state and
the compiled tick (``Engine``). The host side that drives it on the beat clock is
``serving.server.Server``.
"""

from __future__ import annotations

import functools
import time

import jax

from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ModelConfig, ServeConfig
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision


class Engine:
    """The device side: params, template, slot state and the compiled tick."""

    def __init__(self, params, cfg: ModelConfig, serve: ServeConfig, precision: Precision):
        self.params = params
        self.cfg = cfg
        self.serve = serve
        self.precision = precision
        t = time.perf_counter()
        # Jitted: op by op, the 11B template took ~60 s on an H200, mostly per-op compiles.
        initial = jax.jit(
            functools.partial(
                voicechat.initial_state,
                cfg=cfg,
                precision=precision,
                max_len=serve.context_frames,
                system_prompt=serve.system_prompt,
                deterministic=serve.deterministic,
            )
        )
        self.template = initial(params)
        jax.block_until_ready(self.template)
        self.template_s = time.perf_counter() - t
        self.state = state_lib.from_template(self.template, serve.slots)
        self.samples_per_beat = serve.frames_per_tick * cfg.encoder.mel.samples_per_frame
        self._tick = None
        self.compile_s: float | None = None

    def reset(self) -> None:
        """Every slot back to the fresh template, none live (the compiled tick is kept)."""
        self.state = state_lib.from_template(self.template, self.serve.slots)

    def empty_beat(self) -> state_lib.BeatInput:
        return state_lib.empty_beat(self.serve.slots, self.samples_per_beat)

    def compile_tick(self):
        """Compiles the dispatch tick once; returns the executable."""
        if self._tick is None:
            t = time.perf_counter()
            jitted = step_lib.make_tick(self.cfg, self.serve, self.precision)
            self._tick = jitted.lower(
                self.params, self.state, self.template, self.empty_beat()
            ).compile()
            self.compile_s = time.perf_counter() - t
        return self._tick

    def tick(self, beat: state_lib.BeatInput) -> state_lib.BeatOutput:
        """Dispatches one beat (asynchronously); the state is donated and replaced."""
        self.state, out = self.compile_tick()(self.params, self.state, self.template, beat)
        return out

    def compile_resident(self, next_beat, deliver):
        """Compiles the resident loop bound to these host callbacks; returns the executable."""
        t = time.perf_counter()
        fn = step_lib.make_resident(self.cfg, self.serve, self.precision, next_beat, deliver)
        compiled = fn.lower(self.params, self.state, self.template, self.empty_beat()).compile()
        self.compile_s = time.perf_counter() - t
        return compiled

    def run_resident(self, compiled, first_beat: state_lib.BeatInput) -> None:
        """Runs the whole serving run as one on-device loop; the state is donated and replaced."""
        self.state = compiled(self.params, self.state, self.template, first_beat)
        jax.block_until_ready(self.state)
