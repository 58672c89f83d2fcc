"""Token-threading rule for ``shard_map`` (and so ``pmap``): per-device effects.

Its part of the token calling convention (``design/placement.md``, "Tokens
across devices"): the carriers of the chains used inside become extra
operands and results::

    carrier_vecs, outs = shard_map(body', in_specs=(P() or P(axes), ...,
                                                    *in_specs),
                                   out_specs=(P(axes), ..., *out_specs))(
                                       carriers, *args)

A scalar carrier enters replicated and is cast to varying inside; each
device's final carrier leaves as its element of a ``(n_devices,)`` vector,
which stays the chain's carrier (reduced with ``max`` where a scalar is
needed). No collective is added. ``jax.pmap`` is staged as
``jit(shard_map)``, so the rule covers it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import first_device as _first_device


def _explicit(mesh, axes) -> bool:
  """Whether any of ``axes`` of ``mesh`` is an Explicit axis."""
  types = getattr(mesh, "axis_types", ())
  return any(t == jax.sharding.AxisType.Explicit
             for name, t in zip(mesh.axis_names, types) if name in axes)


def _shard_map_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  p = eqn.params
  mesh = p["mesh"]
  manual = _compat.shard_map_manual_axes(p)
  axes = tuple(a for a in mesh.axis_names if a in manual)
  n = math.prod(mesh.shape[a] for a in axes)
  check_vma = p["check_vma"]
  keys = _effects.chain_keys(eqn.effects, mode)
  body_fn = _token_pass.region(p["jaxpr"], keys, mode)

  # After an effect that ran once only device 0's copy is current.
  after_once = [k in chains.carriers and not chains.still_entered(k) for k in keys]
  carriers_in = []
  for c, once in zip(chains.take(keys), after_once):
    if c.shape not in ((), (n,)):   # per-device vector of another mesh
      c = jnp.max(c)
    elif once and not c.shape:
      c = _first_device.from_first_device_p.bind(c)
    carriers_in.append(c)

  def body(carriers, *args):
    carriers = [c.reshape(()) for c in carriers]
    if check_vma:
      carriers = [_compat.to_varying(c, axes) for c in carriers]
    carriers, outs = body_fn(carriers, *args)
    if check_vma:
      carriers = [_compat.to_varying(c, axes) for c in carriers]
    return tuple(c.reshape((1,)) for c in carriers), list(outs)

  if _explicit(mesh, axes):
    # A per-device token passed back arrives typed replicated: split it.
    split = jax.sharding.NamedSharding(mesh, P(axes))
    carriers_in = [jax.sharding.reshard(c, split)
                   if c.shape and jax.typeof(c).sharding.spec != P(axes)
                   else c for c in carriers_in]
  carrier_in = tuple(P(axes) if c.shape else P() for c in carriers_in)
  carrier_out = tuple(P(axes) for _ in keys)
  carrier_vecs, outs = _jax_api.shard_map(
      body, mesh=mesh, in_specs=(carrier_in, *p["in_specs"]),
      out_specs=(carrier_out, list(p["out_specs"])),
      axis_names=set(manual), check_vma=check_vma)(tuple(carriers_in), *invals)
  # In a loop or branch the carrier keeps the shape it came in with (the
  # carry's type); at the top level it stays per device.
  at_top = _token_pass.region_kind() == "top"
  for key, c_in, vec in zip(keys, carriers_in, carrier_vecs):
    keep = at_top or c_in.shape == vec.shape
    chains.carriers[key] = vec if keep else jnp.max(vec)
  return outs


_token_pass.register_rule(_compat.shard_map_p, _shard_map_rule)
