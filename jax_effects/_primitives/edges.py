"""What crosses to the host of an array NumPy would print summarized.

NumPy formats a summarized array from its *edges* alone
(``design/formatting.md``, "Summarized arrays"), so only those leave the
device: :func:`plan` decides at trace time, :func:`cut` cuts a traced
operand, and on the host :class:`Summarized` (and :class:`Value`, for an
operand shown whole) formats as the ``jax.Array`` would, without JAX.

Part in the token calling convention: none. An :class:`Edges` is attached to
an effect's operand (``HostCallback.edges``); the effect's lowering decides
where the edges are cut.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np


@dataclasses.dataclass(frozen=True)
class Edges:
  """The edges of an operand of ``shape`` printed with ``edgeitems`` (the
  operand may have more leading axes, ``vmap``'s, kept whole)."""
  shape: tuple
  edgeitems: int

  @property
  def axes(self) -> tuple:
    """The summarized axes of ``shape`` (longer than ``2 * edgeitems``)."""
    e2 = 2 * self.edgeitems
    return tuple(d for d, n in enumerate(self.shape) if n > e2)

  def take(self, x):
    """``x`` (traced, with leading axes) cut to its edges, by slices."""
    lead = x.ndim - len(self.shape)
    for d in self.axes:
      x = ends(x, self.edgeitems, lead + d)
    return x


def ends(x, e: int, axis: int):
  """``x`` (traced) cut to its first and last ``e`` entries along ``axis``."""
  from jax import lax   # lowering side only
  n = x.shape[axis]
  return lax.concatenate([lax.slice_in_dim(x, 0, e, axis=axis),
                          lax.slice_in_dim(x, n - e, n, axis=axis)], axis)


def plan(shape, options: dict) -> Edges | None:
  """The :class:`Edges` of an operand of ``shape`` if NumPy, with print
  ``options``, would summarize it (``design/formatting.md``), else None."""
  shape = tuple(int(n) for n in shape)
  threshold = options.get("threshold", 1000)
  try:
    edgeitems = operator.index(options.get("edgeitems", 3))
  except TypeError:
    return None
  if (not shape or edgeitems < 1 or math.prod(shape) <= threshold
      or all(n <= 2 * edgeitems for n in shape)):
    return None
  return Edges(shape, edgeitems)


def of_operands(host_callback, n_args: int) -> tuple:
  """One :class:`Edges` or None per operand (masks go first)."""
  edges = host_callback.edges
  return (None,) * (n_args - len(edges)) + tuple(edges)


def cut(ctx, args, edges, first: int):
  """``(avals_in, args)`` with the operands (the first at
  ``ctx.avals_in[first]``) that have ``edges`` cut to them."""
  import jax
  from jax.interpreters import mlir

  avals = list(ctx.avals_in)
  args = list(args)
  for i, e in enumerate(edges):
    if e is None:
      continue
    aval = avals[first + i]
    reduced = tuple(min(n, 2 * e.edgeitems) for n in e.shape)
    cut_aval = jax.core.ShapedArray(
        aval.shape[:aval.ndim - len(e.shape)] + reduced, aval.dtype)
    (args[i],) = mlir.lower_fun(lambda x, e=e: [e.take(x)],
                                multiple_results=True)(
        dataclasses.replace(ctx, avals_in=[aval], avals_out=[cut_aval]),
        args[i])
    avals[first + i] = cut_aval
  return avals, args


class Value:
  """An array shown whole, formatting as its ``jax.Array`` without JAX."""
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


# dtype -> whether its 0-d arrays format as their .item() (formats_as_item)
_as_item: dict = {}
_ITEM_TYPES = frozenset((
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
    np.complex128))
_ITEM_SPECS = ("", ".3f", ">12", "e", "g", "+", "d", "x", "10.4", ",", "%",
               "s", "#x", "^12.2e", "_")


def formats_as_item(dtype: np.dtype) -> bool:
  """Whether ``format(a[()], spec)`` is ``format(a.item(), spec)`` for the
  0-d arrays ``a`` of ``dtype`` (cheaper: no NumPy scalar, whose
  ``__format__`` converts to that Python number first: ``gentype_format``
  in NumPy's ``scalartypes.c.src``). NumPy's own bool, 8- to 64-bit
  integer, float16/32/64 and complex64/128 dtypes, each checked once on
  samples of values and specs (texts and errors alike): a NumPy that
  formats one otherwise keeps its scalars."""
  found = _as_item.get(dtype)
  if found is None:
    found = _as_item[dtype] = dtype.type in _ITEM_TYPES and all(
        _same_format(a, spec) for a in _item_samples(dtype) for spec in _ITEM_SPECS)
  return found


def _item_samples(dtype: np.dtype) -> list:
  """0-d arrays of ``dtype``: zero, small and extreme values (no cast that
  warns: the check may run on any thread)."""
  kind = dtype.kind
  if kind == "b":
    values = [False, True]
  elif kind in "iu":
    info = np.iinfo(dtype)
    values = [0, 1, 7, 100, int(info.max), int(info.min)]
    if kind == "i":
      values.append(-1)
  elif kind == "f":
    info = np.finfo(dtype)
    values = [0.0, -0.0, 0.1, -2.5, 1234.5, 1e-3, float(info.max),
              float(info.tiny), float("nan"), float("inf"), float("-inf")]
  else:
    values = [0j, 1 + 2j, -0.5 - 3j, complex(1e20, -1e-20), complex(float("nan"), 1)]
  return [np.array(v, dtype=dtype) for v in values]


def _same_format(a: np.ndarray, spec: str) -> bool:
  def text(v):
    try:
      return format(v, spec)
    except Exception as err:  # noqa: BLE001 - compared, not raised
      return type(err)
  return text(a[()]) == text(a.item())


def host_values(np_operands, edges) -> list:
  """A :class:`Summarized` or :class:`Value` per operand, as ``edges`` say."""
  return [Value(x) if e is None else Summarized(x, e.shape)
          for x, e in zip(np_operands, edges)]


class Summarized:
  """The whole array, on the host, as its edges: formats as the
  ``jax.Array`` (``design/formatting.md``), under the call's print options."""
  __slots__ = ("edges", "shape", "size", "ndim", "dtype")

  def __init__(self, edges: np.ndarray, shape: tuple):
    self.edges = edges
    self.shape = shape
    self.ndim = len(shape)
    self.size = math.prod(shape)
    self.dtype = edges.dtype

  def __array__(self, dtype=None, copy=None):
    return self.edges if dtype is None else self.edges.astype(dtype)

  def __getitem__(self, index):
    return self.edges[index]

  def __len__(self):
    return self.shape[0]

  def __str__(self):
    return np.array2string(self, None, None, None, " ", "")

  def __format__(self, spec):
    # (with a spec: as ndarray.__format__, a TypeError caught at trace time)
    return format(self.edges, spec) if spec else str(self)

  def __repr__(self):
    return array_repr(self)


def array_repr(value) -> str:
  """``repr`` of the ``jax.Array`` holding ``value``, without JAX (a
  ``jax.device_put`` inside a callback can wait for XLA's CPU client, whose
  threads may all be running the computation waiting for the callback)."""
  prefix = "Array("
  dtype_str = f"dtype={value.dtype.name}"
  line_width = np.get_printoptions()["linewidth"]
  s = (np.array2string(value, prefix=prefix, suffix=",", separator=", ",
                       max_line_width=line_width) if value.size
       else f"[], shape={tuple(value.shape)}")
  last_line_len = len(s) - s.rfind("\n") + 1
  sep = " " * len(prefix) if last_line_len + len(dtype_str) + 2 > line_width else " "
  return f"{prefix}{s},{sep}{dtype_str})"
