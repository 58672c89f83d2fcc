"""Splitting user arguments into traced arrays and static values.

Array leaves of an effect's ``*args, **kwargs`` become the primitive's
operands and reach the host as NumPy arrays: :func:`split` for
``callback``, :func:`split_for_format` for ``print``/``log`` (rules in
``design/formatting.md``). Part in the token calling convention: none (the
pass adds the token and carrier in front of the operands).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
from jax import tree_util
import numpy as np

_PY_NUMBERS = (bool, int, float, complex)


def _describe(path) -> str:
  """'#1[0]' for positional argument 1, "'x'['a']" for keyword argument x."""
  top, first, *rest = path
  name = f"#{first.idx}" if top.idx == 0 else repr(first.key)
  return name + tree_util.keystr(tuple(rest))


def _is_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return (dtype is not None
          and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
          and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def _numeric(dtype) -> bool:
  """bool, integer, floating or complex, ml_dtypes (bfloat16, int4) too."""
  dtype = np.dtype(dtype)
  if dtype.kind in "biufc":
    return True
  if dtype.kind != "V":  # object, str, bytes, datetime64, timedelta64
    return False
  try:  # ml_dtypes register as kind "V"
    return bool(jax.numpy.issubdtype(dtype, np.number))
  except TypeError:
    return False


def _classify(leaf, python_numbers: bool = True) -> str:
  """'array', 'key', 'static' (not an array), or 'bad' (a non-number array);
  Python numbers are arrays if ``python_numbers``, else static."""
  if isinstance(leaf, (jax.Array, jax.core.Tracer)):
    return "key" if _is_key(leaf) else "array"
  if isinstance(leaf, (np.str_, np.bytes_)):
    return "static"  # a str/bytes that happens to be a NumPy scalar
  if isinstance(leaf, (np.ndarray, np.generic)):
    return "array" if _numeric(leaf.dtype) else "bad"
  if python_numbers and isinstance(leaf, _PY_NUMBERS):
    return "array"
  return "static"


def _bad_array(what: str, path, leaf, fix: str) -> TypeError:
  dtype = leaf.dtype
  kind = {"O": "object", "U": "str", "S": "bytes", "M": "datetime64",
          "m": "timedelta64", "V": "void/structured"}.get(dtype.kind, str(dtype))
  return TypeError(
      f"{what}: argument {_describe(path)} is a NumPy "
      f"{'array' if isinstance(leaf, np.ndarray) else 'scalar'} of dtype "
      f"{dtype} ({kind}), which is not an array of numbers; {fix}")


def split(what: str, args: tuple, kwargs: dict):
  """``(operands, calling)``: every leaf an array operand; ``calling(fn)``
  calls ``fn`` with the arguments rebuilt from the NumPy operands (0-d as
  NumPy scalars), and is ``fn`` itself when those are the arguments."""
  paths_leaves, treedef = tree_util.tree_flatten_with_path((args, kwargs))
  operands = []
  fix = ("pass arrays, NumPy or Python numbers as arguments; bind any other "
         "value to the function instead: jax_effects.callback("
         "functools.partial(fn, value), ...) or a closure")
  for path, leaf in paths_leaves:
    kind = _classify(leaf)
    if kind == "bad":
      raise _bad_array(what, path, leaf, fix)
    if kind == "key":
      raise TypeError(
          f"{what}: argument {_describe(path)} is a PRNG key array; pass its "
          "data (jax.random.key_data(key)) and rebuild it in the callback")
    if kind == "static":
      raise TypeError(
          f"{what}: argument {_describe(path)} is of type "
          f"{type(leaf).__name__}, which is not an array; {fix}")
    operands.append(leaf)

  scalar = [getattr(x, "shape", ()) == () for x in operands]
  if not (not kwargs and len(operands) == len(args)
          and all(a is leaf for a, leaf in zip(args, operands))):
    def calling(fn):
      def call(*np_operands):
        a, k = tree_util.tree_unflatten(
            treedef, [x[()] if x.ndim == 0 else x for x in np_operands])
        return fn(*a, **k)
      return call
  elif not any(scalar):   # the NumPy operands are the arguments
    def calling(fn):
      return fn
  elif len(operands) == 1:   # one 0-d argument: a NumPy scalar
    def calling(fn):
      def call(x):
        return fn(x[()])
      return call
  else:   # positional arguments, some 0-d
    def calling(fn):
      def call(*np_operands):
        return fn(*[x[()] if s else x for x, s in zip(np_operands, scalar)])
      return call
  return operands, calling


class Formatting(NamedTuple):
  """The arguments of ``print``/``log``, split for formatting:
  ``operands``: array leaves (a PRNG key array as its key data);
  ``rebuild(values)``: ``(args, kwargs)`` with the operands replaced by
  ``values``; ``key_impls[i]``: operand ``i``'s PRNG implementation, or
  None; ``positions``: the operands' flat positions among the leaves.
  """
  operands: list
  rebuild: Callable[[Any], tuple]
  key_impls: tuple
  positions: tuple = ()


def split_for_format(what: str, args: tuple, kwargs: dict, *,
                     arrays_only: bool = False) -> Formatting:
  """Splits ``print``/``log`` arguments for formatting: Python numbers and
  non-arrays are static; with ``arrays_only`` (``log``'s ``extra``) only
  ``jax.Array`` values and tracers are operands.
  """
  paths_leaves, treedef = tree_util.tree_flatten_with_path((args, kwargs))
  operands, positions, leaves, key_impls = [], [], [], []
  fix = ("format it on the host first (e.g. pass str(value)), or pass an "
         "array of numbers")
  for i, (path, leaf) in enumerate(paths_leaves):
    leaves.append(leaf)
    if arrays_only and not isinstance(leaf, (jax.Array, jax.core.Tracer)):
      continue
    kind = _classify(leaf, python_numbers=False)
    if kind == "bad":
      raise _bad_array(what, path, leaf, fix)
    if kind == "static":
      continue
    positions.append(i)
    key_impls.append(jax.random.key_impl(leaf) if kind == "key" else None)
    operands.append(jax.random.key_data(leaf) if kind == "key" else leaf)

  if (not kwargs and len(positions) == len(args)
      and all(a is leaf for a, leaf in zip(args, leaves))):
    def rebuild(values) -> tuple[tuple, dict]:
      return tuple(values), {}
  else:
    def rebuild(values) -> tuple[tuple, dict]:
      full = list(leaves)
      for i, x in zip(positions, values):
        full[i] = x
      return tree_util.tree_unflatten(treedef, full)

  return Formatting(operands, rebuild, tuple(key_impls), tuple(positions))
