"""Evaluating a jaxpr equation by equation into the current trace.

The walk both jaxpr interpreters share (the token-threading pass and the
masking of effects in a vmapped ``cond`` branch, ``_primitives.effect``):
:func:`eval_jaxpr`, with a ``handle(eqn, invals)`` per interpreter; an
equation it leaves unchanged is copied into the trace, not re-bound
(``_compat.equation_copier``), and, where the caller asks (a threaded
program), a long run of them is staged as one nested ``jit``
(:data:`STRETCH`, ``_compat.stretch_binder``).
:data:`CALLEES`: the call-like primitives both inline. No part of the
token calling convention: the callers add it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._compat.core import primitives as jprims

#: Call-like primitive -> the parameter holding its callee (a ClosedJaxpr or
#: a Jaxpr), whose evaluation is the primitive's evaluation.
CALLEES: dict[jcore.Primitive, str] = {
    jprims.jit_p: "jaxpr",
    jprims.remat_p: "jaxpr",
    jprims.closed_call_p: "call_jaxpr",
    jprims.call_p: "call_jaxpr",
    jprims.custom_jvp_call_p: "call_jaxpr",
    jprims.custom_vjp_call_p: "call_jaxpr",
    _compat.custom_vmap_p: "call",
    _compat.composite_p: _compat.COMPOSITE_CALLEE,
    _compat.compute_on_p: "jaxpr",
    _compat.linear_call_p: "callee",
}
CALLEES.pop(None, None)   # (compute_on_p where JAX lacks it: _compat.MISSING)


def split(closed) -> tuple:
  """``(jaxpr, consts)`` of a ClosedJaxpr or a Jaxpr."""
  if isinstance(closed, jcore.ClosedJaxpr):
    return closed.jaxpr, closed.consts
  return closed, ()


def rebind(eqn, invals):
  """The equation re-emitted unchanged (the default of a handler)."""
  return _compat.bind_equation(eqn, invals)


#: A run of at least this many equations that the caller leaves unchanged
#: and that carry no effect is staged as one nested ``jit`` equation
#: (``_compat.stretch_binder``): one step for the run, where copying costs a
#: few microseconds an equation. Shorter runs are copied. (From JAX 0.11
#: lowering inlines a stretch, and the module is the same either way; before,
#: the module calls it as a function, which XLA inlines.)
STRETCH = 32


class _Stretch:
  """A run of equations staged as one (:data:`STRETCH`): those it reads
  from before it (``invars``) and those it defines that are read after it
  (``outvars``)."""
  __slots__ = ("eqns", "invars", "outvars")

  def __init__(self, eqns, invars, outvars):
    self.eqns, self.invars, self.outvars = eqns, invars, outvars


def _with_stretches(jaxpr, unchanged: Callable[[Any], bool]) -> list | None:
  """``jaxpr``'s equations with each run of :data:`STRETCH` or more that
  ``unchanged`` leaves and that have no effect in a :class:`_Stretch`;
  None if it has no such run."""
  eqns = jaxpr.eqns
  runs, start = [], None
  for i, eqn in enumerate(eqns):
    if not eqn.effects and unchanged(eqn) and not getattr(
        eqn.primitive, "ref_allocating", False):
      if start is None:
        start = i
    else:
      if start is not None and i - start >= STRETCH:
        runs.append((start, i))
      start = None
  if start is not None and len(eqns) - start >= STRETCH:
    runs.append((start, len(eqns)))
  if not runs:
    return None
  literal = jcore.Literal
  last_read: dict = {}
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if type(v) is not literal:
        last_read[v] = i
  for v in jaxpr.outvars:
    if type(v) is not literal:
      last_read[v] = len(eqns)
  items, done = [], 0
  for a, b in runs:
    items.extend(eqns[done:a])
    run = eqns[a:b]
    defined, invars = set(), {}
    for eqn in run:
      for v in eqn.invars:
        if type(v) is not literal and v not in defined:
          invars[v] = None
      defined.update(eqn.outvars)
    outvars = [v for eqn in run for v in eqn.outvars
               if last_read.get(v, -1) >= b]
    items.append(_Stretch(run, list(invars), outvars))
    done = b
  items.extend(eqns[done:])
  return items


def eval_jaxpr(jaxpr: jcore.Jaxpr, consts: Sequence[Any],
               args: Sequence[Any],
               handle: Callable[[Any, list], Any],
               unchanged: Callable[[Any], bool] | None = None,
               stretches: bool = False) -> list:
  """Evaluates ``jaxpr`` in the current trace; ``handle(eqn, invals)``
  returns each equation's output(s). One for which ``unchanged(eqn)``
  holds is copied where it can be (no abstract evaluation: cheaper); with
  ``stretches``, a long run of them is staged as one equation
  (:data:`STRETCH`)."""
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  copy = _compat.equation_copier(jaxpr) if unchanged is not None else None
  literal = jcore.Literal
  items = bind_stretch = None
  if stretches and copy is not None and len(jaxpr.eqns) >= STRETCH:
    bind_stretch = _compat.stretch_binder()
    if bind_stretch is not None:
      items = _with_stretches(jaxpr, unchanged)

  def run(items) -> None:
    for eqn in items:   # (a DropVar binder is written, never read)
      if type(eqn) is _Stretch:
        # (located at its first equation's user code, not in this module)
        with jcore.source_info_util.user_context(
            eqn.eqns[0].source_info.traceback):
          outs = bind_stretch(eqn.eqns, eqn.invars, eqn.outvars,
                              [env[v] for v in eqn.invars])
        if outs is None:
          run(eqn.eqns)
        else:
          env.update(zip(eqn.outvars, outs))
        continue
      invals = [v.val if type(v) is literal else env[v] for v in eqn.invars]
      outs = None
      if copy is not None and unchanged(eqn):   # type: ignore[misc]
        outs = copy(eqn, invals)
      if outs is None:
        with jcore.source_info_util.user_context(
            eqn.source_info.traceback,
            name_stack=eqn.source_info.name_stack), eqn.ctx.manager:
          outs = handle(eqn, invals)
      if eqn.primitive.multiple_results:
        env.update(zip(eqn.outvars, outs))
      else:
        env[eqn.outvars[0]] = outs

  run(jaxpr.eqns if items is None else items)
  return [v.val if type(v) is literal else env[v] for v in jaxpr.outvars]
