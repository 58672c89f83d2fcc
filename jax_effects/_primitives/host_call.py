"""Emitting the host call: the side-effecting custom call of one effect.

Every effect lowers to one custom call with ``has_side_effect = true``
(:func:`emit`; :func:`emit_ordered` for an effect under plain ``jax.jit``,
which also takes and returns JAX's compiler token). What it runs is
described by a :class:`HostSide` (the effect's ``HostCallback`` and what the
lowering decided: placement, carrier, entry), whose :meth:`HostSide.function`
is the host function (``host_functions``). It takes the chain's carrier as
an operand and returns it (the data dependency that orders the calls,
``threaded``). Operands of a call that runs once over several devices are
annotated replicated first (:func:`gathered`).

Which custom call, by platform (``design/host_target.md``):

* CPU: jax_effects' own FFI target (``host_target``), whose attributes name
  the host side (a key, and a spec from which another process rebuilds
  it): the executable holds no Python object, so JAX's persistent
  compilation cache keeps it, ``jax.export`` serializes it, and XLA's CPU
  client dispatches it asynchronously as a plain ``jax.jit`` computation.
  JAX's below where that target is unavailable (``host_target.unavailable()``:
  an FFI API version whose layout jax_effects does not know), and for a call
  that XLA's partitioner must place on one device of several (plain
  ``jax.jit`` over several devices; see :func:`_own_target`).
* GPU (CUDA, ROCm): JAX's FFI Python-callback target
  (``xla_ffi_python_gpu_callback``), the host function bound to the
  executable (``host_callbacks``); jax_effects' target is registered for
  the CPU platform only. The caller may also name another of JAX's targets
  (``target``: ``host_assembly``'s partitioned one, on every platform).
* Others (TPU): ``mlir.emit_python_callback`` (``threaded``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.interpreters import mlir
import numpy as np

from jax_effects import _compat
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._primitives import host_target as _host_target
from jax_effects._runtime import placement as _placement


# Custom-call targets of JAX's Python callbacks (jaxlib registers them).
FFI_TARGETS = {"cpu": "xla_ffi_python_cpu_callback",
                "cuda": "xla_ffi_python_gpu_callback",
                "rocm": "xla_ffi_python_gpu_callback"}
_ffi_lowerings: dict[str, Callable] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class HostSide:
  """The host side of one lowered effect: ``host_callback`` placed at
  ``where`` (``_runtime.placement.at_lowering``), with ``passthrough``
  operands returned as received (the carrier last among them when
  ``threaded``), ``entry`` (the carrier is the chain's runtime token) and
  ``operands`` (the effect's operands after them; None if unknown). Compared
  by identity (a primitive parameter)."""
  host_callback: Any
  where: _placement.Where
  passthrough: int
  threaded: bool
  entry: bool = False
  operands: int | None = None

  def function(self, avals_out) -> Callable:
    """The function XLA calls (``host_functions.host_function``);
    ``avals_out``: of its results, passthrough ones first."""
    return _host_functions.host_function(
        self.host_callback, self.where, passthrough=self.passthrough,
        threaded=self.threaded, avals_out=avals_out, entry=self.entry,
        operands=self.operands)


def _own_target(ctx, target) -> bool:
  """Whether the host call lowered in ``ctx`` goes to jax_effects' target:
  on CPU, unless XLA's partitioner must place it on one device of several
  (automatic partitioning, under plain ``jax.jit``: its Shardy import keeps
  an op's ``MAXIMAL`` annotation only on JAX's own callback targets;
  ``jax_effects.jit`` makes such a call per device in a ``shard_map``
  instead, ``first_device``)."""
  platforms = ctx.module_context.platforms
  axis_context = ctx.module_context.axis_context
  return (target is None and len(platforms) == 1 and platforms[0] == "cpu"
          and not (isinstance(axis_context, _compat.ShardingContext)
                   and axis_context.num_devices > 1)
          and _host_target.unavailable() is None)


def emit(ctx, side, operands, sharding, target=None):
  """Emits the side-effecting custom call of ``side`` (a :class:`HostSide`,
  or a host function for ``target``, another of jaxlib's callback targets:
  ``host_assembly``'s partitioned one); returns the op's results. ``ctx``
  has the operands' and results' avals.

  On CPU, jax_effects' FFI target (module docstring); else what
  ``mlir.emit_python_callback`` emits, minus its per-call wrapper (which
  re-converts and re-checks every result, costing more than the rest of the
  callback) and minus the compiler token (the carrier orders the call).
  """
  if isinstance(side, HostSide) and _own_target(ctx, target):
    return _host_target.emit(ctx, side, operands, sharding)
  if isinstance(side, HostSide):
    side = side.function(ctx.avals_out)
  if target is None:
    target = FFI_TARGETS[ctx.module_context.platforms[0]]
  lower = _ffi_lowerings.get(target)
  if lower is None:
    lower = _ffi_lowerings[target] = jax.ffi.build_ffi_lowering_function(
        target, has_side_effect=True)
  ctx.module_context.add_host_callback(side)
  index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
  op = lower(ctx, *operands, index=index)
  if sharding is not None:
    _compat.set_sharding(ctx.module_context, op, sharding)
  return op.results


def emit_ordered(ctx, side: HostSide, token, operands, avals_in, avals_out,
                 sharding):
  """The host call of an effect under plain ``jax.jit``: ``(results,
  token')``, taking JAX's compiler ``token`` (None: an unordered effect,
  no token) as its first operand and returning it first, as
  ``mlir.emit_python_callback`` does (which it is, off CPU)."""
  sub_ctx = dataclasses.replace(ctx, avals_in=list(avals_in),
                                avals_out=list(avals_out))
  if not _own_target(ctx, None):
    results, token, _ = mlir.emit_python_callback(
        sub_ctx, side.function(avals_out), token, operands, avals_in,
        avals_out, has_side_effect=True, returns_token=token is not None,
        sharding=sharding)
    return results, token
  if token is None:
    return _host_target.emit(sub_ctx, side, operands, sharding), None
  token_aval = _compat.abstract_token
  sub_ctx = dataclasses.replace(ctx, avals_in=[token_aval, *avals_in],
                                avals_out=[token_aval, *avals_out])
  token, *results = _host_target.emit(
      sub_ctx, side, [token, *operands],
      _compat.with_token_sharding(sharding, bool(avals_out)))
  return results, token


def gathered(ctx, args, avals) -> list:
  """The array operands of a callback that runs once, annotated replicated
  under automatic partitioning over several devices: the same data movement
  as a sharded operand going straight to the one device, as an all-gather,
  without XLA's "involuntary full rematerialization" warning."""
  axis_context = ctx.module_context.axis_context
  if (not isinstance(axis_context, _compat.ShardingContext)
      or axis_context.num_devices <= 1):
    return list(args)
  return [_compat.replicated(ctx, x, aval) if aval.shape else x
          for x, aval in zip(args, avals)]
