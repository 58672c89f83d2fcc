"""What the token pass reads and re-emits: jaxprs, equations, effect kinds.

For ``_core``, ``_pass`` and ``_primitives``' rules. Part in the token
calling convention: none of its own (``jax_effects._compat``).
"""
from __future__ import annotations

import importlib
import inspect

import jax

from jax._src import core as _core
from jax._src import effects as _effects
from jax_effects._compat.versions import JAX_VERSION, optional

# JAX's effect base class: public in ``jax.extend.core`` from JAX 0.10,
# only in ``jax._src`` on 0.8/0.9.
Effect = _effects.Effect


def bind_equation(eqn, invals):
  """Binds ``eqn``'s primitive to ``invals`` with its params (re-emits it):
  ``get_bind_params`` returns ``(subfuns, params)`` on JAX 0.8."""
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bind_params, tuple):   # JAX 0.8
    subfuns, bind_params = bind_params
    return eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return eqn.primitive.bind(*invals, **bind_params)


# The jaxpr-staging trace, its tracers and constant folding, to re-emit an
# equation without its abstract evaluation as ``jax.jit``'s inlining does
# (``pe.inline_jaxpr_into_trace``): no public API does. JAX 0.8-0.12.
from jax._src.interpreters import partial_eval as _pe  # noqa: E402


def equation_copier(jaxpr):
  """``copy(eqn, invals)`` re-emitting an equation of ``jaxpr`` unchanged
  into the current trace (new binders, no abstract evaluation), or None
  where the trace stages no jaxpr or ``jaxpr`` is high-level. ``copy``
  returns the outputs, or None for an equation left to
  :func:`bind_equation` (an input of another trace or type, only constant
  inputs, an input effect, a mutable reference)."""
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
      if (x.aval is not v.aval and x.aval != v.aval) or getattr(
          v.aval, "has_qdd", False):
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
      outs = emit(tracers, out_avals, eqn.primitive, eqn.params, effects, src, eqn.ctx)
    return outs if eqn.primitive.multiple_results else outs[0]

  return copy


def varying_axes(aval) -> frozenset:
  """The manual mesh axes over which a value inside ``shard_map`` varies:
  ``aval.manual_axis_type.varying`` on JAX 0.10+, ``aval.vma`` on 0.8/0.9."""
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(aval.vma if mat is None else mat.varying)


def to_varying(x, axes):
  """``x`` cast to varying over those of the manual mesh ``axes`` it does
  not vary over yet (``jax.lax.pcast``; ``x`` as it is where none)."""
  varying = varying_axes(jax.typeof(x))
  missing = tuple(a for a in axes if a not in varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x

# Effect-type registries, where our effect types are registered (no public
# handle; JAX 0.8-0.12).
_ALLOWING = (_effects.control_flow_allowed_effects,
             _effects.custom_derivatives_allowed_effects,
             _effects.remat_allowed_effects,
             _effects.partial_eval_kept_effects, _effects.lowerable_effects)


def allow_effect_types(*effect_types, ordered: bool = False) -> None:
  """Lets control flow, custom derivatives, remat, partial evaluation (kept)
  and lowering take equations with effects of these types; ``ordered``:
  also JAX's (shardable) ordered effects, never but for the plain-jax.jit
  fallback of an ordered marker (``_effects.PlainJitOrder``)."""
  ordering = (_effects.ordered_effects, _effects.shardable_ordered_effects)
  for registry in _ALLOWING + (ordering if ordered else ()):
    for effect_type in effect_types:
      registry.add_type(effect_type)


# Scan's partial evaluation hoists loop-invariant equations out of the
# forward body (JAX 0.8-0.12), which would run an effect there once instead
# of once per iteration. ``_scan_partial_eval`` calls ``_scan_known_hoisting``
# by its module-level name, so it is wrapped there: a body with one of our
# effects is not hoisted (JAX's own "to disable" return).
from jax._src.lax.control_flow import loops as _loops  # noqa: E402

_jax_scan_known_hoisting = _loops._scan_known_hoisting
_unhoisted_effect_types: set = set()


def _scan_known_hoisting(jaxpr_known, known_consts, num_res, *num_sres):
  # JAX 0.11 added ``num_sres`` (residuals never hoisted); ``num_res`` is
  # the number of hoistable ones on every line.
  if any(type(e) in _unhoisted_effect_types for e in jaxpr_known.effects):
    return jaxpr_known, known_consts, [False] * num_res, []
  return _jax_scan_known_hoisting(jaxpr_known, known_consts, num_res, *num_sres)


def scan_counts(params) -> tuple[int, int]:
  """``(number of consts, number of carries)`` of a ``scan`` equation:
  params ``num_consts``/``num_carry`` on JAX 0.8-0.10, the flat tree
  ``ft_in`` (consts, carry, xs) from 0.11."""
  if "num_consts" in params:   # JAX 0.8-0.10
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()   # JAX 0.11, 0.12
  return len(list(consts)), len(list(carry))


def keep_effects_in_loops(*effect_types) -> None:
  """Equations with an effect of these types stay in their scan's body
  under partial evaluation."""
  _unhoisted_effect_types.update(effect_types)
  _loops._scan_known_hoisting = _scan_known_hoisting


# shard_map's primitive (and pmap's, staged as jit(shard_map)), for the
# pass's rule: no public handle. JAX 0.8-0.12.
from jax._src.shard_map import shard_map_p  # noqa: E402


def shard_map_manual_axes(params) -> frozenset:
  """The mesh axes a ``shard_map`` equation makes manual: param
  ``newly_manual_axes`` on JAX 0.10+, ``manual_axes`` on 0.8/0.9."""
  return frozenset(params["newly_manual_axes"] if "newly_manual_axes" in params
                   else params["manual_axes"])


def in_cond_branch(name_stack) -> bool:
  """Whether an op lowered under ``name_stack`` is inside a ``cond`` branch
  (named ``branch_<i>_fun`` by JAX's cond lowering, JAX 0.8-0.12)."""
  return "_fun" in str(name_stack)


# Higher-order primitives the pass inlines (``custom_vmap``, ``composite``,
# ``linear_call``): no public handle. JAX 0.8-0.12.
from jax._src.custom_batching import custom_vmap_p  # noqa: E402
from jax._src.custom_derivatives import linear_call_p  # noqa: E402
# ``batch_jaxpr``: which outputs of a jaxpr vmap batches, to find whether a
# ``while``/``cond`` predicate is batched as JAX's rule does
# (``_primitives.effect``). No public route; JAX 0.8-0.12.
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

# JAX 0.11's high-level primitives (``call_hi_primitive``, e.g.
# ``lax.custom_root``): the pass threads their ``to_lojax`` expansion. (0.10
# has the primitive, but no public API stages it.)
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

# The jaxprs in an equation's params (``jax.extend.core``'s from JAX 0.10;
# ``core``: why not from there).
from jax_effects._compat.core import jaxprs_in_params  # noqa: E402


# An equation and its jaxpr made from a lowering rule's parameters (a region
# under plain jax.jit handed to the pass, ``_pass.control_flow_rules``):
# ``jax.extend.core`` has ``new_jaxpr_eqn`` and ``DebugInfo`` from JAX 0.9
# only; ``jax._src.core``'s, the same on 0.8-0.12.
from jax._src.core import DebugInfo  # noqa: E402
from jax._src.core import new_jaxpr_eqn  # noqa: E402


def traced_as_region(fun):
  """``fun`` (a function the pass hands to ``lax.scan``/``switch``/
  ``while_loop``) with its ``DebugInfo`` and signature set: JAX's
  ``api_util.debug_info`` returns a function's ``__fun_debug_info__`` (JAX
  0.8-0.12) instead of inspecting its signature and source, and
  ``inspect.signature`` (``_check_carry_type``'s) returns its
  ``__signature__``; about 10% of the pass's time. No argument names, as
  for :data:`DebugInfo` above."""
  fun.__fun_debug_info__ = _REGION_INFO
  fun.__signature__ = _REGION_SIGNATURE
  return fun


_REGION_INFO = DebugInfo("jax_effects pass", "jax_effects region", None, None)
_REGION_SIGNATURE = inspect.Signature(
    [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])


# A stretch of equations re-emitted as one nested ``jit`` equation: staged in
# one step, not copied equation by equation. No public API binds ``jit_p``
# from a jaxpr; the parameters are those ``jax.jit`` gives a nested call, JAX
# 0.8-0.12. Lowering inlines it from 0.11 (``Inline.JAX_LATE``); on 0.8-0.10
# it lowers as JAX lowers a ``jit`` in a ``jit`` there, a private function the
# module calls, which XLA inlines before it optimizes (its ``CallInliner``).
# ``ctx_mesh``: ``get_ctx_mesh`` from 0.10, the concrete mesh on 0.8-0.9.
from jax._src import api as _api  # noqa: E402
from jax._src import mesh as _mesh  # noqa: E402
from jax._src import pjit as _pjit  # noqa: E402

_INLINE_LATE = getattr(getattr(_api, "Inline", None), "JAX_LATE", None)
_closed_jaxpr = getattr(_core, "ClosedJaxpr", None)
_STRETCH_INFO = DebugInfo("jax_effects pass", "jax_effects stretch", None, None)
_ctx_mesh = getattr(_pjit, "get_ctx_mesh",
                    lambda _resource_env: _mesh.get_concrete_mesh())


def stretches_inlined_at_lowering() -> bool:
  """Whether lowering inlines :func:`stretch_binder`'s equations (JAX 0.11
  on); before, the lowered module calls each as a private function."""
  return _INLINE_LATE is not None


def stretch_binder():
  """``bind(eqns, invars, outvars, invals)``: ``eqns`` (a stretch of a
  jaxpr's equations, without effects, reading ``invars`` and defining
  ``outvars``) staged into the current trace as one nested ``jit``
  equation; returns the values of ``outvars``, or None where an input is of
  another trace or type (the caller copies the equations instead). None
  where the trace stages no jaxpr."""
  trace = _core.trace_ctx.trace
  if type(trace) is not _pe.DynamicJaxprTrace:
    return None
  tracer_type = _pe.DynamicJaxprTracer
  ctx_mesh = _ctx_mesh(False)
  unspecified = _pjit.UNSPECIFIED
  inline = False if _INLINE_LATE is None else _INLINE_LATE

  def bind(eqns, invars, outvars, invals):
    for v, x in zip(invars, invals):
      if isinstance(x, _core.Tracer) and not (
          type(x) is tracer_type and x._trace is trace
          and (x.aval is v.aval or x.aval == v.aval)) or getattr(
              v.aval, "has_qdd", False):
        return None   # (quasi-dynamic data: as equation_copier's copy)
    jaxpr = _core.Jaxpr((), invars, outvars, eqns, _core.no_effects,
                        _STRETCH_INFO)
    if _closed_jaxpr is not None:   # (0.8-0.11; 0.12's Jaxpr holds consts)
      jaxpr = _closed_jaxpr(jaxpr, ())
    n, m = len(invars), len(outvars)
    return _pjit.jit_p.bind(
        *invals, jaxpr=jaxpr, in_shardings=(unspecified,) * n,
        out_shardings=(unspecified,) * m, in_layouts=(None,) * n,
        out_layouts=(None,) * m, donated_invars=(False,) * n,
        ctx_mesh=ctx_mesh, name="jax_effects_stretch", keep_unused=False,
        inline=inline, compiler_options_kvs=())

  return bind
