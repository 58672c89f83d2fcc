"""JAX's own host callbacks inside ``jax_effects.jit``: adopted by the pass.

``jax.debug.print``, ``jax.debug.log`` (``debug_print_p``),
``jax.debug.callback`` (``debug_callback_p``) and
``jax.experimental.io_callback`` (``io_callback_p``)
traced inside a ``jax_effects.jit`` function are converted by the
token-threading pass into ``threaded_effect_p`` equations, like
``jax_effects`` effects. Their part of the token calling convention:

* each one joins the chain of :data:`~jax_effects.DEFAULT`
  (:data:`~jax_effects.GLOBAL` in global mode; its effect types are
  registered so with ``_core.effects.register_chain_kind``, where the pass
  asks which chain an effect is on): it takes and returns that
  chain's compiler token and carrier, so it runs in program order with every
  ``jax_effects`` effect of the default stream, inside the computation and
  across dispatches (the runtime token of ``DEFAULT``). That holds for
  ``ordered=True`` (JAX's ``OrderedDebugEffect``/``OrderedIOEffect``) and
  for JAX's default unordered callbacks (``DebugEffect``/``IOEffect``) alike:
  JAX promises no order for the latter, and program order is one, so
  existing code (which mostly calls ``jax.debug.print`` without
  ``ordered=True``) prints in program order by changing only its ``jit``;
* the host side (``_frontends.adopted_host``, registered here with
  :func:`register_host_side`) keeps JAX's contract at jax_effects' cost: the
  user's function receives what JAX's impls give it, ``jax.debug.print``
  prints JAX's text (through ``_output``: held by
  :func:`~jax_effects.deterministic`, seen by ``effects_capture``),
  ``io_callback``'s results are checked as JAX checks them, and an error
  reaches the caller as ``jax.jit`` delivers it (``JaxRuntimeError``, the
  user's exception as its cause), once, where ``design/errors.md`` says;
  where it runs is ours (``_runtime.placement``: once per device inside
  ``shard_map``/``pmap``, once otherwise), so it works on several devices and
  in ``shard_map``, where JAX refuses ordered callbacks;
* after the pass no JAX effect is left, so ``jax.jit``'s C++ fast path
  dispatches the function.

A ``jax.debug.print`` whose operands NumPy will print summarized (under the
print options JAX captured at its call site) passes only their edges to the
host, from every device's part under automatic partitioning
(``_frontends.adopted_host``, ``_primitives.edges``): the text is the same.

Differences from JAX's own lowering: ``io_callback``'s ``sharding=`` (the
device to run on) is ignored, the callback runs where ours run (the first
device of the computation); an ordered ``io_callback`` under ``vmap`` is
still refused by JAX while tracing, before the pass.

Not adopted (left to JAX, which then also keeps its slower dispatch):
``jax.debug.callback(..., partitioned=True)`` (JAX runs it per shard under
automatic partitioning; ours would run once on the whole value), and a
callback inside a higher-order primitive the pass has no rule for.
"""
from __future__ import annotations

from jax_effects import _compat
from jax_effects._core import effects as _effects


def _default_chain(effect, mode: str):
  """DEFAULT (GLOBAL in global mode), whether JAX's effect is ordered or not
  (see the module docstring)."""
  del effect
  return _effects.GLOBAL if mode == "global" else _effects.DEFAULT


# The effects of the callbacks adopted: JAX's ordered ones and its default
# unordered ones alike join DEFAULT's chain.
for _effect_type in (_compat.OrderedDebugEffect, _compat.DebugEffect,
                     _compat.OrderedIOEffect, _compat.IOEffect):
  _effects.register_chain_kind(_effect_type, _default_chain)


# primitive -> ``host_side(params, avals) -> HostCallback`` (``avals``: the
# equation's operands'): the host side of each
# adopted primitive, registered by ``_frontends.adopted_host`` (a front end:
# it formats as ``_frontends.printing`` does; imported by the package).
_host_sides: dict = {}


def register_host_side(primitive, host_side) -> None:
  """Registers ``host_side(params, avals)``, the
  :class:`~jax_effects._primitives.host_callback.HostCallback` that runs an
  adopted ``primitive`` equation (``avals``: its operands')."""
  _host_sides[primitive] = host_side


def adopt(eqn):
  """The :class:`~jax_effects._primitives.host_callback.HostCallback` of an
  adoptable equation (its chain: ``_core.effects.chain_keys`` of its
  effects), or None if the equation stays JAX's.

  A new one per pass run (the pass runs once per trace of the function).
  """
  params = eqn.params
  host_side = _host_sides.get(eqn.primitive)
  if host_side is None or params.get("partitioned"):
    return None
  return host_side(params, tuple(v.aval for v in eqn.invars))


PRIMITIVES = frozenset({_compat.debug_callback_p, _compat.debug_print_p,
                        _compat.io_callback_p})
