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
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

from jax.extend.core import Primitive
from jax.interpreters import mlir
import jax.numpy as jnp

from jax_effects import _compat
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import first_device as _first_device
from jax_effects._primitives import host_assembly as _host_assembly
from jax_effects._primitives import host_call as _host_call
from jax_effects._runtime import placement as _placement

threaded_effect_p = Primitive("jax_effects_threaded_effect")
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
  cost about 3% of a dispatch), by the first device (``first_device``) or
  every device (``host_assembly``) where it runs once over several."""
  edges = _edges.of_operands(host_callback, len(args))
  if (any(edges) or _host_assembly.WHOLE_ON_HOST) and (
      _host_call.once_across_devices(ctx)) and _host_assembly.applies(
          ctx, host_callback, ctx.avals_in[2:], edges, ordered):
    return [token, *_host_assembly.lower(ctx, host_callback, entry, carrier,
                                         args, edges)]
  if any(edges):
    avals_in, args = _edges.cut(ctx, args, edges, first=2)
    ctx = dataclasses.replace(ctx, avals_in=avals_in)   # (sets no tokens)
  platforms = ctx.module_context.platforms
  sharding = _compat.callback_op_sharding(
      ctx.module_context.axis_context, None, ctx.avals_out[1:])
  args = _host_call.gathered(ctx, args, ctx.avals_in[2:])
  # (may add the partition id as an operand)
  where, operands, avals_in = _placement.at_lowering(
      ctx, [carrier, *args], list(ctx.avals_in[1:]))
  side = _host_call.HostSide(host_callback, where, passthrough=1,
                             threaded=True, entry=entry, operands=len(args))
  sub_ctx = dataclasses.replace(ctx, avals_in=avals_in, avals_out=ctx.avals_out[1:])
  if len(platforms) == 1 and platforms[0] in _host_call.FFI_TARGETS:
    if _host_call.once_across_devices(ctx):
      return [token, *_first_device.on_first_device(sub_ctx, side, operands)]
    return [token, *_host_call.emit(sub_ctx, side, operands, sharding)]
  # Other platforms (TPU): through emit_python_callback, which adds the token.
  results, token, _ = mlir.emit_python_callback(
      sub_ctx, side.function(sub_ctx.avals_out), token,
      operands, sub_ctx.avals_in, sub_ctx.avals_out,
      has_side_effect=True, returns_token=True, sharding=sharding)
  return [token, *results]


mlir.register_lowering(threaded_effect_p, _threaded_lowering, cacheable=False)
# (the lowering reads the device assignment: which device runs each call)
_compat.require_devices_during_lowering(threaded_effect_p)
