"""What the suite builds once per process and shares: the tiny model's params, templates, engines.

The tiny random model takes ~20 s to initialise op by op on a 2-core machine and ~10 s to compile
one engine's tick, and a dozen test files used to rebuild them for themselves. Here each is built
once per process (pytest-xdist runs two), jitted (``voicechat.init_compiled``: the persistent
compilation cache of ``tests/conftest.py`` then serves the second worker and every subprocess),
and handed out by configuration:

- ``params(precision)``: the tiny model's params, key 0 (every engine test's weights);
- ``template(serve)``: the fresh-session state; it depends only on the fields of ``ServeConfig``
  that ``engine.template_fn`` reads, so engines that differ in slots, kernels or the cap policy
  share it;
- ``engine(serve, staged=...)``: one ``Engine`` per configuration, ``reset`` (every slot back to
  the template, the compiled tick kept) each time it is handed out. Tests that count compiles of
  a fresh engine, or that change an engine beyond its state, build their own;
- ``initial_state(params, **static)``: ``voicechat.initial_state`` jitted, per static arguments;
- ``sub_jaxprs(eqn)``: the jaxprs nested in an equation, for the tests that walk a traced frame.

Nothing here may be mutated by a test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import shutil

import jax
import numpy as np
import pytest

from voicechat_jax import precision as precision_lib
from voicechat_jax.config import ModelConfig, ServeConfig, tiny
from voicechat_jax.engine import Engine, build_template
from voicechat_jax.model import voicechat

CFG: ModelConfig = tiny()
# Checkpoint shards small enough to split the tiny model's stacked leaves by layer (about 110
# shards), few enough that writing and restoring them stays cheap (each shard is one orbax call).
SMALL_SHARDS = 16384


def sub_jaxprs(eqn) -> list:
    """The jaxprs an equation holds in its params (a scan's, a loop's, a jitted call's body),
    each as a ``Jaxpr`` (a ``ClosedJaxpr`` unwrapped)."""
    subs = jax.tree_util.tree_leaves(eqn.params, is_leaf=lambda x: hasattr(x, "eqns"))
    return [s for s in (getattr(s, "jaxpr", s) for s in subs) if hasattr(s, "eqns")]


@functools.cache
def nemo_module(name: str):
    """The NeMo module ``name``, imported when a test first needs it rather than when its file is
    collected: NeMo's import takes ~13 s, and every pytest-xdist worker collects every file (the
    test is skipped where NeMo is missing)."""
    return pytest.importorskip(name)


def _policy(precision: precision_lib.Precision | str) -> precision_lib.Precision:
    return precision_lib.POLICIES[precision]() if isinstance(precision, str) else precision


def initial_state(params, **static) -> voicechat.FrameState:
    """``voicechat.initial_state(params, **static)`` jitted, one program per process and set of
    static arguments: op by op it compiled each of its ~400 operations on its own."""
    return _initial_state_program(**static)(params)


@functools.cache
def _initial_state_program(**static):
    return jax.jit(functools.partial(voicechat.initial_state, **static))


def params(precision: precision_lib.Precision | str = "fp32") -> voicechat.ModelParams:
    """The tiny model's random params under ``precision`` (key 0), built once per process."""
    return _params(_policy(precision))


@functools.cache
def _params(precision: precision_lib.Precision) -> voicechat.ModelParams:
    """fp32: ``init_compiled``. Any other policy: the fp32 params cast to its dtypes, in one
    program instead of five inits: ``init`` draws every weight in fp32 and casts it
    (``common.normal``), so the cast is the policy's own init bit for bit (every policy checked
    on 2026-12-06), at a fifth of the compiles. A policy whose tree differs gets its own init."""
    fp32 = precision_lib.Precision.fp32()
    if precision == fp32:
        return jax.block_until_ready(voicechat.init_compiled(jax.random.key(0), CFG, fp32))
    base, want = _params(fp32), voicechat.abstract(CFG, precision)
    if jax.tree_util.tree_structure(base) != jax.tree_util.tree_structure(want):
        return jax.block_until_ready(voicechat.init_compiled(jax.random.key(0), CFG, precision))
    dtypes = tuple(np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(want))
    return jax.block_until_ready(_cast(base, dtypes))


@functools.partial(jax.jit, static_argnums=1)
def _cast(params, dtypes: tuple):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return jax.tree_util.tree_unflatten(
        treedef, [x.astype(d) for x, d in zip(leaves, dtypes, strict=True)]
    )


def template(serve: ServeConfig):
    """The fresh-session state of ``serve`` on ``params(serve.precision)``, built once for the
    fields of ``serve`` it depends on (those ``engine.template_fn`` reads)."""
    return _template(serve.precision, serve.context_frames, serve.system_prompt,
                     serve.speech_sampling)  # fmt: skip


@functools.cache
def _template(precision, context_frames: int, system_prompt: tuple, speech_sampling: str):
    serve = ServeConfig(
        precision=precision,
        context_frames=context_frames,
        system_prompt=system_prompt,
        speech_sampling=speech_sampling,
    )
    return jax.block_until_ready(build_template(params(precision), CFG, serve))


@functools.cache
def _engine(serve: ServeConfig, staged: bool | None) -> Engine:
    return Engine(params(serve.precision), CFG, serve, template=template(serve), staged=staged)


def engine(serve: ServeConfig, *, staged: bool | None = None) -> Engine:
    """The shared engine of ``serve`` (on ``params(serve.precision)``), reset."""
    e = _engine(serve, staged)
    e.reset()
    return e


@dataclasses.dataclass
class Ran:
    """What a command-line app called in this process left (as ``subprocess.run`` reports)."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(module, *flags: str) -> Ran:
    """``module``'s app (``voicechat_jax.cli.convert``, ...) with ``flags``, in this process: its
    own flag parser, then its ``main``; a failure's ``SystemExit`` is its exit status."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main(module._parse_flags([module.__name__, *flags]))
        except SystemExit as e:
            code = e.code
    return Ran(0 if code is None else code, out.getvalue(), err.getvalue())


# Debian's Chromium for the browser tests (.ci/run installs it), with a fake microphone and
# camera, allowed without a prompt, and audio that plays without a user gesture.
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
)


def chromium() -> str:
    """Chromium's path; skips the test where it is not installed."""
    path = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if path is None:
        pytest.skip("no Chromium installed (apt-get install chromium); .ci/run installs it")
    return path


def launch_chromium(playwright, *args: str):
    """Headless Chromium through Playwright with ``CHROMIUM_ARGS`` and ``args``."""
    return playwright.chromium.launch(
        executable_path=chromium(), headless=True, args=[*CHROMIUM_ARGS, *args]
    )
