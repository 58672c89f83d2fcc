"""Token-threading rule for ``shard_map`` (and so ``pmap``): per-device effects.

Inside a fully manual ``shard_map`` every side effect runs once per device
(see ``_runtime.placement``). The rule re-expresses the ``shard_map`` equation with
the carriers of the chains used inside as extra operands and results::

    carrier_vecs, outs = shard_map(body', in_specs=(P() or P(axes), ...,
                                                    *in_specs),
                                   out_specs=(P(axes), ..., *out_specs))(
                                       carriers, *args)

* A scalar carrier enters replicated (``P()``): every device's first effect
  depends on the chain's previous effect (the runtime token, or the last
  effect before the ``shard_map``; after an effect that ran once, only the
  first device's copy is current and it is broadcast from there,
  ``first_device.from_first_device_p``). Inside, it is cast to *varying* over the
  manual axes (under ``check_vma``), which is what it is: each device threads
  its own chain.
* Each device's final carrier leaves as its element of a ``(n_devices,)``
  vector (``P(axes)``), which stays the chain's carrier: a later ``shard_map``
  over the same mesh takes it back per device (``P(axes)``), and at the end
  it becomes the executable's token, one element per device. No collective is
  added: XLA's CPU runtime deadlocks when several executions with collectives
  are in flight (several threads, or async dispatch), so a program that had
  none must not get one from us. The dispatch hook combines the elements into
  the next runtime token outside the program
  (``_runtime.device_tokens.combine``), so the next computation's effects
  follow every device's effects, and each device keeps program order across
  calls.
* Where a scalar carrier is needed (an effect after the ``shard_map`` that
  runs once, on one device, or the carry of a loop or branch), the vector is
  reduced with ``max``: there the order across devices needs that collective.

``jax.pmap`` is staged by JAX as ``jit(shard_map)`` over the mapped axis
(always on 0.10; on 0.8 and 0.9 by default, see ``_compat.FEATURES``), so it
is covered by the same rule.
"""
from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import first_device as _first_device


def _to_varying(x, axes: tuple):
  """Casts ``x`` to varying over ``axes`` (where it is not already)."""
  varying = _compat.varying_axes(jax.typeof(x))
  missing = tuple(a for a in axes if a not in varying)
  return lax.pcast(x, missing, to="varying") if missing else x


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
  n = 1
  for a in axes:
    n *= mesh.shape[a]
  check_vma = p["check_vma"]
  keys = _effects.chain_keys(eqn.effects, mode)
  body_fn = _token_pass.region(p["jaxpr"], keys, mode)

  # A chain's runtime token (or a chain starting here) is the same on every
  # device; after an effect that ran once (on the first device of several,
  # first_device.on_first_device) only device 0's copy is current.
  after_once = [k in chains.carriers and not chains.still_entered(k)
                for k in keys]
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
      carriers = [_to_varying(c, axes) for c in carriers]
    carriers, outs = body_fn(carriers, *args)
    if check_vma:
      carriers = [_to_varying(c, axes) for c in carriers]
    return tuple(c.reshape((1,)) for c in carriers), list(outs)

  if _explicit(mesh, axes):
    # A per-device token the next call passes back arrives typed replicated
    # (jax.jit's type of the returned vector); over explicit axes shard_map
    # checks in_specs against the type: split it (a local slice).
    split = jax.sharding.NamedSharding(mesh, P(axes))
    carriers_in = [jax.sharding.reshard(c, split)
                   if c.shape and jax.typeof(c).sharding.spec != P(axes)
                   else c for c in carriers_in]
  carrier_in = tuple(P(axes) if c.shape else P() for c in carriers_in)
  carrier_out = tuple(P(axes) for _ in keys)
  mapped = _jax_api.shard_map(
      body, mesh=mesh, in_specs=(carrier_in, *p["in_specs"]),
      out_specs=(carrier_out, list(p["out_specs"])),
      axis_names=set(manual), check_vma=check_vma)
  carrier_vecs, outs = mapped(tuple(carriers_in), *invals)
  # In a loop or branch the carrier keeps the shape it came in with (the
  # carry's type); at the top level it stays per device.
  at_top = _token_pass.region_kind() == "top"
  for key, c_in, vec in zip(keys, carriers_in, carrier_vecs):
    keep = at_top or c_in.shape == vec.shape
    chains.carriers[key] = vec if keep else jnp.max(vec)
  return outs


_token_pass.register_rule(_compat.shard_map_p, _shard_map_rule)
