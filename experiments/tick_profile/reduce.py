"""A profiler trace of the tick, reduced to device time per model component. See README.md.

Inputs: the trace JSON that ``jax.profiler.trace(..., create_perfetto_trace=True)`` writes
(``perfetto_trace.json.gz``) and the optimized HLO text of each program that ran
(``compiled.as_text()``). Nothing here imports JAX: a saved trace and HLO can be reduced again on
any machine (``run.py --reduce_only``).

1. **Kernels.** On a GPU, the kernel, memcpy and memset events of the device's ``Stream`` lines;
   on the CPU, the host thunk events that name an HLO op (control flow such as ``while``, which
   holds the body's ops, left out). Outside a CUDA graph an event's ``hlo_op`` names the HLO
   instruction that launched it. Inside one (jax 0.11.2 keeps XLA's command buffers on while the
   profiler runs) every kernel carries only the buffer's name, and ``align`` recovers the
   instruction from the kernel's name and its place in the computation's schedule.
2. **Components.** The HLO text keeps, for every instruction, the Python call stack that traced it
   (``stack_frame_id`` into the module's ``StackFrames`` table: file, function and line of each
   frame). ``classify`` walks that stack: the innermost model function it knows decides
   (``nano._mamba_step`` is LLM Mamba, ``gemma.forward`` is the speech decoder's backbone, split
   by the source line of the call in it into attention, projections, MLP and norms). A fusion
   takes its own metadata (its root's), else its fused instructions'.
3. **Bytes and FLOPs.** Per execution of an instruction, from the shapes in the HLO: every operand
   read once and the result written once, except that an operand a fusion only slices is read as
   the slice, and a buffer updated in place (``dynamic-update-slice``, ``scatter``) costs its
   update, not the whole buffer. FLOPs count the matrix products and convolutions only
   (``2 x`` output elements ``x`` contraction). An instruction's executions: in a CUDA graph,
   its kernels over its distinct graph nodes; outside one, its runs of consecutive kernels on a
   stream (a product split into two kernels runs once).
4. **Ticks.** Host annotations named ``tick <k>`` (``run.py``) bound the ticks: a kernel belongs
   to the tick whose annotation holds its start. Per tick: the wall time of the annotation, the
   span from the first kernel's start to the last one's end, the time some kernel ran (the union),
   and the device's idle time inside the span.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import gzip
import json
import math
import os
import re
from collections.abc import Iterable, Sequence

# The order of the table; components not listed follow.
COMPONENTS = (
    "encoder",
    "RNNT",
    "LLM Mamba",
    "LLM attention",
    "LLM MLP",
    "LLM norms/residual",
    "LLM heads",
    "TTS text side + fusion",
    "TTS backbone weight slices",
    "TTS backbone attention",
    "TTS attention + codec products",
    "TTS backbone projections",
    "TTS backbone MLP",
    "TTS backbone norms/residual",
    "TTS other",
    "MoG head",
    "codec",
    "admission/roll-over",
    "other",
)

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "token": 0, "opaque": 0,
}  # fmt: skip

# Instructions that launch nothing themselves (views, control flow that holds other kernels).
NO_KERNEL = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional",
    "call", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id",
    "copy-done", "send-done", "recv-done", "async-done", "domain", "fusion-done",
}  # fmt: skip
SLICE_OPS = {"dynamic-slice", "slice", "gather"}
FUSIONS = {"fusion", "fusion-start"}  # an async fusion (a weight slice) starts at fusion-start
IN_PLACE_OPS = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> index of the update operand


# ------------------------------------------------------------------------------------ HLO text


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # the result's shape as printed (a tuple in parentheses, or one array)
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list
    computation: str
    operand_text: str = ""  # the operand list as printed (a parameter's index)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=(\{{[^}}]*\}}|\"[^\"]*\"|[^,\s]+)", self.attrs)
        return m.group(1).strip('"') if m else None

    @property
    def calls(self) -> str | None:
        c = self.attr("calls")
        return c.lstrip("%") if c else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def stack_frame_id(self) -> int | None:
        m = re.search(r"stack_frame_id=(\d+)", self.attrs)
        return int(m.group(1)) if m else None

    @property
    def source(self) -> tuple[str, int] | None:
        f, line = (
            re.search(r'source_file="([^"]*)"', self.attrs),
            re.search(r"source_line=(\d+)", self.attrs),
        )
        return (f.group(1), int(line.group(1))) if f and line else None


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    function: str
    line: int
    end_line: int

    @property
    def module(self) -> str:
        return os.path.splitext(os.path.basename(self.file))[0]


@dataclasses.dataclass
class Hlo:
    """One optimized HLO module: its instructions by name and its call-stack table."""

    module: str
    instrs: dict[str, Instr]
    computations: dict[str, list[Instr]]
    roots: dict[str, str]
    frames: dict[int, tuple[int, int]]  # frame id -> (file location id, parent frame id or 0)
    locations: dict[int, Frame]
    entry: str = ""

    def stack(self, frame_id: int | None) -> list[Frame]:
        """The Python frames of ``frame_id``, outermost first, cut where a foreign trace starts
        (``live_stack``)."""
        out, seen = [], set()
        while frame_id and frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            loc, parent = self.frames[frame_id]
            if loc in self.locations:
                out.append(self.locations[loc])
            frame_id = parent
        return live_stack(out[::-1])

    def users(self, computation: str) -> dict[str, list[Instr]]:
        u = collections.defaultdict(list)
        for ins in self.computations[computation]:
            for o in ins.operands:
                u[o].append(ins)
        return u


# Functions that only other programs enter (random init, the template, the state's allocation):
# a stack that reaches one from the tick has run into a foreign trace (below).
FOREIGN_FUNCTIONS = {"init", "init_compiled", "abstract", "initial_state", "warmup_state"}
FOREIGN_MODULES = {"engine", "state"}


def live_stack(stack: list[Frame]) -> list[Frame]:
    """``stack`` cut before the first frame of a foreign trace.

    JAX builds an op's stack from its call site's frames followed by those recorded when the
    function it sits in was traced. A jitted helper (``jnp.where``, ``jax.random.*``) is traced
    once per argument shape and its trace is reused, so its frames can be those of the first
    call, made by another program of the process (the random init, the template): the stack
    then goes on into that program (``... sampling_noise > ear_tts.init > _random_chars``). Such
    a tail starts at a function the tick never calls, or at the stack's own outermost frame
    again; everything from there on is dropped.
    """
    for i, f in enumerate(stack):
        if i == 0:
            continue
        outer = f.function.split(".<locals>.")[0]
        restart = (f.module, f.function, f.line) == (
            stack[0].module, stack[0].function, stack[0].line
        )  # fmt: skip
        if restart or outer in FOREIGN_FUNCTIONS or f.module in FOREIGN_MODULES:
            return stack[:i]
    return stack


def _matching(s: str, i: int, open_: str = "(", close: str = ")") -> int:
    """Index of the bracket that closes the one at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == open_:
            depth += 1
        elif s[j] == close:
            depth -= 1
            if depth == 0:
                return j
    return len(s) - 1


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def parse_hlo(text: str) -> Hlo:
    """Parses ``compiled.as_text()``: computations, instructions, and the stack-frame table."""
    module = ""
    instrs: dict[str, Instr] = {}
    comps: dict[str, list[Instr]] = {}
    roots: dict[str, str] = {}
    files: dict[int, str] = {}
    funcs: dict[int, str] = {}
    locs_raw: dict[int, dict[str, int]] = {}
    frames_raw: dict[int, tuple[int, int]] = {}
    section, current, entry = None, None, ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
            continue
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if current is None and section and re.match(r"^\d+\s", line):
            idx, rest = line.split(None, 1)
            i = int(idx)
            if section == "FileNames":
                files[i] = rest.strip('"')
            elif section == "FunctionNames":
                funcs[i] = rest.strip('"')
            else:
                kv = {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", rest)}
                if section == "FileLocations":
                    locs_raw[i] = kv
                else:
                    frames_raw[i] = (kv.get("file_location_id", 0), kv.get("parent_frame_id", 0))
            continue
        m = _HEADER.match(line)
        if m and not _INSTR.match(line):
            section, current = None, m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if line == "}":
            current = None
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):
            end = _matching(rest, 0)
            shape, rest = rest[: end + 1], rest[end + 1 :].strip()
        else:
            shape, _, rest = rest.partition(" ")
        p = rest.find("(")
        opcode = rest[:p].strip() if p >= 0 else rest.strip()
        end = _matching(rest, p) if p >= 0 else len(rest) - 1
        operand_text = rest[p + 1 : end] if p >= 0 else ""
        operands = re.findall(r"%([\w.\-]+)", operand_text)
        ins = Instr(name, shape, opcode, operands, rest[end + 1 :], current, operand_text)
        instrs[name] = ins
        comps[current].append(ins)
        if line.startswith("ROOT "):
            roots[current] = name
    # The text prints each frame's parent one above its id (0 = none) in the versions seen; a
    # frame that names itself as parent can only mean that convention.
    shift = 1 if any(p == i for i, (_, p) in frames_raw.items()) else 0
    frames = {i: (loc, max(p - shift, 0)) for i, (loc, p) in frames_raw.items()}
    locations = {
        i: Frame(
            files.get(kv.get("file_name_id", 0), "?"),
            funcs.get(kv.get("function_name_id", 0), "?"),
            kv.get("line", 0),
            kv.get("end_line", kv.get("line", 0)),
        )
        for i, kv in locs_raw.items()
    }
    return Hlo(module, instrs, comps, roots, frames, locations, entry)


def shape_dims(shape: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of every array in a printed shape (a tuple gives several)."""
    out = []
    for dt, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([^\]]*)\]", shape):
        if dt not in DTYPE_BYTES:
            continue
        ds = [int(re.sub(r"[^\d]", "", d) or 0) for d in dims.split(",") if d.strip()]
        out.append((dt, ds))
    return out


def shape_bytes(shape: str, *, skip_workspace: bool = False) -> float:
    arrays = shape_dims(shape)
    if skip_workspace and len(arrays) > 1 and arrays[-1][0] == "s8":
        arrays = arrays[:-1]  # a cuBLAS / cuDNN call's scratch
    return sum(DTYPE_BYTES[dt] * math.prod(ds) for dt, ds in arrays)


# ----------------------------------------------------------------------------- bytes and FLOPs


def _size(hlo: Hlo, name: str) -> float:
    ins = hlo.instrs.get(name)
    return shape_bytes(ins.shape) if ins else 0.0


def _param_read(hlo: Hlo, comp: str, users: dict, start: Instr, full: float) -> float:
    """Bytes a fused parameter is read: its slices where it is only sliced, 0 where it is only
    the buffer of an in-place update, else the whole operand."""
    total, todo, seen = 0.0, [start], set()
    while todo:
        ins = todo.pop()
        if ins.name in seen:
            continue
        seen.add(ins.name)
        for u in users.get(ins.name, []):
            if u.opcode in SLICE_OPS and u.operands and u.operands[0] == ins.name:
                total += shape_bytes(u.shape)
            elif u.opcode in IN_PLACE_OPS and u.operands and u.operands[0] == ins.name:
                continue
            elif u.opcode in ("bitcast", "reshape", "get-tuple-element"):
                todo.append(u)
            else:
                return full
    return min(total, full)


def _write_bytes(hlo: Hlo, comp: str, root: Instr) -> float:
    """Bytes a fusion's result writes: an in-place update writes its update only."""
    if root.opcode == "tuple":
        return sum(_write_bytes(hlo, comp, hlo.instrs[o]) for o in root.operands if o in hlo.instrs)
    if root.opcode in ("bitcast", "reshape") and root.operands:
        inner = hlo.instrs.get(root.operands[0])
        if inner is not None and inner.opcode in IN_PLACE_OPS:
            return _write_bytes(hlo, comp, inner)
    if root.opcode in IN_PLACE_OPS:
        k = IN_PLACE_OPS[root.opcode]
        if len(root.operands) > k:
            return _size(hlo, root.operands[k])
    return shape_bytes(root.shape)


def instr_bytes(hlo: Hlo, ins: Instr) -> float:
    """Bytes one execution of ``ins`` must move at least (reads plus writes)."""
    if ins.opcode in NO_KERNEL:
        return 0.0
    if ins.opcode in FUSIONS and ins.calls in hlo.computations:
        comp = ins.calls
        users = hlo.users(comp)
        by_index = {
            int(f.operand_text): f
            for f in hlo.computations[comp]
            if f.opcode == "parameter" and f.operand_text.strip().isdigit()
        }
        reads = 0.0
        for i, o in enumerate(ins.operands):
            full = _size(hlo, o)
            p = by_index.get(i)
            reads += full if p is None else _param_read(hlo, comp, users, p, full)
        root = hlo.instrs.get(hlo.roots.get(comp, ""))
        writes = _write_bytes(hlo, comp, root) if root else shape_bytes(ins.shape)
        return reads + writes
    if ins.opcode in IN_PLACE_OPS:
        k = IN_PLACE_OPS[ins.opcode]
        return 2 * _size(hlo, ins.operands[k]) if len(ins.operands) > k else 0.0
    if ins.opcode in SLICE_OPS:
        return 2 * shape_bytes(ins.shape)
    reads = sum(_size(hlo, o) for o in ins.operands)
    return reads + shape_bytes(ins.shape, skip_workspace=ins.opcode == "custom-call")


def _dims(attr: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", attr or "")]


def _dot_flops(hlo: Hlo, ins: Instr, lhs_contracting: Sequence[int]) -> float:
    out = shape_dims(ins.shape)
    lhs = hlo.instrs.get(ins.operands[0]) if ins.operands else None
    if not out or lhs is None:
        return 0.0
    ldims = shape_dims(lhs.shape)
    if not ldims:
        return 0.0
    k = math.prod(ldims[0][1][d] for d in lhs_contracting if d < len(ldims[0][1]))
    return 2.0 * math.prod(out[0][1]) * k


def _conv_flops(hlo: Hlo, ins: Instr) -> float:
    labels = ins.attr("dim_labels")
    out = shape_dims(ins.shape)
    rhs = hlo.instrs.get(ins.operands[1]) if len(ins.operands) > 1 else None
    if not labels or not out or rhs is None:
        return 0.0
    kernel = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    rdims = shape_dims(rhs.shape)
    if not rdims or "o" not in kernel or len(kernel) != len(rdims[0][1]):
        return 0.0
    o = rdims[0][1][kernel.index("o")]
    return 2.0 * math.prod(out[0][1]) * math.prod(rdims[0][1]) / max(o, 1)


def instr_flops(hlo: Hlo, ins: Instr) -> float:
    """Matrix-product and convolution FLOPs of one execution of ``ins`` (elementwise work not
    counted)."""
    if ins.opcode == "dot":
        return _dot_flops(hlo, ins, _dims(ins.attr("lhs_contracting_dims")))
    if ins.opcode == "convolution":
        return _conv_flops(hlo, ins)
    if ins.opcode == "custom-call":
        target = ins.attr("custom_call_target") or ""
        if "conv" in target.lower():
            return _conv_flops(hlo, ins)
        m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attrs)
        if m:
            return _dot_flops(hlo, ins, _dims(m.group(1)))
        return 0.0
    if ins.opcode in FUSIONS and ins.calls in hlo.computations:
        return sum(instr_flops(hlo, f) for f in hlo.computations[ins.calls])
    return 0.0


# ---------------------------------------------------------------------------------- components


def repository_path(file: str) -> str | None:
    """A frame's file as a path in the repository (None: not one of its sources)."""
    for top in ("voicechat_jax/", "pallas_kernels/", "experiments/"):
        i = file.rfind("/" + top)
        if i >= 0 or file.startswith(top):
            return file[i + 1 :] if i >= 0 else file
    return None


class Sources:
    """The repository's source lines, read where the HLO's frames name them.

    ``files`` (repository path -> text): the sources as they were when the trace was taken
    (``run.py`` keeps them beside it, ``sources.json.gz``), so that a trace reduces the same
    whatever the working tree holds now; without it, the files under ``root``.
    """

    def __init__(self, root: str, files: dict[str, str] | None = None):
        self.root = root
        self.files = files
        self._lines: dict[str, list[str]] = {}

    def _read(self, file: str) -> list[str]:
        rel = repository_path(file)
        if rel is None:
            return []
        if rel not in self._lines:
            if self.files is not None:
                self._lines[rel] = self.files.get(rel, "").splitlines()
            else:
                try:
                    with open(os.path.join(self.root, rel)) as fh:
                        self._lines[rel] = fh.read().splitlines()
                except OSError:
                    self._lines[rel] = []
        return self._lines[rel]

    def text(self, f: Frame) -> str:
        """The source of the frame's expression (its lines)."""
        lines = self._read(f.file)
        return " ".join(lines[max(f.line - 1, 0) : max(f.end_line, f.line)])

    def function_at(self, file: str, line: int) -> str:
        """The qualified name of the innermost function around ``line`` ('?' if none)."""
        lines = self._read(file)
        try:
            tree = ast.parse("\n".join(lines))
        except SyntaxError:
            return "?"
        best, todo = "?", [(tree, "")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    if not child.lineno <= line <= (child.end_lineno or child.lineno):
                        continue
                    name = f"{prefix}.<locals>.{child.name}" if prefix else child.name
                    best = name
                todo.append((child, name))
        return best


def _has(text: str, words: Iterable[str]) -> bool:
    return any(w in text for w in words)


_TTS_ATTENTION = (
    "attend", "ks[l]", "vs[l]", "apply_rope", "q_norm", "k_norm", "logits", "probs", "mask",
    "causal", "distance", "write_at", "positions", "key_pos", "qg",
)  # fmt: skip
# the separate products' weights, and the serving layout's fused ones (``params.qkv[l]``,
# ``params.gate_up[l]``: charged to "norms/residual" before 2026-12-06)
_TTS_PROJECTIONS = ('w["q"]', 'w["k"]', 'w["v"]', 'w["o"]', "params.qkv")
_TTS_MLP = ('w["gate"]', 'w["up"]', 'w["down"]', "gelu", "params.gate_up")


def classify(stack: Sequence[Frame], sources: Sources) -> str:
    """The component of an instruction traced from ``stack`` (outermost frame first)."""

    def frame(module: str, *functions: str) -> Frame | None:
        # The innermost frame of ``module`` in one of ``functions`` or a function nested in one
        # (``advance.<locals>.one``).
        for f in reversed(stack):
            outer = f.function.split(".<locals>.")[0]
            if f.module == module and (not functions or outer in functions):
                return f
        return None

    if frame("conformer", "encoder_step") or frame("mel"):
        return "encoder"
    if frame("rnnt"):
        return "RNNT"
    # ``codec_in_attention``: the one launch of the speech decoder's attention and a codec
    # product (``pallas_kernels.attention_product``), then the codec's own code wherever its
    # product generator runs (resumed inside ``gemma.forward`` by ``model.beside``) and the
    # products XLA runs for it (``beside.xla_product``)
    if frame("attention_product"):
        return "TTS attention + codec products"
    if frame("codec") or frame("beside", "xla_product"):
        return "codec"
    if frame("nano", "_mamba_step", "_mamba_step_fused"):
        return "LLM Mamba"
    if frame("nano", "_attn"):
        return "LLM attention"
    if frame("nano", "_mlp"):
        return "LLM MLP"
    if frame("nano", "input_embedding", "greedy", "heads", "embed"):
        return "LLM heads"
    if f := frame("nano", "step"):
        t = sources.text(f)
        if _has(t, ("mamba", "conv")):
            return "LLM Mamba"
        if "mlp" in t:
            return "LLM MLP"
        if "attn" in t:
            return "LLM attention"
        if _has(t, ("norm_f", "hidden")):
            return "LLM heads"
        return "LLM norms/residual"
    if f := frame("gemma", "forward"):
        t = sources.text(f)
        if "getattr(params" in t:  # layer l's weights taken from the stacked arrays
            return "TTS backbone weight slices"
        if _has(t, _TTS_ATTENTION):
            return "TTS backbone attention"
        if _has(t, _TTS_PROJECTIONS):
            return "TTS backbone projections"
        if _has(t, _TTS_MLP):
            return "TTS backbone MLP"
        return "TTS backbone norms/residual"
    if frame("ear_tts", "generate_codes", "sampling_noise") or frame("mog"):
        return "MoG head"
    if frame("ear_tts", "embed_frame", "fuse") or frame("char_encoder"):
        return "TTS text side + fusion"
    if frame("ear_tts", "tts_step"):
        return "TTS other"
    if frame("voicechat", "_frame_keys"):
        return "MoG head"  # the sampling keys of the MoG head's noise
    if f := frame("voicechat", "advance"):
        t = sources.text(f)
        if "enc" in t:
            return "encoder"
        if "rnnt" in t:
            return "RNNT"
        if "codec" in t:
            return "codec"
        if _has(t, ("text_prev", "func_prev")):
            return "LLM heads"
        return "other"
    if frame("step"):
        return "admission/roll-over"
    return "other"


def instr_stack(hlo: Hlo, ins: Instr, sources: Sources | None = None) -> list[Frame]:
    """The call stack of ``ins``: its own, else (a fusion) its product's when it fuses one (a
    GEMM fusion is its product's kernel, whatever its root: a norm before it or the split of a
    fused product's columns after it), else its root's or its first fused instruction's that
    has one; a stack from ``source_file`` / ``source_line`` as a fallback."""
    candidates = [ins]
    if ins.opcode in FUSIONS and ins.calls in hlo.computations:
        comp = ins.calls
        root = hlo.instrs.get(hlo.roots.get(comp, ""))
        products = [i for i in hlo.computations[comp] if i.opcode in ("dot", "convolution")]
        candidates = products + candidates  # the fusion's own metadata is its root's
        candidates += ([root] if root else []) + list(reversed(hlo.computations[comp]))
    for c in candidates:
        s = hlo.stack(c.stack_frame_id)
        if s:
            return s
    for c in candidates:
        if c.source:  # metadata without a stack table: one frame, its function from the source
            f, line = c.source
            return [Frame(f, sources.function_at(f, line) if sources else "?", line, line)]
    # An instruction XLA added (a copy of a loop-carried buffer, a rewritten product) has no
    # metadata: it takes the stack of the nearest instruction around it that has one, its
    # operands first, then its users.
    users = hlo.users(ins.computation)
    seen, todo = {ins.name}, collections.deque([ins])
    while todo and len(seen) < 64:
        cur = todo.popleft()
        near = [hlo.instrs[o] for o in cur.operands if o in hlo.instrs] + users.get(cur.name, [])
        for nb in near:
            if nb.name in seen:
                continue
            seen.add(nb.name)
            s = hlo.stack(nb.stack_frame_id)
            if s:
                return s
            todo.append(nb)
    return []


# ------------------------------------------------------------------------------------- trace


@dataclasses.dataclass
class Event:
    name: str
    ts: float  # us
    dur: float  # us
    pid: int
    tid: int
    hlo_op: str | None
    hlo_module: str | None
    graph: str | None = None  # the CUDA graph (command buffer) it ran in, if any
    node: str | None = None  # its node in that graph: one per launch of an instruction


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _names(trace: dict) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    procs, threads = {}, {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    return procs, threads


# xprof's derived lines on a device plane repeat the kernels' time under other names.
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "TensorFlow", "Framework", "Steps", "Source", "Launch")


def device_events(trace: dict, hlos: Sequence[Hlo]) -> tuple[list[Event], str, list[str], dict]:
    """Kernel events, the kind of trace ('gpu' or 'cpu'), the lines they came from, and per
    module how ``align`` named the kernels of command buffers.

    GPU: every complete event on a ``/device:GPU`` process's ``Stream`` lines (any line but
    xprof's derived ones if none is named so). CPU: host events that carry an ``hlo_op`` and are
    not control flow (their body's ops are events of their own).
    """
    procs, threads = _names(trace)
    known = {}
    for h in hlos:
        for name, ins in h.instrs.items():
            known.setdefault(name, ins)
    gpu_pids = {p for p, n in procs.items() if "/device:" in n and "CPU" not in n}
    raw = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    out, lines = [], set()
    if gpu_pids:
        tids = {k for k in threads if k[0] in gpu_pids}
        streams = {k for k in tids if threads[k].startswith("Stream")}
        keep = streams or {k for k in tids if not threads[k].startswith(_DERIVED_LINES)}
        for e in raw:
            key = (e.get("pid"), e.get("tid"))
            if key not in keep:
                continue
            op = (e.get("args", {}) or {}).get("hlo_op")
            if op not in known:  # none, or a command buffer's ("command_buffer_72")
                op = None
            lines.add(threads.get(key, str(key)))
            out.append(_event(e, op))
        out.sort(key=lambda e: e.ts)
        alignment = {h.module: dict(align(out, h)) for h in hlos}
        return out, "gpu", sorted(lines), alignment
    for e in raw:
        args = e.get("args", {}) or {}
        op = args.get("hlo_op")
        if not op or e.get("name", "").startswith("end: "):
            continue
        ins = known.get(op)
        if ins is not None and ins.opcode in ("while", "conditional", "call"):
            continue
        key = (e.get("pid"), e.get("tid"))
        lines.add(threads.get(key, str(key)))
        out.append(_event(e, op))
    return sorted(out, key=lambda e: e.ts), "cpu", sorted(lines), {}


def _event(e: dict, op: str | None) -> Event:
    args = e.get("args", {}) or {}
    name, ts, dur = e.get("name", ""), float(e["ts"]), float(e.get("dur", 0.0))
    return Event(
        name, ts, dur, e.get("pid"), e.get("tid"), op, args.get("hlo_module"),
        args.get("cuda_graph_id"), args.get("cuda_graph_node_id"),
    )  # fmt: skip


def windows(trace: dict, prefix: str) -> list[tuple[float, float]]:
    """(start, end) in us of the host annotations whose name starts with ``prefix``, in order."""
    w = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(prefix)
    ]
    return sorted(w)


def assign(events: Sequence[Event], spans: Sequence[tuple[float, float]]) -> list[list[Event]]:
    """The events of each span: those that start inside it.

    Should the device's clock not line up with the host's (under a tenth of the events inside
    any span), the events are cut into ``len(spans)`` runs at their largest gaps instead: the
    spans are blocked on one after another, so the device idles between them.
    """
    inside = [[e for e in events if a <= e.ts <= b] for a, b in spans]
    if not spans or not events or sum(map(len, inside)) >= 0.1 * len(events):
        return inside
    order = sorted(events, key=lambda e: e.ts)
    gaps = sorted(
        range(1, len(order)),
        key=lambda i: order[i].ts - (order[i - 1].ts + order[i - 1].dur),
        reverse=True,
    )[: len(spans) - 1]
    cuts = [0, *sorted(gaps), len(order)]
    return [order[cuts[i] : cuts[i + 1]] for i in range(len(spans))]


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# ------------------------------------------------------------------- kernels in command buffers
#
# Inside an XLA command buffer (a CUDA graph; jax 0.11.2 keeps them on while the profiler runs)
# every kernel of the graph carries the buffer's annotation ("command_buffer_72"), not its own
# instruction. A fusion's kernel is still named after the fusion (or after the one whose kernel
# it reuses: the fusions of one ``deduplicated_name`` share a kernel), but cuBLAS, cuDNN, Pallas
# and memcpy nodes are named by their libraries. The graph runs its instructions in schedule
# order, so the named kernels are anchors in each computation's schedule, and the kernels
# between two anchors are matched, in order and by kind, to the instructions scheduled between
# them that launch that kind of kernel.

_GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|gemv|splitk|cublas", re.IGNORECASE)
_COPY = re.compile(r"^(memcpy|memset)", re.IGNORECASE)


def sanitized(name: str) -> str:
    """An instruction's name as its kernel is named (``loop_add_fusion.3`` -> ``_3``)."""
    return name.replace(".", "_").replace("-", "_")


def _group(hlo: Hlo, ins: Instr) -> str:
    """The fusions that share one kernel: XLA compiles a fused computation once and reuses the
    kernel for every fusion with the same body, operand and result shapes (``deduplicated_name``
    names some of them, not all). Any other instruction is a group of its own."""
    if ins.opcode not in FUSIONS or ins.calls not in hlo.computations:
        return ins.name
    strip = re.compile(r"metadata=\{[^}]*\}|%[\w.\-]+|\b(?:param|p)[\w.]*")
    body = tuple(
        (f.opcode, f.shape, strip.sub("", f.attrs + f.operand_text))
        for f in hlo.computations[ins.calls]
    )
    operands = tuple(hlo.instrs[o].shape if o in hlo.instrs else o for o in ins.operands)
    return repr((ins.opcode, ins.attr("kind"), ins.shape, operands, body))


def _kind(hlo: Hlo, ins: Instr, named_groups: set[str]) -> str:
    """What kernel an instruction launches: 'named' (a fusion's own), 'gemm' (cuBLAS, cuDNN),
    'fft', 'pallas:<kernel>', or 'copy' (a memcpy or memset node, or anything else)."""
    if ins.opcode == "custom-call":
        target = ins.attr("custom_call_target") or ""
        if "triton" in target:
            m = re.search(r'\bname = "([^"]+)"', ins.attrs)
            return f"pallas:{m.group(1) if m else '?'}"
        if re.search(r"cublas|cudnn|gemm|conv", target, re.IGNORECASE):
            return "gemm"
        return "copy"
    if ins.opcode == "fft":
        return "fft"
    if ins.opcode == "fusion" and re.search(r'"kind":"__cu(blas|dnn)', ins.attrs):
        return "gemm"
    if ins.opcode == "fusion" and _group(hlo, ins) in named_groups:
        return "named"
    return "copy"


def _event_kind(name: str) -> str:
    if _COPY.match(name):
        return "copy"
    if _GEMM.search(name) or "conv" in name.lower():
        return "gemm"
    if "fft" in name.lower():
        return "fft"
    return f"pallas:{name}"


def executed_computations(hlo: Hlo) -> list[str]:
    """The computations whose instructions launch work: the entry, loop bodies and conditions,
    conditional branches and called computations (not fused or reducer computations)."""
    out, todo = [], [hlo.entry] if hlo.entry else []
    while todo:
        c = todo.pop()
        if c in out or c not in hlo.computations:
            continue
        out.append(c)
        for ins in hlo.computations[c]:
            if ins.opcode == "while":
                todo += [(ins.attr(k) or "").lstrip("%") for k in ("body", "condition")]
            elif ins.opcode == "call":
                todo.append((ins.attr("to_apply") or "").lstrip("%"))
            elif ins.opcode == "conditional":
                todo += re.findall(r"%([\w.\-]+)", ins.attr("branch_computations") or "")
    return out


def align(events: list[Event], hlo: Hlo) -> collections.Counter:
    """Fills in ``hlo_op`` of the events of ``hlo``'s module that have none (command-buffer
    kernels), in place. Returns how many events it named, and how: 'by name' (a fusion's kernel),
    'between anchors' (matched by kind in the gap), 'nearest' (no instruction of that kind in the
    gap: the next one of that kind in the computation), 'unnamed'."""
    comps = executed_computations(hlo)
    launch = {c: [i for i in hlo.computations[c] if i.opcode not in NO_KERNEL] for c in comps}
    where = {i.name: (c, k) for c in comps for k, i in enumerate(launch[c])}
    kernel_names = {e.name for e in events}
    by_kernel: dict[str, str] = {}  # kernel name -> group
    members: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    groups = {i.name: _group(hlo, i) for c in comps for i in launch[c]}
    for c in comps:
        for k, i in enumerate(launch[c]):
            members[groups[i.name]].append((c, k))
            by_kernel.setdefault(sanitized(i.name), groups[i.name])
    named_groups = {g for n, g in by_kernel.items() if n in kernel_names}
    kinds = {c: [_kind(hlo, i, named_groups) for i in launch[c]] for c in comps}
    stats: collections.Counter = collections.Counter()

    def pick(group: str, cursor) -> tuple[str, int]:
        cands = members[group]
        if cursor:
            after = [m for m in cands if m[0] == cursor[0] and m[1] > cursor[1]]
            if after:
                return after[0]
            same = [m for m in cands if m[0] == cursor[0]]
            if same:
                return same[0]  # the loop went round
        return cands[0]

    def nearest(home: tuple[str, int], kind: str) -> tuple[str, int] | None:
        c, k0 = home
        n = len(launch[c])
        for d in range(1, n + 1):  # forward from the cursor, round the loop
            k = (k0 + d) % n
            if kinds[c][k] == kind:
                return c, k
        return None

    def flush(pending: list[Event], a, b) -> None:
        if not pending:
            return
        gap: list[tuple[str, int]] = []
        if a and b and a[0] == b[0] and a[1] < b[1]:
            gap = [(a[0], k) for k in range(a[1] + 1, b[1])]
        else:
            if a:
                gap += [(a[0], k) for k in range(a[1] + 1, len(launch[a[0]]))]
            if b:
                gap += [(b[0], k) for k in range(b[1])]
        by_kind: dict[str, list[Event]] = collections.defaultdict(list)
        for e in pending:
            by_kind[_event_kind(e.name)].append(e)
        for kind, evs in by_kind.items():
            slots = [m for m in gap if kinds[m[0]][m[1]] == kind]
            how = "between anchors"
            if not slots and (a or b):
                near = nearest(a or b, kind)
                slots, how = ([near] if near else []), "nearest"
            if not slots:
                stats["unnamed"] += len(evs)
                continue
            for j, e in enumerate(evs):  # in order; several kernels of one call share it
                c, k = slots[j * len(slots) // len(evs)]
                e.hlo_op = launch[c][k].name
                stats[how] += 1

    streams: dict[tuple, list[Event]] = collections.defaultdict(list)
    for e in events:
        if e.hlo_module in (None, hlo.module):
            streams[(e.pid, e.tid)].append(e)
    for evs in streams.values():
        cursor, pending = None, []
        for e in sorted(evs, key=lambda e: e.ts):
            if e.hlo_op in where:
                anchor = where[e.hlo_op]
            elif e.hlo_op is None and e.name in by_kernel:
                anchor = pick(by_kernel[e.name], cursor)
                e.hlo_op = launch[anchor[0]][anchor[1]].name
                stats["by name"] += 1
            else:
                if e.hlo_op is None:
                    pending.append(e)
                continue
            flush(pending, cursor, anchor)
            pending, cursor = [], anchor
        flush(pending, cursor, None)
    return stats


# -------------------------------------------------------------------------------------- reduce


@dataclasses.dataclass
class Component:
    name: str
    us: float = 0.0
    launches: int = 0
    executions: int = 0
    bytes: float = 0.0
    flops: float = 0.0
    memcpy_us: float = 0.0  # of ``us``: memcpy and memset kernels (on the CPU: copy ops)
    # the device idle just before this component's kernels: each kernel's gap since every kernel
    # before it ended (the components' gaps add up to the span's idle time)
    idle_before_us: float = 0.0


def _lookup(hlos: Sequence[Hlo], e: Event) -> tuple[Hlo, Instr] | None:
    if e.hlo_op is None:
        return None
    by_module = [h for h in hlos if e.hlo_module and h.module == e.hlo_module]
    for h in by_module + [h for h in hlos if h not in by_module]:
        if e.hlo_op in h.instrs:
            return h, h.instrs[e.hlo_op]
    return None


def executions(evs: Sequence[Event], starts: int) -> int:
    """How many times one instruction ran, from its kernels: in a CUDA graph each run launches
    each of its nodes once; outside one, ``starts`` of its kernels did not follow one of its own
    on their stream (a product split into two kernels is one run)."""
    graph = [e for e in evs if e.node is not None]
    return (round(len(graph) / len({e.node for e in graph})) if graph else 0) + starts


_SCOPE = re.compile(r"jit\(tick\)/|while/body/|eval_jaxpr/|cond/branch_\d+_fun/")


def op_label(op_name: str, opcode: str) -> str:
    """What a kernel computes, from its HLO ``op_name`` without the tick's scopes:
    ``jit(tick)/while/body/eval_jaxpr/bkgts,bksh->bkgth/dot_general`` is
    ``bkgts,bksh->bkgth/dot_general``; a kernel without one is its opcode (``copy``)."""
    return _SCOPE.sub("", op_name) or opcode


def _largest(items, component, size, per_component: int, *, top: int = 0) -> list:
    """``items`` by ``size``, largest first: the ``top`` largest, and beside them each
    ``component``'s ``per_component`` largest."""
    kept: collections.Counter = collections.Counter()
    chosen = []
    for i, item in enumerate(sorted(items, key=lambda it: -size(it))):
        if i < top or kept[component(item)] < per_component:
            chosen.append(item)
            kept[component(item)] += 1
    return chosen


def operations(per_instr: dict, hlos, costs: dict, n: int, *, per_component: int) -> list[dict]:
    """Each component's time by operation (``op_label``): the kernels of one einsum, norm or
    copy summed over the layers and steps that run it, per span. Every component's
    ``per_component`` largest, longest first. ``per_instr``: (module, instruction) -> [component,
    us, launches, executions] summed over ``n`` spans; ``costs``: (module, instruction) ->
    (bytes, flops) of one execution."""
    ops: dict[tuple[str, str], list] = {}
    for (module, name), (comp, us, launches, execs) in per_instr.items():
        h = next(h for h in hlos if h.module == module)
        ins = h.instrs[name]
        by, fl = costs[(module, name)]
        rec = ops.setdefault((comp, op_label(ins.op_name, ins.opcode)), [0.0, 0, 0, 0.0, 0.0])
        rec[0] += us / n
        rec[1] += launches / n
        rec[2] += execs / n
        rec[3] += execs * by / n
        rec[4] += execs * fl / n
    chosen = _largest(ops.items(), lambda kv: kv[0][0], lambda kv: kv[1][0], per_component)
    out = []
    for (comp, label), (us, launches, execs, by, fl) in chosen:
        out.append(
            {
                "component": comp,
                "op": label,
                "us_per_span": us,
                "launches_per_span": launches,
                "executions_per_span": execs,
                "bytes_per_span": by,
                "flops_per_span": fl,
            }
        )
    return out


def reduce_window(
    events: Sequence[Event],
    hlos: Sequence[Hlo],
    sources: Sources,
    spans: Sequence[tuple[float, float]],
    *,
    top: int = 25,
    per_component: int = 8,
) -> dict:
    """Per-component totals over the kernels that start inside ``spans``, divided by their count.

    Returns a dict: ``components`` (name -> per-span ``Component``), ``spans`` (per span: wall,
    kernel span, busy and idle us, launches), ``kernels`` (the ``top`` instructions by time, and
    each component's ``per_component`` largest beside them, so that a small component's kernels
    are named too) and ``unmatched`` (kernel names with no HLO instruction, with their time).
    """
    n = max(len(spans), 1)
    classes: dict[tuple[str, str], str] = {}
    costs: dict[tuple[str, str], tuple[float, float]] = {}
    comps: dict[str, Component] = {}
    per_instr: dict[tuple[str, str], list] = {}
    unmatched: collections.Counter = collections.Counter()
    span_rows = []
    for ev, (a, b) in zip(assign(events, spans), spans, strict=True):
        busy = union_us((e.ts, e.ts + e.dur) for e in ev)
        first = min((e.ts for e in ev), default=a)
        last = max((e.ts + e.dur for e in ev), default=a)
        span_rows.append(
            {
                "wall_us": b - a,
                "kernel_span_us": last - first,
                "busy_us": busy,
                "idle_us": (last - first) - busy,
                "launches": len(ev),
                "kernel_sum_us": sum(e.dur for e in ev),
            }
        )
        runs: dict[tuple[str, str], list[Event]] = collections.defaultdict(list)
        starts: collections.Counter = collections.Counter()
        previous: dict[tuple[int, int], tuple[str, str] | None] = {}
        gaps, frontier = {}, None  # each kernel's idle before it, in start order
        for e in sorted(ev, key=lambda e: e.ts):
            gaps[id(e)] = 0.0 if frontier is None else max(0.0, e.ts - frontier)
            frontier = e.ts + e.dur if frontier is None else max(frontier, e.ts + e.dur)
        for e in ev:
            found = _lookup(hlos, e)
            if found is None:
                name = "other"
                unmatched[e.name[:80]] += e.dur
            else:
                h, ins = found
                key = (h.module, ins.name)
                if key not in classes:
                    classes[key] = classify(instr_stack(h, ins, sources), sources)
                    costs[key] = (instr_bytes(h, ins), instr_flops(h, ins))
                name = classes[key]
                runs[key].append(e)
                if e.node is None and previous.get((e.pid, e.tid)) != key:
                    starts[key] += 1
            previous[(e.pid, e.tid)] = None if found is None else key
            c = comps.setdefault(name, Component(name))
            c.us += e.dur
            c.launches += 1
            c.idle_before_us += gaps[id(e)]
            if _COPY.match(e.name) or (found is not None and found[1].opcode == "copy"):
                c.memcpy_us += e.dur
        for key, evs in runs.items():
            execs = executions(evs, starts[key])
            c = comps[classes[key]]
            c.executions += execs
            c.bytes += execs * costs[key][0]
            c.flops += execs * costs[key][1]
            rec = per_instr.setdefault(key, [classes[key], 0.0, 0, 0])
            rec[1] += sum(e.dur for e in evs)
            rec[2] += len(evs)
            rec[3] += execs
    for c in comps.values():
        c.us /= n
        c.memcpy_us /= n
        c.idle_before_us /= n
        c.bytes /= n
        c.flops /= n
        c.launches = round(c.launches / n)
        c.executions = round(c.executions / n)
    kernels = []
    chosen = _largest(
        per_instr.items(), lambda kv: kv[1][0], lambda kv: kv[1][1], per_component, top=top
    )
    for (module, name), (comp, us, launches, execs) in chosen:
        h = next(h for h in hlos if h.module == module)
        by, fl = costs[(module, name)]
        kernels.append(
            {
                "hlo_op": name,
                "hlo_module": module,
                "component": comp,
                "opcode": h.instrs[name].opcode,
                "op_name": h.instrs[name].op_name[-160:],
                "us_per_span": us / n,
                "launches_per_span": launches / n,
                "executions_per_span": execs / n,
                "bytes_per_execution": by,
                "flops_per_execution": fl,
            }
        )
    return {
        "components": comps,
        "spans": span_rows,
        "kernels": kernels,
        "ops": operations(per_instr, hlos, costs, n, per_component=per_component),
        "unmatched": dict(unmatched.most_common(15)),
    }


def ordered(comps: dict[str, Component]) -> list[Component]:
    rank = {name: i for i, name in enumerate(COMPONENTS)}
    return sorted(comps.values(), key=lambda c: (rank.get(c.name, len(rank)), c.name))


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])
