"""Emitting the host call: the Python-callback custom call of one effect.

Every effect lowers to one ``xla_ffi_python_*_callback`` custom call with
``has_side_effect = true`` (:func:`emit`), whose host function is built by
``host``; it takes the chain's carrier as an operand and returns it (the
data dependency that orders the calls, ``threaded``). Operands of a call
that runs once over several devices are annotated replicated first
(:func:`gathered`).
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jax_effects import _compat


# Custom-call targets of JAX's Python callbacks (jaxlib registers them).
FFI_TARGETS = {"cpu": "xla_ffi_python_cpu_callback",
                "cuda": "xla_ffi_python_gpu_callback",
                "rocm": "xla_ffi_python_gpu_callback"}
_ffi_lowerings: dict[str, Callable] = {}


def emit(ctx, host, operands, sharding, target=None):
  """Emits the side-effecting Python-callback custom call for ``host``.

  What ``mlir.emit_python_callback`` emits (same target, ``index`` attribute,
  sharding annotation), minus its per-call wrapper, which re-converts and
  re-checks every result and costs more than the rest of the callback, and
  minus the compiler token: the carrier operand orders the call after the
  chain's previous effect (see ``_threaded_lowering``). ``ctx`` has the
  operands' and results' avals. Returns the op's results. ``target``: another
  of jaxlib's callback targets (``host_assembly``'s partitioned one).
  """
  if target is None:
    target = FFI_TARGETS[ctx.module_context.platforms[0]]
  lower = _ffi_lowerings.get(target)
  if lower is None:
    lower = _ffi_lowerings[target] = jax.ffi.build_ffi_lowering_function(
        target, has_side_effect=True)
  ctx.module_context.add_host_callback(host)
  index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
  op = lower(ctx, *operands, index=index)
  if sharding is not None:
    _compat.set_sharding(ctx.module_context, op, sharding)
  return op.results


def gathered(ctx, args, avals) -> list:
  """The array operands of a callback that runs once, annotated replicated.

  Under automatic partitioning over several devices the callback runs on
  one device (MAXIMAL sharding). A sharded operand going straight there is
  what XLA's partitioner calls an "involuntary full rematerialization" (and
  warns about on stderr); through a replicated annotation it becomes an
  all-gather, the same data movement, without the warning. Per-device
  callbacks (manual ``shard_map``) and single-device programs are left as
  they are.
  """
  axis_context = ctx.module_context.axis_context
  if (not isinstance(axis_context, _compat.ShardingContext)
      or axis_context.num_devices <= 1):
    return list(args)
  return [_compat.replicated(ctx, x, aval) if aval.shape else x
          for x, aval in zip(args, avals)]
