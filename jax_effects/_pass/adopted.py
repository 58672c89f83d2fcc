"""JAX's own host callbacks inside ``jax_effects.jit``: adopted by the pass.

``jax.debug.print``/``log`` (``debug_print_p``), ``jax.debug.callback``
(``debug_callback_p``) and ``io_callback`` (``io_callback_p``) traced inside
a ``jax_effects.jit`` function become ``threaded_effect_p`` equations. Their
part of the token calling convention: ordered or not, each joins the chain
of :data:`~jax_effects.DEFAULT` (:data:`~jax_effects.GLOBAL` in global
mode; their effect types are registered so here), so it runs in program
order with jax_effects' effects, inside the computation and across
dispatches, and no JAX effect is left. Their host side is a front end's
(``_frontends.adopted_host``, :func:`register_host_side`), which keeps
JAX's contract. Unlike JAX's lowering, ``io_callback``'s ``sharding=`` is
ignored (it runs where ours run); an ordered ``io_callback`` under ``vmap``
is still refused by JAX. Left to JAX: ``jax.debug.callback(partitioned=True)``
and a callback inside a higher-order primitive without a rule. The
narrative: ``design/architecture.md`` (``_pass/adopted``).
"""
from __future__ import annotations

from jax_effects import _compat
from jax_effects._core import effects as _effects


def default_chain(effect, mode: str):
  """DEFAULT (GLOBAL in global mode), whatever the effect."""
  del effect
  return _effects.GLOBAL if mode == "global" else _effects.DEFAULT


for _effect_type in (_compat.OrderedDebugEffect, _compat.DebugEffect,
                     _compat.OrderedIOEffect, _compat.IOEffect):
  _effects.register_chain_kind(_effect_type, default_chain)


# primitive -> ``host_side(params, avals, source_info) -> HostCallback``,
# registered by ``_frontends.adopted_host``.
_host_sides: dict = {}


def register_host_side(primitive, host_side) -> None:
  """Registers ``host_side(params, avals, source_info)``, the
  :class:`~jax_effects._primitives.host_callback.HostCallback` that runs an
  adopted ``primitive`` equation (``avals``: its operands'; ``source_info``:
  the equation's, which names the user's line)."""
  _host_sides[primitive] = host_side


def adopt(eqn):
  """The ``HostCallback`` of an adoptable equation, or None if it stays
  JAX's (a new one per pass run)."""
  params = eqn.params
  host_side = _host_sides.get(eqn.primitive)
  if host_side is None or params.get("partitioned"):
    return None
  return host_side(params, tuple(v.aval for v in eqn.invars), eqn.source_info)


PRIMITIVES = frozenset({_compat.debug_callback_p, _compat.debug_print_p,
                        _compat.io_callback_p})
