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
# compile (the event wraps both), so the "compiled once" checks hold either way. Set before jax is
# imported.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          ".jax_cache", "tests")  # fmt: skip
    os.makedirs(_cache, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# CPU code generation without LLVM's costly passes and with XLA's classic elemental emitters
# instead of its MLIR fusion emitters, for this process and every one it starts: the suite is
# mostly compiling tiny programs. The first two flags cut a compile-bound file such as
# test_engine.py from 245 to 179 s here; the third cut the tiny 4-slot staged tick's compile from
# 6.0 to 3.6 s and the tiny model's jitted init from 10.8 to 7.9 s, while a tick ran 10.1 ms
# against 8.8 (2026-12-05). The programs run a little slower; none comes near a beat. They change
# how XLA's CPU backend emits machine code, not the HLO it computes; with the classic emitters,
# though, the last bits of a computation can depend on the program around it (an unrolled
# encoder: docs/decisions.md), which is why the encoder is unrolled on GPUs only.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [
            os.environ.get("XLA_FLAGS", ""),
            "--xla_backend_optimization_level=0",
            "--xla_llvm_disable_expensive_passes=true",
            "--xla_cpu_use_fusion_emitters=false",
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


# The files that take longest run first. The suite runs on two pytest-xdist workers, a file at a
# time (pyproject.toml: ``-n 2 --dist loadfile``); a long file started last would keep one worker
# busy after the other has finished. After each name: its slowest tests' seconds here, one worker.
SLOW_FIRST = (
    "test_mesh.py",  # one 4-device subprocess: the data mesh, tensor parallelism, the server
    "test_serve_cli.py",  # 206: voicechat-serve subprocesses, one on the real-time clock
    "test_engine.py",  # 191
    "test_conversation_memory.py",  # 135
    "test_net.py",  # 61, and the browser call where Chromium is installed
    "test_staged_tick.py",  # 51
    "test_convert.py",  # 49
    "test_pipeline.py",  # 47
    "test_scheduler.py",  # 44
    "test_ear_tts.py",  # 43
    "test_server_host.py",  # 39
    "test_fleet.py",  # three servers behind HAProxy where it is installed
)


def pytest_collection_modifyitems(items):
    rank = {name: k for k, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file
