"""JAX's host-callback calling convention, as JAX's impls keep it.

For ``adopted_host``: operands as JAX's impls give them, arguments rebuilt
from JAX's flat callback, results checked as ``emit_python_callback`` checks
them, errors as ``jax.jit`` raises them (``design/errors.md``).

Part in the token calling convention: none (it runs inside a host function;
``_primitives.host_functions`` handles the carrier).
"""
from __future__ import annotations

import functools
import traceback
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import tree_util

from jax_effects import _compat

# --- errors as jax.jit delivers them -----------------------------------------

#: XLA's status prefix for a failed Python callback (jaxlib 0.8-0.10).
JAX_ERROR_PREFIX = "INTERNAL: CpuCallback error calling callback: "


def jax_error(exc: Exception) -> jax.errors.JaxRuntimeError:
  """The error ``jax.jit`` raises when a host callback raised ``exc`` (its
  ``__cause__``); built where ``exc`` is caught, while its frames are live.
  Its text: ``exc`` as jaxlib puts it in the status message (nanobind's
  ``python_error::what()``)."""
  parts = []
  tb = exc.__traceback__
  if tb is not None:
    while tb.tb_next is not None:
      tb = tb.tb_next
    parts.append("Traceback (most recent call last):\n")
    for frame, lineno in reversed(list(traceback.walk_stack(tb.tb_frame))):
      code = frame.f_code
      parts.append(f'  File "{code.co_filename}", line {lineno}, '
                   f"in {code.co_name}\n")
  parts.append(f"{type(exc).__name__}: ")
  try:
    parts.append(str(exc))
  except Exception:  # noqa: BLE001 - as jaxlib does
    parts.append("<exception str() failed>")
  err = jax.errors.JaxRuntimeError(JAX_ERROR_PREFIX + "".join(parts))
  err.__cause__ = exc
  return err


# --- arguments as JAX's impls give them --------------------------------------

@functools.cache
def cpu():
  """``(device, sharding)``: the first local CPU device (where JAX's impls
  put the operands) and its ``SingleDeviceSharding``."""
  try:
    device = jax.local_devices(backend="cpu")[0]
  except RuntimeError as e:
    raise RuntimeError(
        "jax.debug.callback failed to find a local CPU device to place the"
        " inputs on. Make sure \"cpu\" is listed in --jax_platforms or the"
        " JAX_PLATFORMS environment variable.") from e
  return device, jax.sharding.SingleDeviceSharding(device)


def avals() -> Callable[[np.ndarray], Any]:
  """``aval_of(x)``: the aval ``jax.device_put`` gives NumPy array ``x``,
  cached by shape and dtype."""
  avals: dict = {}
  shaped = jax.core.ShapedArray

  def aval_of(x):
    key = (x.shape, x.dtype)
    aval = avals.get(key)
    if aval is None:
      aval = avals[key] = shaped(x.shape, x.dtype)
    return aval
  return aval_of


def putter() -> Callable[[tuple, Any, Any], Sequence]:
  """``put_all(operands, device, sharding)``: NumPy ``operands`` as the
  ``jax.Array`` s ``jax.device_put(x, device)`` returns (marked explicit
  only under a transfer guard: the mark costs a tenth of the put)."""
  aval_of = avals()
  put = _compat.batched_device_put
  guarded = _compat.host_transfers_guarded

  def put_all(operands, device, sharding):
    devices = [device]
    if guarded():
      return explicit_puts(put, aval_of, sharding, devices, operands)
    if len(operands) == 1:   # (no comprehension's frame)
      x = operands[0]
      return (put(aval_of(x), sharding, [x], devices, True),)
    return [put(aval_of(x), sharding, [x], devices, True) for x in operands]
  return put_all


def explicit_puts(put, aval_of, sharding, devices, operands) -> list:
  """``operands`` on ``devices`` as explicit transfers, as
  ``jax.device_put``'s are for ``jax.transfer_guard``."""
  state = _compat.transfer_guard_state()
  previous = state.explicit_device_put
  state.explicit_device_put = True
  try:
    return [put(aval_of(x), sharding, [x], devices, True) for x in operands]
  finally:
    state.explicit_device_put = previous


class Slot:
  """Stands for flat argument ``i`` while the argument structure is read."""
  __slots__ = ("i",)

  def __init__(self, i):
    self.i = i


def slots(in_tree) -> tuple:
  """``(args, kwargs)`` of ``in_tree`` with each flat argument ``i`` a
  ``Slot(i)``."""
  return tree_util.tree_unflatten(
      in_tree, [Slot(i) for i in range(in_tree.num_leaves)])


def rebuilder(in_tree, static_args) -> Callable[[list], tuple]:
  """``rebuild(dynamic_values) -> (args, kwargs)`` as JAX's
  ``merge_callback_args`` does, without a pytree unflatten when every
  argument is itself a leaf."""
  static = dict(static_args)
  n = in_tree.num_leaves
  args, kwargs = slots(in_tree)
  dynamic = [i for i in range(n) if i not in static]
  where = {leaf: pos for pos, leaf in enumerate(dynamic)}

  def leaf(node):   # ("d", k): dynamic value k; ("s", v): static v
    i = node.i
    return ("d", where[i]) if i in where else ("s", static[i])

  if all(type(a) is Slot for a in args) and all(
      type(v) is Slot for v in kwargs.values()):
    arg_parts = [leaf(a) for a in args]
    kw_parts = [(k, leaf(v)) for k, v in kwargs.items()]

    def flat(values):
      return ([values[x] if kind == "d" else x for kind, x in arg_parts],
              {k: values[x] if kind == "d" else x for k, (kind, x) in kw_parts})
    return flat

  def general(values):
    full = [None] * n
    for i, v in static.items():
      full[i] = v
    for i, v in zip(dynamic, values):
      full[i] = v
    return tree_util.tree_unflatten(in_tree, full)
  return general


def caller(fn, in_tree, static_args) -> Callable[..., Any]:
  """``call(*values)``: ``fn`` called with the arguments JAX's flat callback
  rebuilds from ``values``; ``fn`` itself when they are those arguments."""
  n = in_tree.num_leaves
  args, kwargs = slots(in_tree)
  if (not static_args and not kwargs and len(args) == n
      and all(type(a) is Slot and a.i == i for i, a in enumerate(args))):
    return fn
  rebuild = rebuilder(in_tree, static_args)

  def call(*values):
    a, k = rebuild(values)
    return fn(*a, **k)
  return call


# --- results as JAX checks them ----------------------------------------------

def check_results(out, result_avals: tuple, n_results: int) -> tuple:
  """JAX's checks of a callback's flat results, with its messages."""
  out = tuple(out)
  if len(out) != n_results:
    raise RuntimeError(
        "Mismatched number of outputs from callback. "
        f"Expected: {n_results}, Actual: {len(out)}")
  # (with JAX's canonical dtypes, as JAX converts them before it compares)
  out = [np.asarray(a) for a in out]
  out = tuple(np.asarray(x, jax.dtypes.canonicalize_dtype(x.dtype)) for x in out)
  for i, (value, aval) in enumerate(zip(out, result_avals)):
    if value.shape != aval.shape:
      raise RuntimeError(
          f"Incorrect output shape for return value #{i}: "
          f"Expected: {aval.shape}, Actual: {value.shape}")
    if value.dtype != aval.dtype:
      raise RuntimeError(
          f"Incorrect output dtype for return value #{i}: "
          f"Expected: {aval.dtype}, Actual: {value.dtype}")
  return out
