"""``jax_effects.callback``: host functions with results, in program order.

The callback receives NumPy arrays (the pytree structure of ``*args`` and
``**kwargs`` is kept) and must return a pytree matching
``result_shape_dtypes``: same structure, and each leaf of the declared shape
and dtype. A leaf may be anything NumPy takes as an array (NumPy arrays and
scalars, ``jax.Array``, objects with ``__array__``, whatever its signature;
Python scalars and lists take the declared dtype). Dtypes are compared as
``io_callback``/``pure_callback`` compare them, after JAX's canonicalization:
with ``jax_enable_x64`` off a 64-bit result is converted to its 32-bit type
(a ``float64`` array for a ``float32`` result, ``int64`` for ``int32``);
any other dtype is an error naming expected and actual. Results take no part in the token
calling convention beyond being the primitive's outputs after the token and
carrier.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax import tree_util
import numpy as np

from jax_effects._core import effects as _effects
from jax_effects._core.effects import Effect
from jax_effects._frontends import arguments as _arguments
from jax_effects._primitives import effect as _effect


def _result_avals(what: str, result_shape_dtypes):
  leaves, treedef = tree_util.tree_flatten(result_shape_dtypes)
  avals = []
  for leaf in leaves:
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise TypeError(
          f"{what}: result_shape_dtypes must be a pytree of jax.ShapeDtypeStruct"
          f" (or arrays), got a leaf {leaf!r}")
    dtype = np.dtype(leaf.dtype)
    canonical = jax.dtypes.canonicalize_dtype(dtype)
    if canonical != dtype:
      raise TypeError(
          f"{what}: result dtype {dtype} is not available with jax_enable_x64 "
          f"disabled; declare {canonical}")
    avals.append(jax.core.ShapedArray(tuple(leaf.shape), dtype))
  return tuple(avals), treedef


def callback(fn: Callable[..., Any], result_shape_dtypes: Any, *args: Any,
             ordered: bool | None = None,
             effect: Effect | None = None, **kwargs: Any) -> Any:
  """Calls ``fn(*args, **kwargs)`` on the host when the computation runs.

  Returns arrays matching ``result_shape_dtypes`` (a pytree of
  ``jax.ShapeDtypeStruct``, or None for no result).
  ``effect`` (default :data:`jax_effects.DEFAULT`, shared with ``print`` and
  ``log``) and ``ordered`` (default: the effect's setting) work as for
  :func:`jax_effects.print`. Results are not differentiable (their tangents
  are zero).
  """
  if not callable(fn):
    raise TypeError(f"jax_effects.callback: {fn!r} is not callable")
  name = getattr(fn, "__qualname__", None) or repr(fn)
  what = f"jax_effects.callback({name})"
  effect, ordered = _effects.resolve(what, effect, ordered)
  operands, calling = _arguments.split(what, args, kwargs)
  avals, out_tree = _result_avals(what, result_shape_dtypes)
  host = calling(fn)

  if result_shape_dtypes is None:
    # What ``host`` returns is ignored: no frame of ours around it.
    _effect.bind_effect(host, what, operands, effect=effect,
                            ordered=ordered)
    return None

  def call(*np_operands):
    out = host(*np_operands)
    try:
      # Up to the declared structure: a leaf may be a list, a scalar or any
      # object NumPy takes as an array.
      return out_tree.flatten_up_to(out)
    except (ValueError, TypeError):
      tree = tree_util.tree_structure(out)
      count = ""
      if (isinstance(out, (tuple, list))
          and isinstance(result_shape_dtypes, (tuple, list))
          and len(out) != len(result_shape_dtypes)):
        count = (f"{len(out)} results where result_shape_dtypes declares "
                 f"{len(result_shape_dtypes)}: ")
      raise TypeError(
          f"{what} returned {count}a value of structure {tree}; expected "
          f"{out_tree} (from result_shape_dtypes)") from None

  results = _effect.bind_effect(call, what, operands, effect=effect,
                                   ordered=ordered, result_avals=avals)
  return tree_util.tree_unflatten(out_tree, results)
