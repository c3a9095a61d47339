"""Shared test setup: offline Hugging Face, one torch thread, the tiny NeMo reference model.

The fixtures that build NeMo are session-scoped (building imports NeMo, ~20 s) and must not be
mutated by tests.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# NeMo resolves its LLM config and tokenizer through transformers: never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# One persistent compilation cache for the run, this process and every server or worker it starts
# (they inherit the environment): the CLI tests start many processes that compile the same tiny
# programs, and a cached one loads in a fraction of the compile (56 -> 29 s for a 2-second
# `voicechat-serve` run here). `step.CompileCounter` counts a cache load as a compile (the event
# wraps both), so the "compiled once" checks hold either way. Set before jax is imported.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="voicechat_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

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
