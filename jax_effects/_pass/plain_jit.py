"""Regions of ours under plain ``jax.jit``: lowered through the pass.

Under plain ``jax.jit`` (a library's jit, ``nnx.jit``, ``eqx.filter_jit``,
or JAX's eager ``while_loop``/``cond``/``scan``, which jit the primitive)
no pass of ours runs before JAX lowers the program. An effect directly at
the top of the program is lowered by ``effect.fallback_lowering`` on JAX's
token of ``PLAIN_JIT_ORDER``; a higher-order primitive holding effects of
ours (``while``, ``cond``, ``scan``, ``shard_map``, a nested ``jit``, ...:
every primitive the pass has a rule for) is lowered here, through the
pass's own rule, so it runs exactly as it runs inside
``jax_effects.jit``: a ``cond_fun``'s effects run before the loop and
after each iteration (XLA skips a ``while``'s condition computation when
it knows the trip count), a vmapped loop's effects run for its live
elements only, and per-device effects come before the effects after the
``shard_map`` on every device.

Its part of the token calling convention: the region is bracketed by the
exported convention's entry and exit (``_primitives.exported``, with
``order=PLAIN_JIT_ORDER``): every chain of the region starts from one
carrier made, by a host call, from JAX's token of ``PLAIN_JIT_ORDER``
(joined with every ordered chain, ``host_call.join``), and the region's final
carriers, combined as ``thread_program`` combines them, make that token
again by another host call. So the region is one step in JAX's order of
the program and of the thread's calls. A region with unordered effects only
starts its carriers from zero and returns no token. See
``design/errors.md``, "Plain ``jax.jit``".
"""
from __future__ import annotations

from jax.extend import core as jex_core
from jax.interpreters import mlir
import jax.numpy as jnp

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import exported as _exported
from jax_effects._runtime import token_value as _token_value

PLAIN_JIT_ORDER = _effects.PLAIN_JIT_ORDER


def _holds_our_effects(params) -> bool:
  return any(_effects.has_own_marker(j.effects)
             for j in _compat.jaxprs_in_params(params))


def _one_equation(ctx, primitive, params) -> jex_core.ClosedJaxpr:
  """The equation being lowered, as a jaxpr of its own (the pass's input);
  its effects are its sub-jaxprs' (the pass reads only its own kinds)."""
  effects = set().union(*(j.effects for j in _compat.jaxprs_in_params(params)))
  invars = [jex_core.Var(a) for a in ctx.avals_in]
  outvars = [jex_core.Var(a) for a in ctx.avals_out]
  eqn = _compat.new_jaxpr_eqn(invars, outvars, primitive, params, effects,
                              ctx=ctx.jaxpr_eqn_ctx)
  info = _compat.DebugInfo(primitive.name, "jax_effects plain jax.jit region",
                           None, None)
  return jex_core.ClosedJaxpr(
      jex_core.Jaxpr([], invars, outvars, [eqn], effects, info), [])


def through_the_pass(primitive, rule):
  """``primitive``'s lowering ``rule`` (JAX's), made to lower a region
  holding effects of ours through the pass (the module docstring)."""

  def rule_through_the_pass(ctx, *args, **params):
    if not _holds_our_effects(params):
      return rule(ctx, *args, **params)
    # (one chain, as JAX's one token of PLAIN_JIT_ORDER orders the effects
    # around the region: right in either mode, which jax.jit's cache of
    # the executable does not know)
    mode = "global"
    ordered = PLAIN_JIT_ORDER in ctx.tokens_in.effects()

    def region(*args):
      closed = _one_equation(ctx, primitive, params)
      carrier = (_exported.entry(PLAIN_JIT_ORDER) if ordered
                 else jnp.zeros((), _token_value.TOKEN_DTYPE))
      outs, token = _token_pass.thread_region(
          closed, args, _token_value.advance(carrier), mode)
      if ordered:
        _exported.exit(carrier if token is None else token, PLAIN_JIT_ORDER)
      return outs

    return mlir.lower_fun(region, multiple_results=True)(ctx, *args)

  return rule_through_the_pass


_compat.wrap_lowerings(
    [p for p in _token_pass.RULES if p.multiple_results],  # (higher-order)
    through_the_pass)
