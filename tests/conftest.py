"""Shared test setup: offline Hugging Face, one torch thread, the tiny NeMo reference model.

The fixtures that build NeMo are session-scoped (building imports NeMo, ~20 s) and must not be
mutated by tests.
"""

from __future__ import annotations

import os

# NeMo resolves its LLM config and tokenizer through transformers: never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# One persistent compilation cache for the suite, inside the checkout (``.jax_cache/tests``,
# git-ignored), for this process and every worker, server or script it starts (they inherit the
# environment): the tests build the same tiny programs in two pytest-xdist workers and in
# subprocesses, and a cached program loads in a fraction of its compile (56 -> 29 s for a
# 2-second `voicechat-serve` run here). The cache outlives the run, so a developer's second run
# starts warm; CI's clean checkout starts cold. `step.CompileCounter` counts a cache load as a
# compile (the event wraps both), so the "compiled once" checks hold either way. Every program is
# kept, however short its compile, whichever cache directory is given: the ~25 ms compiles of
# single operations run outside jit add up (test_nano.py and test_gemma.py, warm: 31.8 -> 23.0 s
# here on 2026-12-08), while a cold suite gains little (587.6 s with programs over 0.2 s kept,
# 579.6 s with all of them, 1,708 entries and 45 MB). Set before jax is imported.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          ".jax_cache", "tests")  # fmt: skip
    os.makedirs(_cache, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# CPU code generation without LLVM's costly passes and with XLA's classic elemental emitters
# instead of its MLIR fusion emitters, for this process and every one it starts: the suite is
# mostly compiling tiny programs. The first two flags cut a compile-bound file such as
# test_engine.py from 245 to 179 s here; the third cut the tiny 4-slot staged tick's compile from
# 6.0 to 3.6 s and the tiny model's jitted init from 10.8 to 7.9 s, while a tick ran 10.1 ms
# against 8.8 (2026-12-05). The programs run a little slower; none comes near a beat. They change
# how XLA's CPU backend emits machine code, not the HLO it computes; with the classic emitters,
# though, the last bits of a computation can depend on the program around it (an unrolled
# encoder: docs/decisions.md), which is why the encoder is unrolled on GPUs only.
# The last flag runs XLA's CPU operations on the calling thread instead of an Eigen thread pool:
# the tiny programs gain nothing from a second thread, and the pool's threads, spinning while
# they wait for work, took CPU from the other pytest-xdist worker and the subprocesses on the 2
# cores. Cold suite runs here (2026-12-06): 570.4 s pytest, 977 s of user CPU at 5539608; with it,
# 459.6 s and 765 s.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [
            os.environ.get("XLA_FLAGS", ""),
            "--xla_backend_optimization_level=0",
            "--xla_llvm_disable_expensive_passes=true",
            "--xla_cpu_use_fusion_emitters=false",
            "--xla_cpu_multi_thread_eigen=false",
        ]
    ).strip()

import numpy as np
import pytest
import torch

from voicechat_jax.config import ModelConfig, tiny

# Tiny torch models on a shared 2-core machine run ~50x slower with torch's default thread pool.
torch.set_num_threads(1)

SEED = 0


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return tiny()


@pytest.fixture(scope="session")
def nemo_tiny(tiny_cfg, tmp_path_factory):
    """The tiny random NeMo ``NemotronVoiceChat`` (fp32, eval) of ``tests.reference.nemo_ref``."""
    from tests.reference.nemo_ref import build_tiny_nemo

    return build_tiny_nemo(tiny_cfg, tmp_path_factory.mktemp("nemo_tiny"), seed=SEED)


@pytest.fixture(scope="session")
def test_audio() -> np.ndarray:
    """2 s of 16 kHz test audio (26 encoder frames): two tone sweeps plus noise."""
    sr, n = 16000, 32000
    t = np.arange(n) / sr
    rng = np.random.default_rng(SEED)
    sweep = np.sin(2 * np.pi * (200 * t + 300 * t**2)) + 0.5 * np.sin(2 * np.pi * 1200 * t)
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 1.5 * t)
    return (0.2 * envelope * sweep + 0.02 * rng.standard_normal(n)).astype(np.float32)


# How the files are spread over the three pytest-xdist workers (pyproject.toml: ``-n 3 --dist
# loadfile``). Three on the 2-core machine, since the tests wait on real-time clocks,
# subprocesses and sockets part of the time: a cold run of 2026-12-06 took 381.0 s with three
# workers (690 s of user CPU, 194 % of a core); two took 459.6-505.1 s (765 s of user CPU in the
# 459.6 s run). A worker takes the next unit of work when it is nearly out of tests, so the longest
# units go first and the short ones fill the end. pytest-xdist 3.8 reorders its queue by the
# number of tests in a file (a 99-test file of table checks first, test_fleet.py's 38 s last, one
# worker idle meanwhile: the cold run of 2026-12-06, 144f833), so the suite brings its own
# scheduler (``pytest_xdist_make_scheduler`` below), which keeps this order and runs the files of
# a group in one worker: they then share what a process builds once (the NeMo reference model of
# ``nemo_tiny``, ~20 s; ``tests/shared.py``'s params, templates and engines; the programs
# ``step`` keeps per configuration), which the cold run of 2026-12-06 built in both workers.
GROUPS = {
    # every file that builds the tiny NeMo reference (``nemo_tiny``) or compares against a NeMo
    # module: NeMo is imported (~13 s) in one worker only, when a test first needs it
    "nemo": (
        "test_mesh.py",
        "test_convert.py",
        "test_pipeline.py",
        "test_checkpoint_integrity.py",
        "test_nemo_ref.py",
        "test_ear_tts.py",
        "test_conformer.py",
        "test_char_encoder.py",
        "test_codec.py",
        "test_rnnt.py",
        "test_mel.py",
        "test_model_full_size.py",
    ),
    # shared.engine(slots=3, context_frames=64) and the default 2-slot engine's programs
    "engine": ("test_engine.py", "test_server_host.py"),
    # the same four 3-slot, 8-frame configurations, staged and one-program
    "staged": ("test_staged_tick.py", "test_slot_rule.py"),
}
# Seconds of each unit (a group, or a file of no group) in one worker of a cold run of
# 2026-12-06 (the per-test durations of `--durations=0`, summed; the tests of dbb6751); a file
# not named here counts as 0 and runs after those that are. Longest first on two workers, that
# run's workers took 440 and 441 s of tests: 463.0 s in all, where one run of the same tests
# with test_fleet.py held to the end took 505.1 s. On three workers the "nemo" group, the
# longest unit, takes one worker while the other two share the rest.
UNIT_SECONDS = {
    "nemo": 203,  # its first five files, and the NeMo modules' tests
    "test_serve_cli.py": 132,  # voicechat-serve runs, in this process and as subprocesses
    "engine": 102,
    "test_conversation_memory.py": 68,  # the four-minute call
    "test_net.py": 62,  # and the browser call where Chromium is installed
    # three voicechat-serve subprocesses behind HAProxy (where it is installed): about 36 s
    # with their programs in the shared cache (test_serve_cli.py's runs, longest first, put
    # them there), 87 s when they compiled them beside the other worker (2026-12-06)
    "test_fleet.py": 36,
    "test_scheduler.py": 25,
    "test_decode_attention.py": 28,
    "test_realtime_ga.py": 25,
    "staged": 22,
    "test_policy_sim.py": 17,
    "test_mha_decode_attention.py": 16,
    "test_probe.py": 15,
    "test_precision.py": 16,
    "test_memory.py": 14,
    "test_pallas_mamba_step.py": 15,
    "test_nano.py": 18,
    "test_pallas_ssm_step.py": 10,
    "test_gemma.py": 12,
    "test_rollover.py": 10,
    "test_pallas_matmul.py": 6,
    "test_admission_sim.py": 6,
    "test_serving_host.py": 4,
    "test_stream_overlap.py": 3,
    "test_device_queue.py": 4,
    "test_tick_profile.py": 3,
}
_GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}


def _unit(file_name: str) -> str:
    """The unit of work a test file belongs to: its group, or the file itself."""
    return _GROUP_OF.get(file_name, file_name)


def pytest_collection_modifyitems(items):
    def key(item):
        unit = _unit(item.path.name)
        return -UNIT_SECONDS.get(unit, 0), unit

    items.sort(key=key)  # stable: the files of a unit, and the tests of a file, keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` by unit (``GROUPS``) in the order of ``pytest_collection_modifyitems``
    (pytest-xdist's reordering by test count off); any other ``--dist`` as pytest-xdist has it."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)
