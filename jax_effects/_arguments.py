"""Splitting user arguments into traced arrays and static values.

Every user-facing effect takes ``*args, **kwargs`` pytrees. Array leaves
(``jax.Array``, NumPy arrays and scalars, Python numbers) become operands of
the side-effect primitive and reach the host callback as NumPy arrays. Other
leaves are rejected with an error naming the argument, except where a caller
allows ``str`` leaves as static values (formatting).
"""
from __future__ import annotations

import numbers
import jax
import numpy as np
from jax import tree_util

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, numbers.Number)


def _is_array(x) -> bool:
  return isinstance(x, _ARRAY_TYPES) or isinstance(x, jax.core.Tracer)


def split(what: str, args: tuple, kwargs: dict, *, allow_str: bool):
  """Returns ``(operands, rebuild)``.

  ``rebuild(np_operands)`` gives back ``(args, kwargs)`` with each operand
  replaced by its NumPy value (0-d arrays as NumPy scalars) and static leaves
  as they were.
  """
  paths_leaves, treedef = tree_util.tree_flatten_with_path((args, kwargs))
  operands, positions, leaves = [], [], []
  for i, (path, leaf) in enumerate(paths_leaves):
    leaves.append(leaf)
    if _is_array(leaf):
      positions.append(i)
      operands.append(leaf)
    elif allow_str and isinstance(leaf, str):
      continue
    else:
      raise TypeError(
          f"{what}: argument {_describe(path)} is of type {type(leaf).__name__}"
          f", which is not an array; pass arrays, NumPy or Python numbers"
          + (", or str" if allow_str else ""))

  if (not kwargs and len(positions) == len(args)
      and all(a is leaf for a, leaf in zip(args, leaves))):
    # Only positional array arguments (the common case): no pytree to rebuild
    # on every run of the callback.
    def rebuild(np_operands) -> tuple[tuple, dict]:
      return tuple([x[()] if x.ndim == 0 else x for x in np_operands]), {}
    return operands, rebuild

  def rebuild(np_operands) -> tuple[tuple, dict]:
    full = list(leaves)
    for i, x in zip(positions, np_operands):
      full[i] = x[()] if x.ndim == 0 else x
    return tree_util.tree_unflatten(treedef, full)

  return operands, rebuild


def _describe(path) -> str:
  """'#1[0]' for positional argument 1, "'x'['a']" for keyword argument x."""
  top, first, *rest = path
  name = f"#{first.idx}" if top.idx == 0 else repr(first.key)
  return name + tree_util.keystr(tuple(rest))
