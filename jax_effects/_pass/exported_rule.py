"""The pass's rule for ``exp.call`` of an exported ``jax_effects.jit`` function.

An exported jax_effects function (``_dispatch.exporting``) carries JAX's
ordered effect ``EXPORTED_ORDER``; its module takes and returns a compiler
token for it. Inside ``jax_effects.jit`` the pass threads its call
(``call_exported``) on the chain of :data:`~jax_effects.DEFAULT`
(:data:`~jax_effects.GLOBAL` in global mode), as it threads JAX's adopted
callbacks: ``_primitives.exported.call`` takes the chain's compiler token and
carrier and returns new ones that follow every effect of the exported
module, so they run in program order with the caller's effects, and no JAX
effect is left (``jax.jit``'s fast path). A ``call_exported`` of a function
exported without effects of ours is bound unchanged.
"""
from __future__ import annotations

from jax import lax
import jax.numpy as jnp

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import exported as _exported


def _call_exported_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  exported = eqn.params["exported"]
  if _effects.EXPORTED_ORDER not in exported.ordered_effects:
    return _compat.bind_equation(eqn, invals)
  key = _effects.GLOBAL if mode == "global" else _effects.DEFAULT
  token = chains.tokens.get(key)
  if token is None:
    token = lax.create_token()
  carrier = chains.carrier(key)
  shape = jnp.shape(carrier)
  if shape:   # per-device carriers: the call follows every device's effects
    carrier = jnp.max(carrier)
  token, carrier, outs = _exported.call(token, carrier, invals, exported)
  if shape:
    carrier = jnp.broadcast_to(carrier, shape)
  chains.tokens[key] = token
  chains.carriers[key] = carrier
  return outs


if _compat.call_exported_p is not None:   # (else: _compat.EXPORTED_CALLS)
  _token_pass.register_rule(_compat.call_exported_p, _call_exported_rule)
# (its chain, for the registry that answers which chain an effect is on)
_effects.register_chain_kind(
    _effects.ExportedOrder,
    lambda effect, mode: (_effects.GLOBAL if mode == "global"
                          else _effects.DEFAULT))
