"""What crosses to the host of an array NumPy would print summarized.

NumPy prints an array of more than ``threshold`` elements summarized, and
chooses the format of every number from the leading and trailing
``edgeitems`` entries of each long axis alone (``design/formatting.md``,
"Summarized arrays"). So the text of the whole array can be made from its
*edges*, and only those leave the device:

* :func:`plan` decides at trace time, from the shape and the print options,
  whether an operand will be summarized: its :class:`Edges`, or None;
* :meth:`Edges.take` cuts a traced array to its edges where it is whole
  (:func:`cut`); ``host_assembly`` takes them from the shards of one
  partitioned over several devices;
* on the host, :class:`Summarized` stands for the whole array and formats
  exactly as its ``jax.Array`` would, from the edges; :class:`Value` does
  the same for an operand shown whole (:func:`host_values`), neither
  calling JAX inside a callback (:func:`array_repr`).

Part in the token calling convention: none. An :class:`Edges` is attached to
an effect's operand (``HostCallback.edges``); the effect's lowering decides
where the edges are cut, its host side receives them in place of the
operand.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np

__all__ = ["Edges", "plan", "of_operands", "cut", "Value", "Summarized",
           "array_repr", "host_values"]


@dataclasses.dataclass(frozen=True)
class Edges:
  """The edges of an operand of ``shape`` printed with ``edgeitems``.

  ``shape`` is the shape of the value that is printed; the operand may have
  more leading axes (the batch axes ``vmap`` adds), which are kept whole:
  the cuts apply to its trailing ``len(shape)`` axes.
  """
  shape: tuple
  edgeitems: int

  @property
  def axes(self) -> tuple:
    """The summarized axes of ``shape`` (longer than ``2 * edgeitems``)."""
    e2 = 2 * self.edgeitems
    return tuple(d for d, n in enumerate(self.shape) if n > e2)

  @property
  def reduced_shape(self) -> tuple:
    e2 = 2 * self.edgeitems
    return tuple(min(n, e2) for n in self.shape)

  def take(self, x):
    """``x`` (traced, with leading axes) cut to its edges, by slices."""
    from jax import lax   # lowering side only
    e = self.edgeitems
    lead = x.ndim - len(self.shape)
    for d in self.axes:
      axis = lead + d
      n = x.shape[axis]
      x = lax.concatenate([lax.slice_in_dim(x, 0, e, axis=axis),
                           lax.slice_in_dim(x, n - e, n, axis=axis)], axis)
    return x


def plan(shape, options: dict) -> Edges | None:
  """The :class:`Edges` of an operand of ``shape`` if NumPy, with print
  ``options`` (``np.get_printoptions()``), would print it summarized, and
  they are smaller than the operand; else None (the whole array crosses).

  Summarized means: at least one axis, more than ``threshold`` elements,
  ``edgeitems >= 1`` (with ``edgeitems=0`` NumPy formats from the whole
  array and shows its last entry), and an axis longer than ``2 * edgeitems``.
  A 0-d array prints as its scalar.
  """
  shape = tuple(int(n) for n in shape)
  edgeitems = options.get("edgeitems", 3)
  threshold = options.get("threshold", 1000)
  try:
    edgeitems = operator.index(edgeitems)
  except TypeError:
    return None
  if (not shape or edgeitems < 1 or math.prod(shape) <= threshold
      or all(n <= 2 * edgeitems for n in shape)):
    return None
  return Edges(shape, edgeitems)


def of_operands(host_callback, n_args: int) -> tuple:
  """One :class:`Edges` or None per operand of an effect with
  ``n_args`` operands: ``host_callback.edges`` belong to the last operands
  (those the front end bound; ``vmap`` of ``cond``/``while`` adds mask
  operands in front)."""
  edges = host_callback.edges
  return (None,) * (n_args - len(edges)) + tuple(edges)


def cut(ctx, args, edges, first: int):
  """``(avals_in, args)``: an effect's operands (lowered in ``ctx``, the
  first at ``ctx.avals_in[first]``) with those that have ``edges`` cut to
  them by slices, and ``ctx.avals_in`` updated. Where an operand is whole
  (one device, per device in ``shard_map``) that is all; under automatic
  partitioning the partitioner moves the small edges where they go (the
  first device's call gathers them), unless ``host_assembly`` applies."""
  import jax
  from jax.interpreters import mlir

  avals = list(ctx.avals_in)
  args = list(args)
  for i, e in enumerate(edges):
    if e is None:
      continue
    aval = avals[first + i]
    cut_aval = jax.core.ShapedArray(
        aval.shape[:aval.ndim - len(e.shape)] + e.reduced_shape, aval.dtype)
    (args[i],) = mlir.lower_fun(lambda x, e=e: [e.take(x)],
                                multiple_results=True)(
        dataclasses.replace(ctx, avals_in=[aval], avals_out=[cut_aval]),
        args[i])
    avals[first + i] = cut_aval
  return avals, args


class Value:
  """An array argument as the host callback formats it (shown whole).

  ``jax.debug.print`` formats ``jax.Array`` values; a format field can only
  format, ``str``, ``repr`` or ``ascii`` an argument (attribute and index
  access are refused at trace time), and each of these gives what the
  ``jax.Array`` gives: ``format`` and ``str`` from the NumPy value (as
  ``jax.Array`` does), ``repr`` as ``jax.Array.__repr__`` writes it
  (:func:`array_repr`: no JAX call inside the callback).
  """
  __slots__ = ("value",)

  def __init__(self, value: np.ndarray):
    self.value = value

  def __format__(self, spec):
    v = self.value
    return format(v[()] if v.ndim == 0 else v, spec)

  def __str__(self):
    return str(self.value)

  def __repr__(self):
    return array_repr(self.value)


def host_values(np_operands, edges) -> list:
  """The values a host callback formats, one per operand: a
  :class:`Summarized` where ``edges`` (one per operand, see :func:`plan`)
  say the operand arrived as its edges, else a :class:`Value`."""
  return [Value(x) if e is None else Summarized(x, e.shape)
          for x, e in zip(np_operands, edges)]


class Summarized:
  """The whole array, on the host, as its edges: formats as the ``jax.Array``.

  ``str``, ``format`` and ``repr`` as ``jax.Array``'s (a non-empty format
  spec fails as it does). ``np.array2string`` is given this object: it has
  the whole array's ``shape``, ``size`` and ``dtype``, converts to the edges
  (``__array__``) and indexes into them with the indices NumPy's summarized
  layout reads (``design/formatting.md``). The call's NumPy print options
  must be in effect.
  """
  __slots__ = ("edges", "shape", "size", "ndim", "dtype")

  def __init__(self, edges: np.ndarray, shape: tuple):
    self.edges = edges
    self.shape = shape
    self.ndim = len(shape)
    self.size = math.prod(shape)
    self.dtype = edges.dtype

  # What NumPy's array2string reads of its argument.
  def __array__(self, dtype=None, copy=None):
    return self.edges if dtype is None else self.edges.astype(dtype)

  def __getitem__(self, index):
    return self.edges[index]

  def __len__(self):
    return self.shape[0]

  # What a format field reads (design/formatting.md).
  def __str__(self):
    return np.array2string(self, None, None, None, " ", "")

  def __format__(self, spec):
    if spec:   # as ndarray.__format__ (a TypeError, caught at trace time)
      return format(self.edges, spec)
    return str(self)

  def __repr__(self):
    return array_repr(self)


def array_repr(value) -> str:
  """``repr`` of the ``jax.Array`` holding ``value`` (a NumPy array, or a
  :class:`Summarized`), made without JAX: ``jax.Array.__repr__``
  (``jax/_src/array.py``, the same on JAX 0.8-0.10) of a fully addressable
  array that is not weakly typed (values under jit never are). Host
  callbacks format with it: a ``jax.device_put`` inside a callback can wait
  for XLA's CPU client, whose threads may all be running the computation
  that waits for the callback (seen as a stall in programs with many
  callbacks and collectives).
  """
  prefix = "Array("
  dtype_str = f"dtype={value.dtype.name}"
  line_width = np.get_printoptions()["linewidth"]
  if value.size == 0:
    s = f"[], shape={tuple(value.shape)}"
  else:
    s = np.array2string(value, prefix=prefix, suffix=",", separator=", ",
                        max_line_width=line_width)
  last_line_len = len(s) - s.rfind("\n") + 1
  sep = " "
  if last_line_len + len(dtype_str) + 2 > line_width:
    sep = " " * len(prefix)
  return f"{prefix}{s},{sep}{dtype_str})"
