"""JAX's own host callbacks inside ``jax_effects.jit``: adopted by the pass.

``jax.debug.print``, ``jax.debug.log`` (``debug_print_p``),
``jax.debug.callback`` (``debug_callback_p``) and
``jax.experimental.io_callback`` (``io_callback_p``)
traced inside a ``jax_effects.jit`` function are converted by the
token-threading pass into ``threaded_effect_p`` equations, like
``jax_effects`` effects. Their part of the token calling convention:

* each one joins the chain of :data:`~jax_effects.DEFAULT`
  (:data:`~jax_effects.GLOBAL` in global mode): it takes and returns that
  chain's compiler token and carrier, so it runs in program order with every
  ``jax_effects`` effect of the default stream, inside the computation and
  across dispatches (the runtime token of ``DEFAULT``). That holds for
  ``ordered=True`` (JAX's ``OrderedDebugEffect``/``OrderedIOEffect``) and
  for JAX's default unordered callbacks (``DebugEffect``/``IOEffect``) alike:
  JAX promises no order for the latter, and program order is one, so
  existing code (which mostly calls ``jax.debug.print`` without
  ``ordered=True``) prints in program order by changing only its ``jit``;
* the host side is JAX's own (the debug primitives' impl, io_callback's
  host implementation), so arguments, formatting and results are exactly JAX's;
  where it runs is ours (``_placement``: once per device inside
  ``shard_map``/``pmap``, once otherwise), so it works on several devices and
  in ``shard_map``, where JAX refuses ordered callbacks, and an exception
  reaches the caller as itself, once (``_errors``);
* after the pass no JAX effect is left, so ``jax.jit``'s C++ fast path
  dispatches the function.

Differences from JAX's own lowering: ``io_callback``'s ``sharding=`` (the
device to run on) is ignored, the callback runs where ours run (the first
device of the computation); output of adopted callbacks is JAX's own (no
device prefix, not held by :func:`~jax_effects.deterministic`); an ordered
``io_callback`` under ``vmap`` is still refused by JAX while tracing, before
the pass.

Not adopted (left to JAX, which then also keeps its slower dispatch):
``jax.debug.callback(..., partitioned=True)`` (JAX runs it per shard under
automatic partitioning; ours would run once on the whole value), and a
callback inside a higher-order primitive the pass has no rule for.
"""
from __future__ import annotations

from jax_effects import _adopted_host
from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _host

#: JAX effect types of adopted callbacks -> whether JAX orders them.
_EFFECT_TYPES = {
    _compat.OrderedDebugEffect: True,
    _compat.DebugEffect: False,
    _compat.OrderedIOEffect: True,
    _compat.IOEffect: False,
}


def is_adoptable_effect(effect) -> bool:
  """Whether ``effect`` is the JAX effect of a callback the pass adopts."""
  return type(effect) in _EFFECT_TYPES


def chain_key(effect, mode: str):
  """The chain of an adopted JAX effect: DEFAULT (GLOBAL in global mode),
  whether JAX's effect is ordered or not (see the module docstring)."""
  del effect
  return _effects.GLOBAL if mode == "global" else _effects.DEFAULT


def adopt(eqn):
  """``(host_callback, jax_effect)`` for an adoptable equation, or None if
  the equation stays JAX's.

  A new :class:`~jax_effects._host.HostCallback` per pass run (the pass runs
  once per trace of the function).
  """
  prim = eqn.primitive
  params = eqn.params
  (effect,) = [e for e in eqn.effects if is_adoptable_effect(e)]
  if prim is _compat.debug_print_p:
    if params.get("partitioned"):
      return None
    host = _host.HostCallback(
        _adopted_host.debug_print(params),
        f"{_adopted_host.describe(params)} (adopted by jax_effects.jit)",
        reads_placement=True)
    return host, effect
  if prim is _compat.debug_callback_p:
    if params.get("partitioned"):
      return None
    host = _host.HostCallback(
        _adopted_host.debug_callback(params),
        "jax.debug.callback (adopted by jax_effects.jit)")
    return host, effect
  if prim is _compat.io_callback_p:
    result_avals = tuple(params["result_avals"])
    host = _host.HostCallback(
        _adopted_host.io_callback(params, result_avals),
        "jax.experimental.io_callback (adopted by jax_effects.jit)",
        result_avals)
    return host, effect
  return None


PRIMITIVES = frozenset({_compat.debug_callback_p, _compat.debug_print_p,
                        _compat.io_callback_p})
