"""An effect that runs once in a computation over several devices.

Its part of the token calling convention (``design/placement.md``): the
carrier must stay a replicated value that no device waits for, so the host
call is made inside a ``shard_map`` by the first device's branch of a
``cond`` (:func:`on_first_device`), and where per-device effects follow,
the carrier is taken from the first device (:data:`from_first_device_p`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._primitives import host_call as _host_call


def on_first_device(ctx, side, operands) -> list:
  """The host call of an effect that runs once over several devices, made
  by device 0 in a ``shard_map`` (``design/placement.md``): its carrier is
  the chain's, its results the call's."""
  avals_out = tuple(ctx.avals_out)
  mesh, names = _all_devices_mesh(ctx.module_context.axis_context.num_devices)

  # An operand with no elements is made where the host call is (XLA 0.11.2
  # crashes compiling a shard_map with a zero-size operand).
  avals_in = tuple(ctx.avals_in)
  empty = [_is_empty(a) for a in avals_in]
  kept = [i for i, e in enumerate(empty) if not e]

  def call(*passed):
    passed = iter(passed)
    ops = [jnp.zeros(a.shape, a.dtype) if e else next(passed)
           for a, e in zip(avals_in, empty)]
    return tuple(first_device_call_p.bind(*ops, side=side, avals_out=avals_out))

  def pass_through(carrier, *ops):
    return (carrier, *(jnp.zeros(a.shape, a.dtype) for a in avals_out[1:]))

  def per_device(*ops):
    return jax.lax.cond(jax.lax.axis_index(names) == 0, call, pass_through, *ops)

  mapped = _jax_api.shard_map(per_device, mesh=mesh,
                              in_specs=(P(),) * len(kept),
                              out_specs=(P(),) * len(avals_out),
                              check_vma=False)
  # (under an explicit mesh, shard_map's in_specs require replicated types)
  ctx = dataclasses.replace(ctx, avals_in=[_unsharded(avals_in[i]) for i in kept])
  carrier, *results = mlir.lower_fun(mapped, multiple_results=True)(
      ctx, *(operands[i] for i in kept))
  return [carrier, *(_compat.on_first_device(ctx, r, a)
                     for r, a in zip(results, avals_out[1:]))]


def _is_empty(aval) -> bool:
  """Whether ``aval`` is an array of a NumPy dtype with no elements."""
  return (0 in getattr(aval, "shape", ()) and
          not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended))


def _unsharded(aval):
  """``aval`` with a replicated sharding in its type (explicit sharding)."""
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", ())
  if any(s is not None for s in spec):
    return aval.update(sharding=jax.sharding.NamedSharding(sharding.mesh, P()))
  return aval


def _all_devices_mesh(num_devices: int):
  """``(mesh, axis_names)`` over ``num_devices``: the ambient mesh if one of
  that size is set (``jax.shard_map`` requires it), else our own."""
  context = jax.sharding.get_abstract_mesh()
  if (context is not None and not context.empty
      and context.size == num_devices):
    return context, tuple(context.axis_names)
  names = ("jax_effects_devices",)
  return jax.sharding.AbstractMesh((num_devices,), names), names


# The host call inside on_first_device's shard_map.
first_device_call_p = Primitive("jax_effects_first_device_call")
first_device_call_p.multiple_results = True
# (The carrier keeps its operand's type and the results are strong-typed, as
# the pass-through branch's are: cond requires equal types.)
first_device_call_p.def_abstract_eval(
    lambda carrier, *avals, side, avals_out: [
        carrier, *(a.update(weak_type=False) for a in avals_out[1:])])


def _first_device_call_lowering(ctx, *operands, side, avals_out):
  sharding = _compat.callback_op_sharding(
      ctx.module_context.axis_context, None, avals_out)
  return _host_call.emit(ctx, side, operands, sharding)


mlir.register_lowering(first_device_call_p, _first_device_call_lowering,
                       cacheable=False)


# Identity on a carrier entering a shard_map (``_pass.control_flow_rules``):
# after on_first_device only device 0's copy is current, so it is broadcast.
from_first_device_p = Primitive("jax_effects_from_first_device")
from_first_device_p.def_abstract_eval(lambda aval: aval)
from_first_device_p.def_impl(lambda x: x)


def _from_first_device_lowering(ctx, x):
  if _host_call.once_across_devices(ctx):
    return [_compat.on_first_device(ctx, x, ctx.avals_in[0])]
  return [x]


mlir.register_lowering(from_first_device_p, _from_first_device_lowering)
