"""Carries JAX's persistent compilation cache from one lent device machine to the next.

A device call that finds no warm machine starts on a bare one, where the 11B's programs compile
anew: 96 s for the engine, 175 s for the 16-slot staged tick, 134 s at 56 slots, 66-77 s for a
resident loop (`docs/gpu-notes.md`, measured 2026-12-01): minutes of device time at each slot
count. A machine's cache can come back through ``$OUT`` and travel to the next machine as a
carried folder, but both ways are small (at most 8 files of 16 MiB and 64 MiB in all back,
64 MiB carried with the tree). So:

  pack: the newest cache entries, each xz-compressed, into one tar as far as ``--budget_mib``
        allows, split into parts of at most ``--part_mib``;
  unpack: the parts joined, checked and extracted into the cache; entries already there are kept.

JAX looks an entry up by a key of the program, the compile options, the jaxlib version and the
device, so an entry that does not match the next machine is only a miss, never a wrong program.

  python3 experiments/compile_cache.py pack --src=.jax_cache --out=$OUT     # last call on a machine
  python3 experiments/compile_cache.py unpack --src=.jax_cache_carry --dst=.jax_cache   # first call
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import lzma
import os
import pathlib
import sys
import tarfile

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """The command line's flags (defined only when run, so that tests can import the module
    beside experiments that define flags of the same names)."""
    flags.DEFINE_string("src", None, "pack: the cache folder; unpack: the folder of the parts.")
    flags.DEFINE_string("out", None, "pack: where the parts are written.")
    flags.DEFINE_string("dst", None, "unpack: the cache folder to fill.")
    flags.DEFINE_integer("budget_mib", 56, "pack: compressed MiB at most, all parts together.")
    flags.DEFINE_integer("part_mib", 14, "pack: MiB at most per part.")


PREFIX = "compile_cache.tar."
MANIFEST = "compile_cache_manifest.json"


def _xz(data: bytes) -> bytes:
    # JAX already compresses the executables it caches: a light preset, for the rest. lzma
    # releases the GIL, so the entries compress in parallel.
    return lzma.compress(data, preset=1)


def pack(src: pathlib.Path, out: pathlib.Path, *, budget: int, part: int) -> dict:
    """Packs the newest entries of ``src`` that fit ``budget`` bytes compressed; returns the
    manifest (also written to ``out``): entries taken and left, bytes, parts.

    The archive is a plain tar of entries compressed one by one (``NAME.xz``), so each entry's
    packed size is known before it is taken. Only the newest entries worth up to eight budgets
    of raw bytes are compressed at all.
    """
    entries = sorted(
        (p for p in src.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime, reverse=True
    )
    candidates, raw = [], 0
    for p in entries:
        if raw > 8 * budget:
            break
        candidates.append(p)
        raw += p.stat().st_size
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        packed = list(pool.map(lambda p: _xz(p.read_bytes()), candidates))
    taken, left, used = [], [], tarfile.RECORDSIZE  # the archive's end, padded to a record
    for p, data in zip(candidates, packed, strict=True):
        size = len(data) + 1024  # and its tar header and padding
        if used + size > budget:
            left.append({"name": str(p.relative_to(src)), "bytes": p.stat().st_size})
            continue
        taken.append((p, data))
        used += size
    left += [
        {"name": str(p.relative_to(src)), "bytes": p.stat().st_size}
        for p in entries[len(candidates) :]
    ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p, data in taken:
            info = tarfile.TarInfo(str(p.relative_to(src)) + ".xz")
            info.size = len(data)
            info.mtime = int(p.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(0, max(len(blob), 1), part):
        name = f"{PREFIX}{len(parts):02d}"
        (out / name).write_bytes(blob[i : i + part])
        parts.append(name)
    manifest = {
        "taken": [{"name": str(p.relative_to(src)), "bytes": p.stat().st_size} for p, _ in taken],
        "left": left,
        "packed_bytes": len(blob),
        "parts": parts,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(src: pathlib.Path, dst: pathlib.Path) -> dict:
    """Extracts the parts in ``src`` into ``dst``, keeping entries already there; returns counts.

    Raises:
      ValueError: no parts, or parts that do not join into one whole archive (each entry's xz
        check covers its bytes).
    """
    parts = sorted(src.glob(PREFIX + "*"))
    if not parts:
        raise ValueError(f"no {PREFIX}NN parts in {src}")
    blob = b"".join(p.read_bytes() for p in parts)
    dst.mkdir(parents=True, exist_ok=True)
    added = kept = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            for member in tar.getmembers():
                name = member.name.removesuffix(".xz")
                target = dst / name
                inside = dst.resolve() in target.resolve().parents
                if not member.isfile() or not member.name.endswith(".xz") or not inside:
                    raise ValueError(f"unexpected archive member {member.name!r}")
                if target.exists():
                    kept += 1
                    continue
                data = lzma.decompress(tar.extractfile(member).read())
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(target.name + ".partial")
                tmp.write_bytes(data)
                os.replace(tmp, target)  # JAX never sees half an entry
                os.utime(target, (member.mtime, member.mtime))
                added += 1
    except (lzma.LZMAError, tarfile.TarError, EOFError) as e:
        raise ValueError(f"the parts in {src} are not one whole archive: {e}") from e
    return {"added": added, "kept": kept, "parts": len(parts)}


def main(argv):
    if len(argv) != 2 or argv[1] not in ("pack", "unpack"):
        sys.exit(
            "usage: compile_cache.py pack --src=CACHE --out=DIR | unpack --src=DIR --dst=CACHE"
        )
    if argv[1] == "pack":
        m = pack(
            pathlib.Path(FLAGS.src),
            pathlib.Path(FLAGS.out),
            budget=FLAGS.budget_mib << 20,
            part=FLAGS.part_mib << 20,
        )
        raw = sum(e["bytes"] for e in m["taken"])
        print(
            f"packed {len(m['taken'])} entries ({raw / 2**20:.1f} MiB) into "
            f"{m['packed_bytes'] / 2**20:.1f} MiB, {len(m['parts'])} parts; "
            f"{len(m['left'])} left out ({sum(e['bytes'] for e in m['left']) / 2**20:.1f} MiB)"
        )
    else:
        try:
            r = unpack(pathlib.Path(FLAGS.src), pathlib.Path(FLAGS.dst))
        except ValueError as e:
            sys.exit(f"compile_cache: {e}")
        print(f"unpacked {r['added']} entries from {r['parts']} parts ({r['kept']} already there)")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
