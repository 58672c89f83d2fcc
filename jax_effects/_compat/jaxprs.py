"""What the token pass reads and re-emits: jaxprs, equations, effect kinds.

JAX internals for the layers that interpret jaxprs (``_core``, ``_pass``,
``_primitives``' rules): the effect-type registries and JAX's effect base
class, re-emitting an equation, scan's and shard_map's parameters, the
higher-order primitives the pass has rules for. Part in the token calling
convention: none of its own (``jax_effects._compat``).
"""
from __future__ import annotations

import importlib

import jax

from jax._src import core as _core
from jax._src import effects as _effects
from jax_effects._compat.versions import JAX_VERSION, optional

# Base class of JAX effect types. Public as ``jax.extend.core.Effect`` from
# JAX 0.10; on 0.8 and 0.9 only ``jax._src.effects.Effect`` (the same class).
Effect = _effects.Effect

# A jaxpr binder whose value is unused (``_``). Public as
# ``jax.extend.core.DropVar`` from JAX 0.10; on 0.8 and 0.9 only
# ``jax._src.core.DropVar`` (the same class).
DropVar = _core.DropVar


def bind_equation(eqn, invals):
  """Binds ``eqn``'s primitive to ``invals`` with its params (re-emits it).

  From JAX 0.9 ``Primitive.get_bind_params`` returns the bind params; on 0.8
  it returns ``(subfuns, params)`` and the subfunctions (call primitives'
  bodies) come first in ``bind``'s arguments.
  """
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bind_params, tuple):   # JAX 0.8
    subfuns, bind_params = bind_params
    return eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return eqn.primitive.bind(*invals, **bind_params)


# The trace that stages a jaxpr and its tracers, and constant folding
# (JAX 0.8-0.12, the same on every line): re-emitting an equation as it is,
# without re-running its abstract evaluation, is what ``jax.jit``'s inlining
# does (``pe.inline_jaxpr_into_trace``, the loop copied below); no public
# API re-emits an equation. It makes the token pass cost a copy, not a
# trace, per equation it leaves unchanged (``_core.jaxpr_eval``).
from jax._src.interpreters import partial_eval as _pe  # noqa: E402


def equation_copier(jaxpr):
  """``copy(eqn, invals)`` re-emitting an equation of ``jaxpr`` unchanged
  into the current trace, as ``jax.jit``'s inlining does (the same
  equation, new binders, no abstract evaluation), or None when nothing can
  be: the current trace does not stage a jaxpr, or ``jaxpr`` uses
  high-level types. ``copy`` returns the outputs (one value unless the
  primitive has multiple results), or None for an equation it leaves to
  :func:`bind_equation`: an input from another trace, or whose type is not
  the equation's, only constants as inputs (bound, they fold eagerly), an
  effect on an input, a mutable reference made or used."""
  trace = _core.trace_ctx.trace
  if type(trace) is not _pe.DynamicJaxprTrace or getattr(
      jaxpr, "is_high", False):
    return None
  tracer_type = _pe.DynamicJaxprTracer
  literal_type = _core.Literal
  input_effect = _effects.JaxprInputEffect
  fold = _pe.try_constant_folding
  emit = trace.emit_eqn

  def copy(eqn, invals):
    if getattr(eqn.primitive, "ref_allocating", False):
      return None   # (JAX evaluates these afresh: mutable references)
    src = eqn.source_info
    tracers = []
    staged = False
    for v, x in zip(eqn.invars, invals):
      if type(v) is literal_type:
        tracers.append(tracer_type(trace, v.aval, v, src))
        continue
      if type(x) is tracer_type and x._trace is trace:
        staged = True
      elif isinstance(x, _core.Tracer):
        return None
      else:
        x = trace.to_jaxpr_tracer(x, src)
      if x.aval != v.aval or getattr(v.aval, "has_qdd", False):
        return None   # (quasi-dynamic data: avals with it, JAX 0.8-0.10)
      tracers.append(x)
    if not staged:
      return None
    effects = eqn.effects
    if effects and any(isinstance(e, input_effect) for e in effects):
      return None
    out_avals = [v.aval for v in eqn.outvars]
    consts = fold(eqn.primitive, tracers, eqn.params, out_avals)
    if consts is not None:
      outs = [trace.new_const(c, source_info=src, aval=aval)
              for c, aval in zip(consts, out_avals)]
    else:
      outs = emit(tracers, out_avals, eqn.primitive, eqn.params, effects,
                  src, eqn.ctx)
    return outs if eqn.primitive.multiple_results else outs[0]

  return copy


def varying_axes(aval) -> frozenset:
  """The manual mesh axes over which a value inside ``shard_map`` varies.

  JAX 0.10 keeps them in ``aval.manual_axis_type.varying``; 0.8 and 0.9 in
  ``aval.vma`` (a frozenset of axis names).
  """
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(aval.vma)

# Effect-type registries. Our trace-time marker effect must be allowed inside
# control flow, custom derivatives and remat, must survive partial evaluation
# (so grad/checkpoint neither drop nor duplicate an effect), and must be
# lowerable for code that ends up under plain ``jax.jit``. It is never added to
# ``ordered_effects``: JAX's own runtime-token machinery stays out of the way.
control_flow_allowed_effects = _effects.control_flow_allowed_effects
custom_derivatives_allowed_effects = _effects.custom_derivatives_allowed_effects
remat_allowed_effects = _effects.remat_allowed_effects
partial_eval_kept_effects = _effects.partial_eval_kept_effects
lowerable_effects = _effects.lowerable_effects
# Only for the plain-``jax.jit`` fallback lowering of an *ordered* marker: JAX
# then threads its own tokens through it (see _effects.PlainJitOrder).
ordered_effects = _effects.ordered_effects
shardable_ordered_effects = _effects.shardable_ordered_effects


# Loop-invariant hoisting of scan's partial evaluation (grad, vjp, linearize
# of a scan), JAX 0.8-0.12: ``_scan_known_hoisting`` re-traces the forward
# ("known") scan body with its consts known, and every equation whose inputs
# are all consts is evaluated once, outside the loop. For an effect that is
# wrong: ``print("step")`` or a progress bar's ``bar.update()`` in the body
# would run once instead of once per iteration (JAX's own
# ``jax.debug.print("step")`` does so under ``jax.grad``).
# ``_scan_partial_eval`` calls it by its module-level name, so it is wrapped
# there: a body with one of our effects (``keep_effects_in_loops``) is not
# hoisted (JAX's own "to disable" return); every other scan is hoisted as
# before.
from jax._src.lax.control_flow import loops as _loops  # noqa: E402

_jax_scan_known_hoisting = _loops._scan_known_hoisting
_unhoisted_effect_types: set = set()


def _scan_known_hoisting(jaxpr_known, known_consts, num_res, *num_sres):
  # JAX 0.11 added ``num_sres`` (residuals never hoisted); ``num_res`` is
  # the number of hoistable ones on every line.
  if any(type(e) in _unhoisted_effect_types for e in jaxpr_known.effects):
    return jaxpr_known, known_consts, [False] * num_res, []
  return _jax_scan_known_hoisting(jaxpr_known, known_consts, num_res,
                                  *num_sres)


def scan_counts(params) -> tuple[int, int]:
  """``(number of consts, number of carries)`` of a ``scan`` equation.

  JAX 0.8-0.10 give them as params ``num_consts`` and ``num_carry``; from
  0.11 the operands' structure is a flat tree, ``ft_in`` (consts, carry,
  xs), whose parts' leaves are the operands in order.
  """
  if "num_consts" in params:   # JAX 0.8-0.10
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()   # JAX 0.11, 0.12
  return len(list(consts)), len(list(carry))


def keep_effects_in_loops(*effect_types) -> None:
  """Equations carrying an effect of these types stay in their scan's body
  under partial evaluation (see ``_scan_known_hoisting`` above)."""
  _unhoisted_effect_types.update(effect_types)
  _loops._scan_known_hoisting = _scan_known_hoisting


# shard_map's primitive (and pmap's: JAX stages jax.pmap as jit(shard_map),
# always on 0.10, by default (jax_pmap_shmap_merge=True) on 0.8 and 0.9).
# The token-threading pass needs a rule for it; there is no public handle.
from jax._src.shard_map import shard_map_p  # noqa: E402


def shard_map_manual_axes(params) -> frozenset:
  """The mesh axes a ``shard_map`` equation makes manual (from its params).

  JAX 0.10 names the param ``newly_manual_axes`` (axes already manual in an
  enclosing ``shard_map`` left out); 0.8 and 0.9 name it ``manual_axes`` (the
  ``axis_names`` given to ``jax.shard_map``).
  """
  if "newly_manual_axes" in params:
    return frozenset(params["newly_manual_axes"])
  return frozenset(params["manual_axes"])


def in_cond_branch(name_stack) -> bool:
  """Whether an op lowered under ``name_stack`` is inside a ``cond`` branch.

  JAX's cond lowering names each branch's ops ``branch_<i>_fun`` in the name
  stack (``jax/_src/lax/control_flow/conditionals.py``, JAX 0.8-0.12); a
  branch vmap inlined into a ``select`` has no such name. No public handle.
  """
  return "_fun" in str(name_stack)


# Higher-order primitives of JAX with no public handle, for the pass's rules
# (``_pass.token_pass``); JAX 0.8, 0.9 and 0.10 define them here.
# ``custom_vmap_call`` (jax.custom_batching.custom_vmap), ``composite``
# (jax.lax.composite) and ``linear_call`` (jax.custom_derivatives.linear_call)
# are inlined by the pass, as their impls do.
from jax._src.custom_batching import custom_vmap_p  # noqa: E402
from jax._src.custom_derivatives import linear_call_p  # noqa: E402
# ``batch_jaxpr(closed_jaxpr, axis_data, in_batched, instantiate)``: which
# outputs of a jaxpr vmap batches. The vmap rules of ``while``/``cond`` that
# jax_effects wraps (``_primitives.control_flow_batching``) call JAX's own rule unchanged
# and use this, as that rule does, to find whether the predicate is batched
# (JAX 0.8-0.12: same signature; no public route).
from jax._src.interpreters.batching import batch_jaxpr  # noqa: E402
from jax._src.lax.lax import composite_p  # noqa: E402
# ``compute_on`` (``jax.experimental.compute_on``): a primitive of its own
# with the callee in ``jaxpr`` (JAX 0.10's ``compute_on2``; the only form
# from 0.11); inlined by the pass like a ``jit``. No public handle.
COMPUTE_ON = "effects inside jax.experimental.compute_on"
compute_on_p = optional(
    COMPUTE_ON,
    lambda: importlib.import_module("jax._src.compute_on").compute_on_p)
#: The param of a ``composite`` equation holding its callee: ``jaxpr`` on
#: JAX 0.8-0.10, ``call_jaxpr`` from 0.11.
COMPOSITE_CALLEE = "jaxpr" if JAX_VERSION < (0, 11) else "call_jaxpr"

# JAX 0.11 added "high-level" primitives (``jax._src.hijax``): one generic
# primitive, ``call_hi_primitive``, whose ``_prim`` param is an object that
# expands to ordinary ("lojax") primitives when the jaxpr is lowered
# (``to_lojax``). ``lax.custom_root`` is one from 0.11. The pass runs after
# differentiation, so it threads the expansion, as lowering would run it.
# (0.10 has the primitive, but no public API stages it: left without a rule.)
HI_PRIMITIVES = "effects inside JAX's high-level primitives (lax.custom_root)"
call_hi_primitive_p = None if JAX_VERSION < (0, 11) else optional(
    HI_PRIMITIVES,
    lambda: importlib.import_module("jax._src.hijax").call_hi_primitive_p)


def hi_primitive_expansion(eqn):
  """The ClosedJaxpr a ``call_hi_primitive`` equation expands to (its
  ``to_lojax`` rule traced at the equation's input types)."""
  prim = eqn.params["_prim"]

  def expand(*args):
    return call_hi_primitive_p.to_lojax(*args, _prim=prim)
  return jax.make_jaxpr(expand)(*(
      jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                           weak_type=v.aval.weak_type) for v in eqn.invars))

# The jaxprs held in an equation's params (sub-computations of higher-order
# primitives): public as ``jax.extend.core.jaxprs_in_params`` from JAX 0.10,
# only in ``jax._src.core`` before (0.8, 0.9).
try:
  from jax.extend.core import jaxprs_in_params  # noqa: E402
except ImportError:  # JAX < 0.10
  from jax._src.core import jaxprs_in_params  # noqa: E402
