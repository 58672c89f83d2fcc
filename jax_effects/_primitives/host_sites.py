"""A call site's host side, described once for the FFI entry (``host_target``).

A :class:`Site` is what a key is bound to: its host function and, in
:attr:`Site.c`, everything ``_trampoline.c`` (:data:`ENTRY`, the one entry
XLA calls) needs, made here when the site is made: the description it
checks every call frame against before it reads a byte (per buffer its
kind, XLA dtype code, rank, byte size and dims), how it hands each operand
over (:data:`INT`, :data:`ARRAY`, :data:`BYTES`), and the site's one
runner, which it calls with the operands and whose results it writes back.

Part in the token calling convention: the carrier operand (and a partition
id) arrives as a Python int, the carrier result is written as an int32
(``host_call``).
"""
from __future__ import annotations

import math
import struct
from typing import Callable

import numpy as np

from jax_effects._runtime import interrupts as _interrupts


def _entry():
  try:
    from jax_effects._primitives import _trampoline
    return _trampoline
  except ImportError:
    # (a checkout's source tree, imported in its folder after
    # ``pip install .``: the installed copy's, built from the same source)
    from jax_effects._primitives import installed
    found = installed.installed_copy("jax_effects._primitives._trampoline")
  if found is None:
    raise ImportError(
        "jax_effects' compiled FFI host entry (jax_effects/_primitives/"
        "_trampoline.c) is not built in this copy of jax_effects: install it "
        "with `pip install .` (or `pip install -e .`), or build it in a "
        "checkout with `python setup.py build_ext --inplace`; its build "
        "needs a C compiler")
  return found


#: ``_trampoline``: the C function XLA calls, built against XLA's FFI header.
ENTRY = _entry()

#: How the entry hands a buffer over: a token (not at all), a Python int (a
#: 0-d int32 carrier or uint32 partition id; an int32 result), a NumPy copy
#: (an ``np.empty`` it fills), or a memoryview of its bytes (sub-byte).
TOKEN, INT, ARRAY, BYTES = ENTRY.TOKEN, ENTRY.INT, ENTRY.ARRAY, ENTRY.BYTES


def _of_jax(table: dict) -> dict:
  """``table`` keyed by the NumPy dtypes of the names this JAX has."""
  import jax.numpy as jnp
  return {np.dtype(getattr(jnp, name)): v for name, v in table.items()
          if getattr(jnp, name, None) is not None}


#: ``{numpy dtype: XLA_FFI_DataType}``: the header's codes (``ENTRY.DTYPES``).
DTYPES = _of_jax({k: v for k, v in ENTRY.DTYPES.items() if k != "token"})
#: Bits per element of the sub-byte dtypes (packed in XLA's buffers).
SUB_BYTE = _of_jax({"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2,
                    "uint2": 2})


class SiteMismatch(Exception):
  """A call whose spec or attributes are not what this process can run."""


class Site:
  """One call site's host side (module docstring); ``avals_in`` and
  ``avals_out``: ``(dtype, shape)``, or None for a token; ``scalars``:
  the operand positions passed as Python ints."""
  __slots__ = ("key", "spec", "what", "c", "__weakref__")

  def __init__(self, key: bytes, spec: str, what: str, host: Callable,
               avals_in: list, avals_out: list, scalars: frozenset):
    self.key = key
    self.spec = spec
    self.what = what
    words, empties, kinds = [len(avals_in), len(avals_out)], [], []
    for side, avals in ((0, avals_in), (1, avals_out)):
      for i, aval in enumerate(avals):
        kind, code, nbytes, shape = _buffer(aval, side, i in scalars)
        words += [kind, code, len(shape), nbytes, *shape]
        if side == 0:
          empties.append((shape, aval[0]) if kind == ARRAY else None)
        if kind != TOKEN:
          kinds.append((side, kind, aval))
    converts = any(k == BYTES or (s == 1 and k != INT) for s, k, _ in kinds)
    runner = _converting(host, kinds) if converts else host
    self.c = (struct.pack(f"<{len(words)}q", *words), runner, tuple(empties))


def _buffer(aval, side: int, scalar: bool) -> tuple:
  """``(kind, dtype code, byte size, dims)`` of one buffer."""
  if aval is None:
    return TOKEN, ENTRY.DTYPES["token"], 0, ()
  dtype, shape = aval
  count = math.prod(shape)
  bits = SUB_BYTE.get(dtype)
  nbytes = (count * bits + 7) // 8 if bits else count * dtype.itemsize
  as_int = shape == () and (dtype == np.int32 if side else scalar and dtype in (
      np.int32, np.uint32))
  kind = INT if as_int else BYTES if bits else ARRAY
  return kind, DTYPES.get(dtype, -1), nbytes, tuple(shape)


def _converting(host, kinds) -> Callable:
  """``host`` with its sub-byte operands unpacked and its results as the
  entry writes them (``(dtype, shape)`` checked, C-contiguous, sub-byte
  ones packed)."""
  unpack = [(j, aval) for j, (s, k, aval) in enumerate(
      x for x in kinds if x[0] == 0) if k == BYTES]
  outs = [(k, aval) for s, k, aval in kinds if s == 1]

  def run(*args):
    if unpack:
      args = list(args)
      for j, (dtype, shape) in unpack:
        args[j] = _unpacked(args[j], dtype, shape)
    return tuple(v if k == INT else _packed(v, aval)
                 for (k, aval), v in zip(outs, host(*args)))
  # (an interrupt landing here is raised by the host function instead)
  _interrupts.entry_frame(run)
  return run


def _unpacked(data, dtype, shape) -> np.ndarray:
  """A NumPy copy of sub-byte values packed as XLA packs them."""
  count = math.prod(shape)
  if not count:
    return np.zeros(shape, dtype)
  bits = SUB_BYTE[dtype]
  packed = np.frombuffer(data, np.uint8)
  shifts = np.arange(8 // bits, dtype=np.uint8) * bits
  values = (packed[:, None] >> shifts) & np.uint8((1 << bits) - 1)
  return values.reshape(-1)[:count].view(dtype).reshape(shape)


def _packed(value, aval) -> np.ndarray:
  """``value`` as the bytes of a result of ``aval`` (sub-byte: packed)."""
  dtype, shape = aval
  value = np.asarray(value, dtype, order="C")
  if value.shape != shape:
    raise SiteMismatch(f"a host function returned shape {value.shape}, "
                       f"expected {shape}")
  bits = SUB_BYTE.get(dtype)
  if bits is None:
    return value
  per_byte = 8 // bits
  raw = value.reshape(-1).view(np.uint8) & np.uint8((1 << bits) - 1)
  padded = np.zeros(-(-value.size // per_byte) * per_byte, np.uint8)
  padded[:value.size] = raw
  shifts = np.arange(per_byte, dtype=np.uint8) * bits
  return np.bitwise_or.reduce(padded.reshape(-1, per_byte) << shifts, axis=1)
