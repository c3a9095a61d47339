"""The tick: one beat for every slot, pure and jitted once; and the two ways to drive it.

``tick(params, state, template, beat, masks)`` applies what the host's slot rule decided for the
beat (``slot_rule.SlotRule``: which slots are admitted, rolled over, run, end): the fresh-session
template written into each admitted slot in place, the rolled-over slots re-seeded, the running
slots advanced by ``frames_per_tick`` frames, every other slot kept bit-identical: every update
masks itself, nothing selects between two whole states, so the donated state is updated where it
lies. The tick decides nothing. Both drivers call the same tick, so they produce the same outputs
bit for bit:

- ``resident_loop``: one jitted ``lax.while_loop`` for the whole serving run. Each iteration takes
  the beat's input and masks from the host and hands the beat's output back through ordered
  ``io_callback``s; the host decides when to stop.
- dispatch (``make_tick``): one donated jitted call per beat; the host reads beat k's output while
  beat k+1 runs (``serving.server``).

The dispatch loop stages the tick (``make_staged``; over a mesh ``mesh.make_staged``;
``Engine(staged=True)``, in every bucket): the beat's admissions and roll-overs, in the masks,
run first as one-slot
programs (``admit_slot``, ``reseed_slot``), and the tick proper (``tick(..., staged=True)``) has
only loops whose trip count the compiler knows. On a GPU, XLA runs a loop of unknown trip count
by copying its predicate to the host every iteration, so a call with one returns only when the
device has reached the loop's end: the host's dispatch stage would then hold device time (24 ms
of a plain beat at 16 sessions on an H200, the whole roll-over work on a roll-over beat). The
resident loop keeps the one-program tick, with the same outputs bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from voicechat_jax.config import PAD_ID, Kernels, ModelConfig, ServeConfig
from voicechat_jax.model import nano, voicechat
from voicechat_jax.state import BeatInput, BeatOutput, SessionState, SlotMasks

# jax.monitoring's event for each XLA compilation (its ``fun_name`` names the jitted function).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# The jitted programs kept per process, one per configuration (``make_tick``, ``make_staged``,
# their ``mesh`` twins, ``engine.build_template``'s): an engine built again for a configuration
# already served in this process (a restart, a second run of the app, a test) traces, lowers and
# compiles nothing again; JAX's own caches hold the executables of a kept program.
PROGRAMS_KEPT = 16


class CompileCounter:
    """Counts the XLA compilations of jitted functions named like ``name``, while entered.

    Built on ``jax.monitoring``'s compile events (no global counter in the library): a server
    must compile its tick exactly once per configuration, and tests and the runner say so.
    """

    def __init__(self, name: str = "tick"):
        self.name = name
        self.count = 0

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        del duration
        if event == _COMPILE_EVENT and self.name in str(kwargs.get("fun_name", "")):
            self.count += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)


def insert(model: voicechat.FrameState, template: voicechat.FrameState, mask: jax.Array):
    """The slots in ``mask`` [B] set to the fresh-session template, in place; others untouched.

    A loop over the masked slots writes the template ([1, ...] leaves) into each with
    ``dynamic_update_slice`` (maxtext's ``insert``): the carried state is updated where it lies
    and a beat where nobody joins runs the loop zero times.
    """
    B = mask.shape[0]
    slots = jnp.nonzero(mask, size=B, fill_value=0)[0]  # the masked slots first

    def one(i, m):
        return _put_slot(m, template, slots[i])

    return jax.lax.fori_loop(0, jnp.sum(mask, dtype=jnp.int32), one, model)


def _slot(tree, b):
    """Slot ``b`` of every leaf, as a batch of one ([1, ...] leaves)."""
    return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, b, 1, axis=0), tree)


def _put_slot(tree, one, b, owned: jax.Array | None = None):
    """``one`` ([1, ...] leaves) written into slot ``b`` of ``tree``, in place.

    ``owned`` (a bool scalar; None: True): whether slot ``b`` is this program's to write. A
    one-slot program split over a mesh's ``data`` axis runs on every device, and only the device
    that holds the slot writes it; the others write the slot's own row back (``mesh.make_staged``).
    """
    if owned is not None:
        one = jax.tree_util.tree_map(
            lambda o, x: jnp.where(owned, o.astype(x.dtype), x), one, _slot(tree, b)
        )
    return jax.tree_util.tree_map(
        lambda x, o: jax.lax.dynamic_update_slice_in_dim(x, o.astype(x.dtype), b, axis=0), tree, one
    )


@struct.dataclass
class CapsuleLane:
    """A roll-over's capsule already prefilled: the LLM state a slot rolls over to.

    The host asks for a roll-over a beat ahead (``BeatInput.prefill``); the capsule is prefilled
    into a lane after that beat's tick, in the beat's slack, and the next beat's roll-over of the
    slot (``reseed``) takes the lane's state instead of prefilling in the beat. A lane is used only
    for the slot, ids and length it was prefilled for (anything else prefills as before).
    """

    llm: nano.NanoState  # [1, ...] the template's LLM state with ``ids[:n]`` prefilled after it
    slot: jax.Array  # int32 scalar: the slot it is for; -1: an empty lane
    ids: jax.Array  # [U] int32: the capsule it holds
    n: jax.Array  # int32 scalar: its length

    @classmethod
    def empty(cls, template: voicechat.FrameState, capsule_tokens: int) -> CapsuleLane:
        return cls(
            llm=template.llm,
            slot=jnp.full((), -1, jnp.int32),
            ids=jnp.zeros((capsule_tokens,), jnp.int32),
            n=jnp.zeros((), jnp.int32),
        )


def prefill_lane(params, template, capsule, capsule_len, slot, *, cfg: ModelConfig) -> CapsuleLane:
    """The lane of slot ``slot`` (int32 scalar) rolling over with ``capsule[:capsule_len]`` ([U],
    an int32 scalar > 0): the capsule prefilled after the template's LLM state
    (``_capsule_llm``)."""
    llm = _capsule_llm(params, template, capsule[None], capsule_len[None], cfg=cfg)
    return CapsuleLane(llm=llm, slot=slot, ids=capsule, n=capsule_len)


def reseed(
    params,
    model: voicechat.FrameState,
    template: voicechat.FrameState,
    mask: jax.Array,
    capsule: jax.Array,
    capsule_len: jax.Array,
    *,
    cfg: ModelConfig,
    lane: CapsuleLane | None = None,
) -> voicechat.FrameState:
    """Roll the sessions in ``mask`` [B] over to a fresh context that remembers the conversation.

    For each masked slot, in place: the LLM's state becomes the template's (the system prompt
    prefilled) followed by the slot's ``capsule[b, :capsule_len[b]]`` token ids, prefilled the
    way the system prompt is (``w_user E[token]``, PAD on the text and function channels); the
    speech decoder's context restarts from the template (speaker prompt and system prompt), with
    the session's last codes as its previous codes and its first frame not skipped, so the voice
    goes on without a gap. The encoder, RNNT and codec streams, the previous tokens and the frame
    counter (which keys the sampler) go on untouched: the audio is continuous.

    Args:
      capsule: [B, U] int32 token ids (U static, e.g. 96), read up to ``capsule_len``.
      capsule_len: [B] int32 in [0, U].
      lane: a capsule already prefilled (``CapsuleLane``): the slot it is for takes its LLM state
        when its capsule is the lane's, with no prefill in the tick.
    """
    B = mask.shape[0]
    slots = jnp.nonzero(mask, size=B, fill_value=0)[0]

    def one(i, m):
        b = slots[i]
        ids = jax.lax.dynamic_slice_in_dim(capsule, b, 1, axis=0)  # [1, U]
        n = jax.lax.dynamic_slice_in_dim(capsule_len, b, 1, axis=0)
        # An empty capsule leaves the template's LLM state as it is: no prefill to run.
        branches = [
            lambda: template.llm,
            lambda: _capsule_llm(params, template, ids, n, cfg=cfg),
        ]
        which = (n[0] > 0).astype(jnp.int32)
        if lane is not None:
            ready = (lane.slot == b) & (lane.n == n[0]) & jnp.all(lane.ids == ids[0])
            branches.append(lambda: lane.llm)
            which = jnp.where(ready & (n[0] > 0), 2, which)
        llm = jax.lax.switch(which, branches)
        return _restart_one(m, template, b, llm)

    return jax.lax.fori_loop(0, jnp.sum(mask, dtype=jnp.int32), one, model)


def _capsule_llm(params, template, ids, n, *, cfg: ModelConfig):
    """The template's LLM state with the capsule ``ids[:, :n]`` ([1, U], [1]) prefilled after it.
    With ``n`` 0 it is the template's state, bit for bit (prefill changes nothing past a
    length), so callers skip it then."""
    lc = cfg.llm
    pads = jnp.full(ids.shape, PAD_ID, jnp.int32)
    prompt = nano.embed(params.llm, ids).astype(jnp.float32)
    e = nano.input_embedding(params.llm, pads, pads, prompt, cfg=lc)
    llm, _ = nano.prefill(params.llm, template.llm, e, n, cfg=lc)
    return llm


def _restart_one(model, template, b, llm, owned=None) -> voicechat.FrameState:
    """Slot ``b`` of ``model`` rolled over to the LLM state ``llm`` (batch 1); see ``reseed``
    (``owned``: ``_put_slot``'s)."""
    cur = _slot(model, b)
    tts = template.tts.replace(prev_codes=cur.tts.prev_codes, frame=jnp.ones_like(cur.tts.frame))
    return _put_slot(model, cur.replace(llm=llm, tts=tts), b, owned)


def admit_slot(
    state: SessionState, template: voicechat.FrameState, slot: jax.Array, owned=None
) -> SessionState:
    """Slot ``slot`` (an int32 scalar) set to the fresh-session template, in place: ``insert``
    for one slot, as its own program (``make_staged``). Its live flag and key are the tick's.
    ``owned``: whether this device holds the slot (``_put_slot``; on a mesh)."""
    return state.replace(model=_put_slot(state.model, template, slot, owned))


def reseed_slot(
    params,
    state: SessionState,
    template: voicechat.FrameState,
    slot: jax.Array,
    capsule: jax.Array,
    capsule_len: jax.Array,
    owned=None,
    *,
    cfg: ModelConfig,
) -> SessionState:
    """Slot ``slot`` rolled over with ``capsule[:capsule_len]`` ([U] int32, an int32 scalar), in
    place: ``reseed`` for one slot, as its own program (``make_staged``). The host sends an
    empty capsule to ``restart_slot`` instead."""
    llm = _capsule_llm(params, template, capsule[None], capsule_len[None], cfg=cfg)
    return swap_slot(state, template, slot, llm, owned)


def restart_slot(
    state: SessionState, template: voicechat.FrameState, slot: jax.Array, owned=None
) -> SessionState:
    """Slot ``slot`` rolled over with an empty capsule, in place: ``reseed_slot`` without the
    prefill, which would leave the template's LLM state as it is (``make_staged``)."""
    return swap_slot(state, template, slot, template.llm, owned)


def swap_slot(
    state: SessionState,
    template: voicechat.FrameState,
    slot: jax.Array,
    llm: nano.NanoState,
    owned=None,
) -> SessionState:
    """Slot ``slot`` rolled over to the LLM state ``llm`` ([1, ...]: a ``CapsuleLane``'s, the
    capsule prefilled a beat before), in place: ``reseed_slot`` with its prefill already done
    (``make_staged``)."""
    return state.replace(model=_restart_one(state.model, template, slot, llm, owned))


def hold_full(model: voicechat.FrameState, fpt: int, mask: jax.Array) -> voicechat.FrameState:
    """Benchmarks only (``ServeConfig.hold_full``): both attention caches of the slots in
    ``mask`` [B] set to one beat short of full, so the beat writes their last ``fpt`` rows and
    every attention reads the whole cache. Costs what a slot at the cap costs; what it computes is
    meaningless. Other slots are untouched."""
    llm_rows, tts_rows = model.llm.k[0].shape[2], model.tts.k[0].shape[3]
    llm = model.llm.replace(length=jnp.where(mask, llm_rows - fpt, model.llm.length))
    tts = model.tts.replace(pos=jnp.where(mask, tts_rows - fpt, model.tts.pos))
    return model.replace(llm=llm, tts=tts)


def tick(
    params,
    state: SessionState,
    template: voicechat.FrameState,
    beat: BeatInput,
    masks: SlotMasks,
    *,
    cfg: ModelConfig,
    serve: ServeConfig,
    kernels: Kernels | None = None,
    staged: bool = False,
    lane: CapsuleLane | None = None,
) -> tuple[SessionState, BeatOutput]:
    """Advance every slot by one beat as ``masks`` says, in place. Donates ``state`` when jitted
    (``make_tick``).

    Args:
      params: ``voicechat.ModelParams``.
      state: all slots, ``[B, ...]``.
      template: the fresh-session state, ``[1, ...]`` leaves.
      beat: the host's input for this beat; only ``audio``, ``key`` (of the admitted slots) and
        ``capsule`` (of the rolled ones) are read.
      masks: the beat's decisions (``slot_rule.SlotRule.decide``): the tick decides nothing.
      kernels: the kernels this program runs (``config.Kernels``, chosen where the program is
        built: ``Engine``); None, for a tick called directly: ``serve.kernels`` for the slots
        it is traced with.

    Returns:
      The new state and the beat's outputs. The slots in ``masks.admit`` get the template, those
      in ``masks.rolled`` roll over first (``reseed``, each with its capsule), ``hold_full``
      (benchmarks) fills the live slots' caches, and the slots in ``masks.ran`` advance; every
      other slot's state is returned bit-identical. No select over the whole state: admission
      writes the template into the admitted slots, and every update in ``voicechat.advance``
      masks itself by the slots that run.

      ``staged``: the admissions and roll-overs of the beat already ran as their own programs
      (``make_staged``: ``admit_slot``, ``reseed_slot``), so this tick has no loop whose trip
      count the device decides: on a GPU its call returns without waiting for the device.

      ``lane``: a capsule prefilled after the last beat's tick (``CapsuleLane``; the resident
      loop's): the roll-over it is for takes its state instead of prefilling here.
      ``beat.prefill`` is not read here (the drivers prefill lanes after the tick).
    """
    fpt = serve.frames_per_tick
    key = jnp.where(masks.admit[:, None], beat.key, state.key)
    model = state.model
    if not staged:
        model = insert(model, template, masks.admit)
        model = reseed(
            params,
            model,
            template,
            masks.rolled,
            beat.capsule,
            masks.capsule_len,
            cfg=cfg,
            lane=lane,
        )
    if serve.hold_full:
        model = hold_full(model, fpt, masks.live)
    if kernels is None:
        kernels = serve.kernels(slots=masks.ran.shape[0])
    model, frames = voicechat.advance(
        params,
        model,
        beat.audio,
        key,
        masks.ran,
        cfg=cfg,
        precision=serve.precision,
        deterministic=serve.deterministic,
        kernels=kernels,
    )
    # A slot live after the beat was live before it or admitted: computed from the state's own
    # flags, ``active`` is written where they lie (an unread donated input would be dropped
    # from the program, and its buffer with it).
    active = masks.active & (state.active | masks.admit)
    new_state = SessionState(model=model, active=active, key=key)
    out = BeatOutput(
        frames=frames,
        ran=masks.ran,
        active=active,
        at_cap=masks.at_cap,
        reseeded=masks.rolled,
        frame=model.frame,
    )
    return new_state, out


@functools.lru_cache(maxsize=PROGRAMS_KEPT)
def make_tick(cfg: ModelConfig, serve: ServeConfig, kernels: Kernels | None = None) -> Callable:
    """The jitted tick for one server configuration and its kernels; argument 1 (the state) is
    donated. One per configuration in a process (``PROGRAMS_KEPT``)."""
    return jax.jit(_in_scope(tick, cfg=cfg, serve=serve, kernels=kernels), donate_argnums=(1,))


@dataclasses.dataclass(frozen=True)
class StagedPrograms:
    """The dispatch loop's programs when admission and roll-over are staged (``Engine``).

    ``admit(state, template, slot)``, ``reseed(params, state, template, slot, capsule,
    capsule_len)``, ``restart(state, template, slot)`` (a roll-over with an empty capsule) and
    ``swap(state, template, slot, llm)`` (a roll-over to a lane's prefilled LLM state) touch one
    slot, donate the state and are dispatched only for the slots that need them, before
    ``tick(params, state, template, beat, masks)`` (``tick`` with ``staged=True``). ``lane(params,
    template, capsule, capsule_len, slot)`` prefills a capsule the host will ask for next beat
    (``prefill_lane``), dispatched after the tick. None of them has a loop whose trip count the
    device decides.
    """

    admit: Callable
    reseed: Callable
    restart: Callable
    swap: Callable
    lane: Callable
    tick: Callable


@functools.lru_cache(maxsize=PROGRAMS_KEPT)
def make_staged(
    cfg: ModelConfig, serve: ServeConfig, kernels: Kernels | None = None
) -> StagedPrograms:
    """The jitted programs of the staged dispatch tick for one server configuration (one per
    configuration in a process: ``PROGRAMS_KEPT``)."""
    precision = serve.precision
    return StagedPrograms(
        admit=jax.jit(admit_slot, donate_argnums=(0,)),
        reseed=jax.jit(_in_scope(reseed_slot, cfg=cfg, precision=precision), donate_argnums=(1,)),
        restart=jax.jit(restart_slot, donate_argnums=(0,)),
        swap=jax.jit(swap_slot, donate_argnums=(0,)),
        lane=jax.jit(_in_scope(prefill_lane, cfg=cfg, precision=precision)),
        tick=jax.jit(
            _in_scope(tick, cfg=cfg, serve=serve, kernels=kernels, staged=True),
            donate_argnums=(1,),
        ),
    )


def _in_scope(fn: Callable, *, precision=None, **kw) -> Callable:
    """``fn`` with ``kw`` bound, traced inside ``precision``'s matmul scope (default:
    ``kw["serve"].precision``)."""
    precision = kw["serve"].precision if precision is None else precision

    @functools.wraps(fn)
    def scoped(*args):
        with precision.scope():
            return fn(*args, **kw)

    return scoped


def resident_loop(
    params,
    state: SessionState,
    template: voicechat.FrameState,
    first_beat: BeatInput,
    first_masks: SlotMasks,
    *,
    next_beat: Callable[[np.ndarray], tuple],
    deliver: Callable[..., None],
    cfg: ModelConfig,
    serve: ServeConfig,
    kernels: Kernels | None = None,
) -> SessionState:
    """Run ticks on the device until the host says stop; returns the final state.

    ``next_beat(k) -> (beat, masks, stop)`` gives beat k+1's input and masks (a ``BeatInput`` and
    the ``SlotMasks`` the host's rule decided for it, NumPy arrays);
    ``deliver(k, out)`` receives beat k's ``BeatOutput`` with NumPy leaves. Both run on the host
    through ordered ``io_callback``s: the device waits for them, and they never call JAX.
    """
    beat_struct, masks_struct = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (first_beat, first_masks)
    )
    stop_struct = jax.ShapeDtypeStruct((), jnp.bool_)

    def body(carry):
        k, s, beat, masks, _, lane = carry
        s, out = tick(
            params, s, template, beat, masks, cfg=cfg, serve=serve, kernels=kernels, lane=lane
        )
        leaves, treedef = jax.tree_util.tree_flatten(out)

        def deliver_host(kk, *host_leaves):
            deliver(int(kk), jax.tree_util.tree_unflatten(treedef, host_leaves))
            return np.zeros((), np.int32)

        token = io_callback(
            deliver_host, jax.ShapeDtypeStruct((), jnp.int32), k, *leaves, ordered=True
        )
        # The capsule the host will ask for next beat, prefilled once this beat's output is on
        # the host (the token orders it after ``deliver``) and before the host's wait for the
        # next beat (its length is an operand of ``next_beat``'s callback): in the beat's slack.
        lane = _next_lane(params, template, beat, lane, token, cfg=cfg)
        nb, nm, stop = io_callback(
            lambda kk, _tok, _lane: next_beat(int(kk)),
            (beat_struct, masks_struct, stop_struct),
            k,
            token,
            lane.n,
            ordered=True,
        )
        return k + 1, s, nb, nm, stop, lane

    def cond(carry):
        return ~carry[4]

    lane = CapsuleLane.empty(template, first_beat.capsule.shape[1])
    stop = jnp.zeros((), jnp.bool_)
    carry = (jnp.zeros((), jnp.int32), state, first_beat, first_masks, stop, lane)
    _, state, _, _, _, _ = jax.lax.while_loop(cond, body, carry)
    return state


def _next_lane(params, template, beat: BeatInput, lane: CapsuleLane, token, *, cfg) -> CapsuleLane:
    """The resident loop's one lane for the next beat: the first slot of ``beat.prefill`` with a
    capsule, prefilled; or the lane left empty (``slot`` -1). Further requests of the same beat
    are prefilled in the next tick (``reseed``)."""
    want = beat.prefill & (beat.capsule_len > 0)
    b = jnp.argmax(want).astype(jnp.int32)
    ids = beat.capsule[b] + token  # ``token`` (0) makes the prefill wait for ``deliver``
    n = beat.capsule_len[b]
    return jax.lax.cond(
        jnp.any(want),
        lambda: prefill_lane(params, template, ids, n, b, cfg=cfg),
        lambda: lane.replace(slot=jnp.full((), -1, jnp.int32)),
    )


def make_resident(
    cfg: ModelConfig, serve: ServeConfig, next_beat, deliver, kernels: Kernels | None = None
):
    """The jitted resident loop; the state (argument 1) is donated."""
    fn = _in_scope(
        resident_loop, next_beat=next_beat, deliver=deliver, cfg=cfg, serve=serve, kernels=kernels
    )
    return jax.jit(fn, donate_argnums=(1,))
