"""``threaded_effect_p``: an effect after the token-threading pass.

Part in the token calling convention (``design/tokens.md``)::

    token', carrier', results = threaded_effect_p(token, carrier, *args;
                                                  host_callback, entry,
                                                  ordered)

``token`` is the chain's compiler token; ``carrier`` (``int32``: the
dispatching thread's slot and the ``FAILED`` bit) stands for the chain
where a token cannot go, and is what the host call takes and returns.
``entry``: the carrier is the chain's runtime token; ``ordered``: it comes
from one. No JAX-level effect (``jax.jit``'s C++ fast path stays in use);
no eager rule outside :func:`already_ran`.

An effect that runs once in a computation over several devices
(``design/placement.md``): the carrier must stay a replicated value that
no device waits for, so the host call is made inside a ``shard_map`` by
the first device's branch of a ``cond`` (:func:`on_first_device`), and
where per-device effects follow, the carrier is taken from the first
device (:data:`from_first_device_p`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
from jax.interpreters import mlir
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects import _jax_api
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import host_assembly as _host_assembly
from jax_effects._primitives import host_target as _host_target
from jax_effects._runtime import placement as _placement

threaded_effect_p = jcore.Primitive("jax_effects_threaded_effect")
threaded_effect_p.multiple_results = True


def _threaded_abstract_eval(token, carrier, *avals, host_callback, entry,
                            ordered):
  del avals, entry, ordered
  return [token, carrier, *host_callback.result_avals]


threaded_effect_p.def_abstract_eval(_threaded_abstract_eval)

_replaying = threading.local()


@contextlib.contextmanager
def already_ran():
  """A context in which threaded effects evaluate eagerly without running."""
  previous = getattr(_replaying, "on", False)
  _replaying.on = True
  try:
    yield
  finally:
    _replaying.on = previous


def _threaded_impl(token, carrier, *args, host_callback, entry,
                   ordered=True):
  del args, entry, ordered
  if not getattr(_replaying, "on", False):
    raise NotImplementedError(
        f"jax_effects: the threaded effect of {host_callback} runs only "
        f"inside the computation jax_effects.jit threads it into; it was "
        f"evaluated outside one (eagerly: jax.core.eval_jaxpr of "
        f"jax_effects.jit(f).trace(...).jaxpr, the token-threaded jaxpr). "
        f"Evaluate that jaxpr under jax.jit, its runtime-token inputs (the "
        f"first int32 ones) given, or take jax.make_jaxpr(f)(...), the "
        f"jaxpr without tokens, which evaluates eagerly")
  return [token, carrier, *(jnp.zeros(a.shape, a.dtype)
                            for a in host_callback.result_avals)]


threaded_effect_p.def_impl(_threaded_impl)


def _threaded_lowering(ctx, token, carrier, *args, host_callback, entry,
                       ordered):
  """Lowers one threaded effect to ``carrier', results = host(carrier,
  *args)``, the token passed through (as an operand of every call it would
  cost about 3% of a dispatch), by the first device (:func:`on_first_device`) or
  every device (``host_assembly``) where it runs once over several."""
  edges = _edges.of_operands(host_callback, len(args))
  if _host_target.once_across_devices(ctx) and _host_assembly.applies(
      ctx, host_callback, ctx.avals_in[2:], edges, ordered):
    return [token, *_host_assembly.lower(ctx, host_callback, entry, carrier,
                                         args, edges)]
  if any(edges):
    avals_in, args = _edges.cut(ctx, args, edges, first=2)
    ctx = dataclasses.replace(ctx, avals_in=avals_in)   # (sets no tokens)
  platforms = ctx.module_context.platforms
  sharding = _compat.callback_op_sharding(
      ctx.module_context.axis_context, None, ctx.avals_out[1:])
  args = _host_target.gathered(ctx, args, ctx.avals_in[2:])
  # (may add the partition id as an operand)
  where, operands, avals_in = _placement.at_lowering(
      ctx, [carrier, *args], list(ctx.avals_in[1:]))
  side = _host_target.HostSide(host_callback, where, passthrough=1,
                             threaded=True, entry=entry, operands=len(args))
  sub_ctx = dataclasses.replace(ctx, avals_in=avals_in, avals_out=ctx.avals_out[1:])
  if len(platforms) == 1 and platforms[0] in _host_target.FFI_TARGETS:
    if _host_target.once_across_devices(ctx):
      return [token, *on_first_device(sub_ctx, side, operands)]
    return [token, *_host_target.emit(sub_ctx, side, operands, sharding)]
  # Other platforms (TPU): through emit_python_callback, which adds the token.
  results, token, _ = mlir.emit_python_callback(
      sub_ctx, side.function(sub_ctx.avals_out), token,
      operands, sub_ctx.avals_in, sub_ctx.avals_out,
      has_side_effect=True, returns_token=True, sharding=sharding)
  return [token, *results]


mlir.register_lowering(threaded_effect_p, _threaded_lowering, cacheable=False)
# (the lowering reads the device assignment: which device runs each call)
_compat.require_devices_during_lowering(threaded_effect_p)


# --- an effect that runs once over several devices ---------------------------

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
first_device_call_p = jcore.Primitive("jax_effects_first_device_call")
first_device_call_p.multiple_results = True
# (The carrier keeps its operand's type and the results are strong-typed, as
# the pass-through branch's are: cond requires equal types.)
first_device_call_p.def_abstract_eval(
    lambda carrier, *avals, side, avals_out: [
        carrier, *(a.update(weak_type=False) for a in avals_out[1:])])


def _first_device_call_lowering(ctx, *operands, side, avals_out):
  sharding = _compat.callback_op_sharding(
      ctx.module_context.axis_context, None, avals_out)
  return _host_target.emit(ctx, side, operands, sharding)


mlir.register_lowering(first_device_call_p, _first_device_call_lowering,
                       cacheable=False)


# Identity on a carrier entering a shard_map (``_pass.control_flow_rules``):
# after on_first_device only device 0's copy is current, so it is broadcast.
from_first_device_p = jcore.Primitive("jax_effects_from_first_device")
from_first_device_p.def_abstract_eval(lambda aval: aval)
from_first_device_p.def_impl(lambda x: x)


def _from_first_device_lowering(ctx, x):
  if _host_target.once_across_devices(ctx):
    return [_compat.on_first_device(ctx, x, ctx.avals_in[0])]
  return [x]


mlir.register_lowering(from_first_device_p, _from_first_device_lowering)
