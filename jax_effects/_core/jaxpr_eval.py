"""Evaluating a jaxpr equation by equation into the current trace.

The walk both jaxpr interpreters share (the token-threading pass and the
masking of effects in a vmapped ``cond`` branch, ``_primitives.effect``):
:func:`eval_jaxpr`, with a ``handle(eqn, invals)`` per interpreter; an
equation it leaves unchanged is copied into the trace, not re-bound
(``_compat.equation_copier``).
:data:`CALLEES`: the call-like primitives both inline. No part of the
token calling convention: the callers add it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from jax.extend import core as jex_core
from jax.extend import source_info_util
from jax.extend.core import primitives as jex_prims

from jax_effects import _compat

#: Call-like primitive -> the parameter holding its callee (a ClosedJaxpr or
#: a Jaxpr), whose evaluation is the primitive's evaluation.
CALLEES: dict[jex_core.Primitive, str] = {
    jex_prims.jit_p: "jaxpr",
    jex_prims.remat_p: "jaxpr",
    jex_prims.closed_call_p: "call_jaxpr",
    jex_prims.call_p: "call_jaxpr",
    jex_prims.custom_jvp_call_p: "call_jaxpr",
    jex_prims.custom_vjp_call_p: "call_jaxpr",
    _compat.custom_vmap_p: "call",
    _compat.composite_p: _compat.COMPOSITE_CALLEE,
    _compat.compute_on_p: "jaxpr",
    _compat.linear_call_p: "callee",
}
CALLEES.pop(None, None)   # (compute_on_p where JAX lacks it: _compat.MISSING)


def split(closed) -> tuple:
  """``(jaxpr, consts)`` of a ClosedJaxpr or a Jaxpr."""
  if isinstance(closed, jex_core.ClosedJaxpr):
    return closed.jaxpr, closed.consts
  return closed, ()


def rebind(eqn, invals):
  """The equation re-emitted unchanged (the default of a handler)."""
  return _compat.bind_equation(eqn, invals)


def eval_jaxpr(jaxpr: jex_core.Jaxpr, consts: Sequence[Any],
               args: Sequence[Any],
               handle: Callable[[Any, list], Any],
               unchanged: Callable[[Any], bool] | None = None) -> list:
  """Evaluates ``jaxpr`` in the current trace; ``handle(eqn, invals)``
  returns each equation's output(s). One for which ``unchanged(eqn)``
  holds is copied where it can be (no abstract evaluation: cheaper)."""
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  copy = _compat.equation_copier(jaxpr) if unchanged is not None else None
  literal = jex_core.Literal

  for eqn in jaxpr.eqns:   # (a DropVar binder is written, never read)
    invals = [v.val if type(v) is literal else env[v] for v in eqn.invars]
    outs = None
    if copy is not None and unchanged(eqn):   # type: ignore[misc]
      outs = copy(eqn, invals)
    if outs is None:
      with source_info_util.user_context(
          eqn.source_info.traceback,
          name_stack=eqn.source_info.name_stack), eqn.ctx.manager:
        outs = handle(eqn, invals)
    if eqn.primitive.multiple_results:
      env.update(zip(eqn.outvars, outs))
    else:
      env[eqn.outvars[0]] = outs
  return [v.val if type(v) is literal else env[v] for v in jaxpr.outvars]
