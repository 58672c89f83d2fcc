"""``threaded_effect_p``: an effect after the token-threading pass.

The token-threading pass replaces each effect with::

    token', carrier', results = threaded_effect_p(token, carrier, *args;
                                                  host_callback, entry,
                                                  ordered)

Part in the token calling convention: ``token`` is a *compiler token*
(``!stablehlo.token``) linking consecutive effects of one chain in the
program; ``carrier`` is an ``int32`` scalar standing for the same chain
where a token cannot go (across ``cond``/``while``/``scan`` boundaries, out
to the runtime token). The host call takes the carrier as an operand and
returns it, the data dependency that orders the lowered calls (on CPU and
GPU the call does not take the token, :func:`_threaded_lowering`). Its value
is the dispatching thread's slot and the ``FAILED`` bit
(``design/errors.md``). ``entry``: the carrier is the chain's runtime token
and the effect runs once per execution, so a ``FAILED`` bit there is an
earlier execution's, cleared by the host; ``ordered``: the carrier comes
from a runtime token (an unordered chain's starts at 0 in every execution).
The primitive has *no* JAX-level effect: after the pass ``jax.jit``'s C++
fast path stays in use.

Where the effect runs once over several devices under automatic
partitioning, its call is made inside a ``shard_map`` by the first device
only (``first_device``: the carrier stays replicated). An operand
``print``/``log`` will show summarized is cut to its edges first
(``edges``), or every device passes its part to the host
(``host_assembly``).

It has no eager rule: it is evaluated outside a threaded computation only
in JAX's de-optimized re-run of one that produced a NaN or Inf
(``jax_debug_nans``/``jax_debug_infs``, ``_dispatch.tracing.replay``),
inside :func:`already_ran`, where it returns its token and carrier
unchanged and zeros for its results.
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
  """A context in which threaded effects are evaluated eagerly without
  running (their computation ran them already)."""
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
  """Lowers one threaded effect to a host callback ``carrier', results =
  host(carrier, *args)``.

  The custom call does not take the compiler token: the carrier orders it
  after the chain's previous effect as the token would, and the token
  costs an operand and a result of every call (about 3% of a dispatch).
  The token operand is returned as the token result; XLA removes the
  unused ``create_token``. (Off CPU and GPU, ``emit_python_callback`` takes
  the token itself.) Operands with ``edges.Edges`` are cut to their edges
  first, or passed in parts by the devices where ``host_assembly`` applies.
  """
  edges = _edges.of_operands(host_callback, len(args))
  if (any(edges) or _host_assembly.WHOLE_ON_HOST) and (
      _first_device.once_across_devices(ctx)) and _host_assembly.applies(
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
  # Where it runs (device, shard): may add the partition id as an operand.
  where, operands, avals_in = _placement.at_lowering(
      ctx, [carrier, *args], list(ctx.avals_in[1:]))
  side = _host_call.HostSide(host_callback, where, passthrough=1,
                             threaded=True, entry=entry, operands=len(args))
  sub_ctx = dataclasses.replace(ctx, avals_in=avals_in,
                                avals_out=ctx.avals_out[1:])
  if len(platforms) == 1 and platforms[0] in _host_call.FFI_TARGETS:
    if _first_device.once_across_devices(ctx):
      return [token, *_first_device.on_first_device(sub_ctx, side, operands)]
    return [token, *_host_call.emit(sub_ctx, side, operands, sharding)]
  # Other platforms (TPU): through emit_python_callback, which adds the token.
  results, token, _ = mlir.emit_python_callback(
      sub_ctx, side.function(sub_ctx.avals_out), token,
      operands, sub_ctx.avals_in, sub_ctx.avals_out,
      has_side_effect=True, returns_token=True, sharding=sharding)
  return [token, *results]


mlir.register_lowering(threaded_effect_p, _threaded_lowering, cacheable=False)
# The lowering reads the device assignment: which device runs each callback
# (device_id of log records, see _placement).
_compat.require_devices_during_lowering(threaded_effect_p)
