"""A call site's host side as the FFI handler runs it (``host_target``).

A :class:`Site` is what a key is bound to: the host function, and how to
read its operands from a call frame and write its results. Every frame's
buffers are checked against the site (:attr:`Site.match`; the compiled
entry checks ``Site.sig``) before a byte is read; a frame that does not
fit fails with :class:`SiteMismatch`. The common site is run by the
handler or the compiled entry itself (:func:`inline_form`).

Part in the token calling convention: reads the carrier operand as a NumPy
scalar and writes the carrier result like any other int32 (``host_call``).
"""
from __future__ import annotations

import functools
import struct
from typing import Callable

import numpy as np

from jax_effects._primitives import ffi_abi as _abi

mem8, mem32, mem64 = _abi.mem8, _abi.mem32, _abi.mem64
F_ARGV, F_RETV = _abi.F_ARGV, _abi.F_RETV
B_DATA = _abi.B_DATA


class SiteMismatch(Exception):
  """A call frame whose buffers are not what its spec says."""


class Site:
  """One call site's host side: ``host`` called with the operands read
  from the frame, its results written back (:meth:`run`)."""
  __slots__ = ("key", "spec", "what", "host", "avals_in", "avals_out",
               "scalars", "run", "inline", "compiled", "match", "sig",
               "__weakref__")

  def __init__(self, key: bytes, spec: str, what: str, host: Callable,
               avals_in: list, avals_out: list, scalars: frozenset):
    self.key = key
    self.spec = spec
    self.what = what
    self.host = host
    self.avals_in = avals_in     # (dtype, shape) or None (a token)
    self.avals_out = avals_out
    self.scalars = scalars       # operand positions passed as NumPy scalars
    self.run = self._first_run
    # (:func:`inline_form`, :func:`compiled_form`, once checked)
    self.inline = self.compiled = None
    self.match = _matcher(avals_in, avals_out)
    self.sig = _signature(avals_in, avals_out)

  def _first_run(self, frame: int) -> int:
    problem = _abi.check_frame(frame) or self._check(frame)
    if problem:
      raise SiteMismatch(problem)
    self.run = _runner(self)
    self.inline = inline_form(self)
    self.compiled = compiled_form(self.inline, self.sig)
    return self.run(frame)

  def _check(self, frame: int) -> str | None:
    """What differs between the frame's buffers and this site's spec."""
    return _mismatch(self.what, self.avals_in, self.avals_out, frame)


def _mismatch(site_what: str, avals_in, avals_out, frame: int) -> str | None:
  """What differs between the frame's buffers and a site's avals."""
  f = frame >> 3
  for what, n_at, v_at, avals in (("operand", _abi.F_NARGS, F_ARGV,
                                   avals_in),
                                  ("result", _abi.F_NRETS, F_RETV,
                                   avals_out)):
    n = mem64[f + n_at]
    if n != len(avals):
      return f"{site_what}: {n} {what}s in the call, {len(avals)} in its spec"
    vec = mem64[f + v_at] >> 3
    for i, aval in enumerate(avals):
      code, _, dims = _abi.buffer(mem64[vec + i])
      if aval is None:
        if code != _abi.DTYPE_TOKEN:
          return f"{site_what}: {what} {i} is not a token"
        continue
      dtype, shape = aval
      if _abi.DTYPES.get(dtype) != code or dims != shape:
        return (f"{site_what}: {what} {i} has XLA dtype {code} and shape "
                f"{dims}; its spec says {dtype}{list(shape)}")
  return None


#: (dtype code, rank) of an ``XLA_FFI_Buffer`` (``B_DTYPE``, ``B_RANK``).
_CODE_RANK = struct.Struct("<16xi12xq").unpack_from
#: The same and its dims' address (``B_DIMS``: byte 40).
_CODE_RANK_DIMS = struct.Struct("<16xi12xqQ").unpack_from


def _matcher(avals_in, avals_out):
  """``match(argv, retv, nargs, nrets)``: whether a frame has this site's
  buffers (number, XLA dtype code and dims; a token's code only)."""
  n_in, n_out = len(avals_in), len(avals_out)
  checks = []
  for side, avals in ((0, avals_in), (1, avals_out)):
    for i, aval in enumerate(avals):
      if aval is None:
        checks.append((side, i, _abi.DTYPE_TOKEN, None, None, None))
        continue
      dtype, shape = aval
      rank = len(shape)
      checks.append((side, i, _abi.DTYPES.get(dtype, -1), rank,
                     struct.Struct(f"<{rank}q").unpack_from if rank else None,
                     tuple(shape)))
  checks = tuple(checks)
  code_rank, B_DIMS = _CODE_RANK, _abi.B_DIMS
  i32 = (_abi.DTYPES[np.dtype(np.int32)], 0)
  if (n_in == 2 and n_out == 1 and checks[0][2:4] == i32
      and checks[2][2:4] == i32 and checks[1][3] is not None):
    # The common site (the carrier and one operand in, the carrier out),
    # unrolled: the ctypes entry checks it on every call.
    _, _, code, rank, dims, shape = checks[1]
    want = (code, rank)
    code_rank_dims = _CODE_RANK_DIMS

    def match(argv, retv, nargs, nrets, mem8=mem8, mem64=mem64):
      if nargs != 2 or nrets != 1:
        return False
      a = argv >> 3
      if (code_rank(mem8, mem64[a]) != i32
          or code_rank(mem8, mem64[retv >> 3]) != i32):
        return False
      c, r, d = code_rank_dims(mem8, mem64[a + 1])
      return (c, r) == want and (dims is None or dims(mem8, d) == shape)
    return match

  def match(argv, retv, nargs, nrets, mem8=mem8, mem64=mem64):
    if nargs != n_in or nrets != n_out:
      return False
    vecs = (argv >> 3, retv >> 3)
    for side, i, code, rank, dims, shape in checks:
      b = mem64[vecs[side] + i]
      c, r = code_rank(mem8, b)
      if c != code:
        return False
      if rank is None:
        continue
      if r != rank or (dims is not None and dims(
          mem8, mem64[(b >> 3) + B_DIMS]) != shape):
        return False
    return True
  return match


def _signature(avals_in, avals_out) -> bytes:
  """What ``_trampoline.c`` checks a frame against: int64 words ``nargs,
  nrets``, then per buffer its dtype code, rank (-1: a token) and dims."""
  words = [len(avals_in), len(avals_out)]
  for aval in (*avals_in, *avals_out):
    if aval is None:
      words += [_abi.DTYPE_TOKEN, -1]
    else:
      dtype, shape = aval
      words += [_abi.DTYPES.get(dtype, -1), len(shape), *shape]
  return struct.pack(f"<{len(words)}q", *words)


# NumPy scalars of the partition-id values seen (a carrier's value names
# its execution: made anew each call, never kept).
uint32s: dict[int, np.uint32] = {}


#: memoryview formats of the dtypes whose 0-d operands are read as one
#: value (``np.array(value, dtype)`` is a third of a buffer copy's cost).
_SCALAR_FORMATS = {"bool": "?", "int8": "b", "uint8": "B", "int16": "h",
                   "uint16": "H", "int32": "i", "uint32": "I", "int64": "q",
                   "uint64": "Q", "float32": "f", "float64": "d"}


@functools.cache
def _typed(fmt: str) -> memoryview:
  return _abi.mem8.cast(fmt)


def _reader(aval, scalar: bool):
  """``read(address)``: the operand there, a NumPy scalar (``scalar``: the
  carrier, a partition id) or an array of its own (the host may keep it)."""
  dtype, shape = aval
  if scalar and shape == () and dtype in (np.int32, np.uint32):
    view, make = _typed(_SCALAR_FORMATS[dtype.name]), dtype.type
    shift = dtype.itemsize.bit_length() - 1
    if dtype == np.int32:
      return lambda address: make(view[address >> shift])

    def read_partition(address):
      v = view[address >> shift]
      p = uint32s.get(v)
      if p is None:
        p = uint32s[v] = make(v)
      return p
    return read_partition
  if dtype in _abi.SUB_BYTE:
    return lambda address: _abi.read_array(address, shape, dtype)
  count = int(np.prod(shape, dtype=np.int64))
  if not count:
    return lambda address: np.zeros(shape, dtype)
  mem8 = _abi.mem8
  frombuffer, array = np.frombuffer, np.array
  if shape == () and dtype.name in _SCALAR_FORMATS:
    view = _typed(_SCALAR_FORMATS[dtype.name])
    shift = dtype.itemsize.bit_length() - 1

    def read(address):
      v = view[address >> shift]
      if v == v:   # (a NaN is copied as it is: its payload bits kept)
        return array(v, dtype)
      return frombuffer(mem8, dtype, 1, address).reshape(()).copy()
    return read
  if len(shape) == 1:
    return lambda address: frombuffer(mem8, dtype, count, address).copy()
  return lambda address: frombuffer(mem8, dtype, count, address).reshape(
      shape).copy()


def _writer(aval):
  dtype, shape = aval
  if dtype == np.int32 and shape == ():
    def write(address, value):
      mem32[address >> 2] = value
    return write
  asarray = np.asarray

  def write(address, value):
    value = asarray(value, dtype)
    if value.shape != shape:
      raise SiteMismatch(f"a host function returned shape {value.shape}, "
                         f"expected {shape}")
    _abi.write_array(address, value)
  return write


def _runner(site: Site) -> Callable[[int], int]:
  """``run(frame)`` of a checked site."""
  host = site.host
  ins = [(i, _reader(a, i in site.scalars)) for i, a in
         enumerate(site.avals_in) if a is not None]
  outs = [(i, _writer(a)) for i, a in enumerate(site.avals_out)
          if a is not None]
  # (no reference to the site itself: it holds this function)
  match, what = site.match, site.what
  avals_in, avals_out = site.avals_in, site.avals_out
  F_NARGS, F_NRETS = _abi.F_NARGS, _abi.F_NRETS

  def run(frame):
    f = frame >> 3
    if not match(mem64[f + F_ARGV], mem64[f + F_RETV], mem64[f + F_NARGS],
                 mem64[f + F_NRETS]):
      raise SiteMismatch(_mismatch(what, avals_in, avals_out, frame) or
                         f"{what}: a call frame that does not fit its site")
    argv = mem64[f + F_ARGV] >> 3
    out = host(*[read(mem64[(mem64[argv + i] >> 3) + B_DATA])
                 for i, read in ins])
    retv = mem64[f + F_RETV] >> 3
    for (i, write), value in zip(outs, out):
      write(mem64[(mem64[retv + i] >> 3) + B_DATA], value)
    return 0
  return run


def inline_form(site: Site):
  """``(host, view, shift, dtype, count, shape, per_device)``: how the
  handler runs a common site (the carrier and one operand in, maybe a
  partition id; the carrier out) itself, or None."""
  i32, u32 = (np.dtype(np.int32), ()), (np.dtype(np.uint32), ())
  ins, per_device = site.avals_in, len(site.avals_in) == 3
  if per_device and (ins[2] != u32 or 2 not in site.scalars):
    return None   # (the partition id last)
  if not (len(ins) - per_device == 2 and site.avals_out == [i32]
          and ins[0] == i32 and ins[1] is not None and 0 in site.scalars
          and 1 not in site.scalars):
    return None
  dtype, shape = site.avals_in[1]
  count = int(np.prod(shape, dtype=np.int64))
  if not count or dtype in _abi.SUB_BYTE:
    return None
  if shape == () and dtype.name in _SCALAR_FORMATS:
    return (site.host, _typed(_SCALAR_FORMATS[dtype.name]),
            dtype.itemsize.bit_length() - 1, dtype, 1, None, per_device)
  return (site.host, None, 0, dtype, count,
          None if len(shape) == 1 else shape, per_device)


def compiled_form(inline, sig: bytes) -> tuple | None:
  """``(host, shape, dtype, nbytes, per_device, sig)``: what
  ``_trampoline.c`` needs to run a common site itself, or None."""
  if inline is None:
    return None
  host, view, _, dtype, count, shape, per_device = inline
  if view is not None:
    shape = ()
  elif shape is None:
    shape = (count,)
  return (host, tuple(shape), dtype, count * dtype.itemsize, per_device,
          sig)
