"""The pass's rule for ``exp.call`` of an exported ``jax_effects.jit`` function.

Its part of the token calling convention (``design/tokens.md``, "An
exported function"): an exported jax_effects function (``_dispatch.function``)
carries JAX's ordered effect ``EXPORTED_ORDER``; inside ``jax_effects.jit``
its call is threaded on the chain of :data:`~jax_effects.DEFAULT`
(:data:`~jax_effects.GLOBAL` in global mode), as JAX's adopted callbacks
are, and no JAX effect is left. A ``call_exported`` of a function exported
without effects of ours is bound unchanged.
"""
from __future__ import annotations

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._pass import adopted as _adopted
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import exported as _exported


def _call_exported_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  exported = eqn.params["exported"]
  if _effects.EXPORTED_ORDER not in exported.ordered_effects:
    return _compat.bind_equation(eqn, invals)
  return _token_pass.bind_on_chain(
      chains, _adopted.default_chain(None, mode),
      lambda token, carrier: _exported.call(token, carrier, invals, exported),
      from_first=False)


if _compat.call_exported_p is not None:   # (else: _compat.EXPORTED_CALLS)
  _token_pass.register_rule(_compat.call_exported_p, _call_exported_rule)
# (its chain, for the registry that answers which chain an effect is on)
_effects.register_chain_kind(_effects.ExportedOrder, _adopted.default_chain)
