"""Work placed on a second GPU stream: ``on_stream`` and the ``inlined`` form it needs.

XLA runs a computation marked with ``compute_on('gpu_stream:N')`` on a stream of its own when
``--xla_gpu_experimental_stream_annotation=true`` is in ``XLA_FLAGS``, beside the main stream's
kernels it does not depend on; without the flag (and off a GPU) it runs in program order as
usual, with the same result. Whether XLA 0.11.2 overlaps the two is
``experiments/stream_overlap``'s question; ``Kernels.codec_stream`` uses it for the codec.
"""

from __future__ import annotations

import inspect

import jax
from jax import lax
from jax.experimental.compute_on import compute_on


def on_stream(fn, stream: int = 1):
    """``inlined(fn)`` placed on GPU stream ``stream``: jax 0.11 made ``compute_on`` a function
    transform (``compute_type=``, ``out_memory_spaces=``); jax 0.10 has it as a context manager."""
    fn = inlined(fn)
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(
            fn, compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device
        )

    def call(*args):
        with compute_on(f"gpu_stream:{stream}"):
            return jax.jit(fn)(*args)

    return call


def inlined(fn):
    """``fn`` with every nested call it makes (``jnp.pad`` and ``lax.dynamic_index_in_dim`` are
    ``jit``s; a scan's body holds more) traced inline.

    Under jax 0.11.2 on the GPU a stream-annotated region that holds a call of its own fails at
    run time (``NOT_FOUND: No ExecutionStreamId found for %call-start ... compute_on/jit(_pad)``,
    2026-12-05, H200): XLA gives the annotated call a stream but not the calls nested in it. So
    the region is one flat computation: ``fn``'s jaxpr evaluated with its call equations replaced
    by their bodies, in loop bodies too."""
    calls = {"jit": "jaxpr", "closed_call": "call_jaxpr"}  # call primitive -> its body's param

    def run(jaxpr, consts, args):
        env = {}

        def read(v):
            return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive.name in calls:
                body = eqn.params[calls[eqn.primitive.name]]
                outs = run(body.jaxpr, body.consts, ins)
            elif eqn.primitive.name == "scan":  # lowered, a scan calls its body: unrolled here
                outs = unrolled_scan(eqn.params, ins)
            else:
                bind = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before 0.5
                subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
                params = {k: flat(v) for k, v in params.items()}
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*subfuns, *ins, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    def unrolled_scan(p, ins):
        body, (nc, nk) = p["jaxpr"], _scan_counts(p, len(ins))
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        steps = range(p["length"] - 1, -1, -1) if p.get("reverse") else range(p["length"])
        ys = {}
        for i in steps:
            step_xs = [lax.squeeze(lax.slice_in_dim(x, i, i + 1), (0,)) for x in xs]
            out = run(body.jaxpr, body.consts, [*consts, *carry, *step_xs])
            carry, ys[i] = out[:nk], out[nk:]
        stacked = [
            lax.concatenate([lax.expand_dims(ys[i][j], (0,)) for i in range(p["length"])], 0)
            for j in range(len(body.jaxpr.outvars) - nk)
        ]
        return [*carry, *stacked]

    def flat(param):
        """A loop's or branch's body (a closed jaxpr) with its calls inlined; others as given."""
        if type(param) is tuple:  # a cond's branches (not a named tuple of numbers)
            return tuple(flat(p) for p in param)
        if not isinstance(param, jax.extend.core.ClosedJaxpr):
            return param
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in param.jaxpr.invars]
        return jax.make_jaxpr(lambda *xs: run(param.jaxpr, param.consts, xs))(*avals)

    def call(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = run(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), out)

    return call


def _scan_counts(params: dict, n_operands: int) -> tuple[int, int]:
    """(consts, carry) operand counts of a scan equation. Before jax 0.11 its parameters name
    them (``num_consts``, ``num_carry``); jax 0.11 has neither (``KeyError: 'num_consts'`` on an
    H100, 2026-12-06) and keeps the operands' (consts, carry, xs) grouping in ``ft_in``, whose
    ``unpack()`` gives one entry per operand in each group (not yet run on jax 0.11: the
    grouping is checked against the operand count, so a layout other than this fails here)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    groups = params["ft_in"].unpack()
    counts = [len(g) for g in groups]
    if len(counts) != 3 or sum(counts) != n_operands:
        raise NotImplementedError(
            f"a scan whose ft_in groups {counts} are not (consts, carry, xs) of its "
            f"{n_operands} operands: streams.inlined cannot unroll it"
        )
    return counts[0], counts[1]
