"""experiments/compile_cache.py: the newest cache entries within the budget, in parts no larger
than the limit, extracted back byte for byte without touching entries already there; damaged
or missing parts refused with one message."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from experiments import compile_cache


def _cache(root: pathlib.Path) -> dict[str, bytes]:
    """Six entries: incompressible ones (random) and compressible ones, oldest first."""
    rng = np.random.default_rng(0)
    entries = {}
    for i in range(6):
        data = rng.bytes(40_000) if i % 2 else bytes(200_000)
        name = f"jit_tick-{i:02d}-cache" if i < 5 else f"sub/jit_other-{i}-atime"
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
        entries[name] = data
    return entries


def test_pack_takes_the_newest_entries_within_budget_and_unpack_restores_them(tmp_path):
    entries = _cache(tmp_path / "cache")
    out = tmp_path / "out"
    m = compile_cache.pack(tmp_path / "cache", out, budget=90_000, part=30_000)
    taken = [e["name"] for e in m["taken"]]
    assert taken[0] == "sub/jit_other-5-atime"  # newest first
    assert "jit_tick-00-cache" in taken  # a compressible old one still fits after the random ones
    assert {e["name"] for e in m["left"]} == set(entries) - set(taken)
    assert m["left"]  # not everything fits 90 kB: two random entries alone are 80 kB
    parts = sorted(out.glob(compile_cache.PREFIX + "*"))
    assert [p.name for p in parts] == m["parts"]
    assert all(p.stat().st_size <= 30_000 for p in parts)
    assert sum(p.stat().st_size for p in parts) == m["packed_bytes"] <= 90_000

    dst = tmp_path / "restored"
    (dst / "jit_tick-00-cache").parent.mkdir(parents=True)
    (dst / "jit_tick-00-cache").write_bytes(b"already here")
    r = compile_cache.unpack(out, dst)
    assert r == {"added": len(taken) - 1, "kept": 1, "parts": len(parts)}
    assert (dst / "jit_tick-00-cache").read_bytes() == b"already here"
    for name in taken:
        if name != "jit_tick-00-cache":
            assert (dst / name).read_bytes() == entries[name]
    assert not list(dst.rglob("*.partial"))


def test_unpack_refuses_missing_or_damaged_parts(tmp_path):
    _cache(tmp_path / "cache")
    out = tmp_path / "out"
    m = compile_cache.pack(tmp_path / "cache", out, budget=1 << 20, part=20_000)
    with pytest.raises(ValueError, match="no compile_cache"):
        compile_cache.unpack(tmp_path / "empty", tmp_path / "dst")
    first = out / m["parts"][0]
    data = bytearray(first.read_bytes())
    data[512 + 200] ^= 0xFF  # inside the first entry's compressed bytes
    first.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not one whole archive"):
        compile_cache.unpack(out, tmp_path / "dst")
