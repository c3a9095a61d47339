"""``callback_cache``: a program with host callbacks kept on disk and loaded bound to the new
callbacks, on a small jitted function (the resident loop's case is in test_engine.py)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from voicechat_jax import callback_cache


def _program(calls: list, tag: str):
    """A jitted function with two ordered host callbacks, each recording ``tag`` and which one
    ran: the loaded program must call this process's pair, each in its own place."""

    def first(x):
        calls.append((tag, "first", float(x)))
        return np.float32(2 * x)

    def second(y):
        calls.append((tag, "second", float(y)))
        return np.float32(y + 1)

    def f(x):
        y = io_callback(first, jax.ShapeDtypeStruct((), jnp.float32), x, ordered=True)
        return io_callback(second, jax.ShapeDtypeStruct((), jnp.float32), y * 3, ordered=True)

    return jax.jit(f)


def _entries(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(callback_cache.SUFFIX))


def test_kept_program_loads_bound_to_the_new_callbacks(tmp_path):
    calls = []
    x = jnp.float32(1.5)
    before = callback_cache.stats()
    with callback_cache.kept(str(tmp_path)):
        compiled_a = _program(calls, "a").lower(x).compile()
    assert callback_cache.stats()["stored"] == before["stored"] + 1
    (entry,) = _entries(tmp_path)

    with callback_cache.kept(str(tmp_path)):  # a program of new callbacks: the same entry
        compiled_b = _program(calls, "b").lower(x).compile()
    assert callback_cache.stats()["loaded"] == before["loaded"] + 1
    assert _entries(tmp_path) == [entry]

    assert float(compiled_b(x)) == 10.0  # (2 * 1.5) * 3 + 1
    assert calls == [("b", "first", 1.5), ("b", "second", 9.0)]
    calls.clear()
    assert float(compiled_a(x)) == 10.0
    assert calls == [("a", "first", 1.5), ("a", "second", 9.0)]


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path):
    calls = []
    x = jnp.float32(0.5)
    with callback_cache.kept(str(tmp_path)):
        _program(calls, "a").lower(x).compile()
    (entry,) = _entries(tmp_path)
    path = tmp_path / entry
    path.write_bytes(path.read_bytes()[:100])
    before = callback_cache.stats()
    with callback_cache.kept(str(tmp_path)):
        compiled = _program(calls, "c").lower(x).compile()
    assert callback_cache.stats() == {**before, "stored": before["stored"] + 1}
    assert float(compiled(x)) == 4.0
    assert calls == [("c", "first", 0.5), ("c", "second", 3.0)]
    assert path.stat().st_size > 100


def test_nothing_kept_outside_or_without_callbacks(tmp_path):
    with callback_cache.kept(str(tmp_path)):
        jax.jit(lambda x: x * 7).lower(jnp.float32(1)).compile()  # no callbacks: JAX's own
    _program([], "a").lower(jnp.float32(2)).compile()  # outside ``kept``
    with callback_cache.kept(None):
        _program([], "a").lower(jnp.float32(3)).compile()
    assert _entries(tmp_path) == []


def test_the_oldest_entries_go_past_the_byte_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(callback_cache, "KEEP_BYTES", 1)  # the newest entry alone
    with callback_cache.kept(str(tmp_path)):
        _program([], "a").lower(jnp.float32(1)).compile()
        (first,) = _entries(tmp_path)
        _program([], "a").lower(jnp.zeros((2,), jnp.float32)).compile()  # compiled, not run
    (last,) = _entries(tmp_path)
    assert last != first
