"""Sites and their call frames: one call site's host side (:class:`Site`), its
operands read from and its results written to the ``XLA_FFI_CallFrame`` of
a host call (``ffi_abi`` gives the layout).

A site is checked before a byte of a frame's buffers
is read: :func:`matcher` (the ctypes entry, every call) and
:func:`signature` (what the compiled entry, ``_trampoline.c``, compares)
say whether the frame's buffers are the site's (number, XLA dtype code,
dims); :func:`mismatch` says how they differ. :func:`runner` reads every
operand and writes every result; :func:`inline` and :func:`compiled`
describe the common site (the carrier and one operand in, the carrier out),
which the handler and the compiled entry run themselves.

Part in the token calling convention: the carrier (an ``int32`` scalar, the
first passthrough operand and the first result) is read and written as a
scalar, never copied as a buffer; a token operand is checked by its code
only.
"""
from __future__ import annotations

import struct
from typing import Callable

import numpy as np

from jax_effects._primitives import ffi_abi as _abi

mem8, mem32, mem64 = _abi.mem8, _abi.mem32, _abi.mem64
F_ARGV, F_RETV = _abi.F_ARGV, _abi.F_RETV
B_DATA = _abi.B_DATA


class SiteMismatch(Exception):
  """A call frame whose buffers are not what its spec says (never a user's
  error: the computation fails with it)."""



class Site:
  """One call site's host side, as the handler runs it: ``host`` (the host
  function) called with the operands read from the frame, its results
  written back (:meth:`run`, specialised when first run)."""
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
    # (host, view, shift, dtype, count, shape) of the common site, which the
    # handler runs itself once checked (:func:`_inline`); else None.
    self.inline = None
    # The same for the compiled entry (:func:`compiled`).
    self.compiled = None
    # ``match(argv, retv, nargs, nrets)``: whether a frame's buffers are
    # this site's (number, dtype, dims), checked on every call before a
    # byte of them is read (:func:`matcher`); ``sig``: the same as the
    # compiled entry checks it (:func:`signature`).
    self.match = matcher(avals_in, avals_out)
    self.sig = signature(avals_in, avals_out)

  def _first_run(self, frame: int) -> int:
    problem = _abi.check_frame(frame) or self._check(frame)
    if problem:
      raise SiteMismatch(problem)
    self.run = runner(self)
    self.inline = inline(self)
    self.compiled = compiled(self.inline, self.sig)
    return self.run(frame)

  def _check(self, frame: int) -> str | None:
    """What differs between the frame's buffers and this site's spec."""
    return mismatch(self.what, self.avals_in, self.avals_out, frame)


def mismatch(site_what: str, avals_in, avals_out, frame: int) -> str | None:
  """What differs between the frame's buffers and a site's avals (None:
  nothing)."""
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


#: (dtype code, rank) of an ``XLA_FFI_Buffer`` at its address
#: (``ffi_abi.B_DTYPE``, ``B_RANK``: bytes 16 and 32).
_CODE_RANK = struct.Struct("<16xi12xq").unpack_from
#: The same and its dims' address (``B_DIMS``: byte 40).
_CODE_RANK_DIMS = struct.Struct("<16xi12xqQ").unpack_from


def matcher(avals_in, avals_out):
  """``match(argv, retv, nargs, nrets)``: whether a frame with these
  argument and result lists has this site's buffers (their number, and the
  XLA dtype code and dims of every one; a token's code only). The handler
  calls it on every call, before it reads a byte of a buffer: a frame that
  does not fit (a module whose custom call's operands are not what its key
  names) fails with :class:`SiteMismatch`, never reads past a buffer."""
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


def signature(avals_in, avals_out) -> bytes:
  """What the compiled entry checks a frame's buffers against
  (``_trampoline.c``, ``frame_matches``): int64 words ``nargs, nrets``,
  then for each argument and result its dtype code, rank (-1: a token,
  its code only) and dims."""
  words = [len(avals_in), len(avals_out)]
  for aval in (*avals_in, *avals_out):
    if aval is None:
      words += [_abi.DTYPE_TOKEN, -1]
    else:
      dtype, shape = aval
      words += [_abi.DTYPES.get(dtype, -1), len(shape), *shape]
  return struct.pack(f"<{len(words)}q", *words)


# NumPy scalars of the partition-id values seen (immutable; a carrier's
# value names its execution, ``_runtime/token_value``: made anew each call,
# never kept).
partition_ids: dict[int, np.uint32] = {}


#: memoryview formats of the dtypes whose 0-d operands are read as one
#: value (``np.array(value, dtype)`` is a third of a buffer copy's cost).
_SCALAR_FORMATS = {"bool": "?", "int8": "b", "uint8": "B", "int16": "h",
                   "uint16": "H", "int32": "i", "uint32": "I", "int64": "q",
                   "uint64": "Q", "float32": "f",
                   "float64": "d"}
_typed_views: dict[str, memoryview] = {}


def _typed(fmt: str) -> memoryview:
  view = _typed_views.get(fmt)
  if view is None:
    view = _typed_views[fmt] = _abi.mem8.cast(fmt)
  return view


def _scalar(cache: dict | None, dtype):
  """``read(address)``: a NumPy scalar (``cache``d by value, if given) of a
  0-d ``dtype`` operand passed as a scalar (the carrier, a partition id)."""
  view = _typed(_SCALAR_FORMATS[dtype.name])
  shift = dtype.itemsize.bit_length() - 1
  make = dtype.type
  if cache is None:
    return lambda address: make(view[address >> shift])

  def read(address):
    v = view[address >> shift]
    s = cache.get(v)
    if s is None:
      s = cache[v] = make(v)
    return s
  return read


def _reader(aval, scalar: bool):
  """``read(address)``: the operand at ``address`` as the host function
  receives it: a NumPy scalar (``scalar``: the carrier, a partition id),
  else a NumPy array of its own (the host function may keep it)."""
  dtype, shape = aval
  if scalar and shape == () and dtype in (np.int32, np.uint32):
    return _scalar(None if dtype == np.int32 else partition_ids, dtype)
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


def runner(site) -> Callable[[int], int]:
  """``run(frame)`` of a checked site: reads the operands, calls the host
  function, writes its results (the handler runs the common site itself,
  :func:`inline`)."""
  host = site.host
  ins = [(i, _reader(a, i in site.scalars)) for i, a in
         enumerate(site.avals_in) if a is not None]
  outs = [(i, _writer(a)) for i, a in enumerate(site.avals_out)
          if a is not None]
  # The general case: every operand and result through its reader/writer.

  # (no reference to the site itself: it holds this function)
  match, what = site.match, site.what
  avals_in, avals_out = site.avals_in, site.avals_out
  F_NARGS, F_NRETS = _abi.F_NARGS, _abi.F_NRETS

  def run(frame):
    f = frame >> 3
    if not match(mem64[f + F_ARGV], mem64[f + F_RETV], mem64[f + F_NARGS],
                 mem64[f + F_NRETS]):
      raise SiteMismatch(mismatch(what, avals_in, avals_out, frame) or
                         f"{what}: a call frame that does not fit its site")
    argv = mem64[f + F_ARGV] >> 3
    out = host(*[read(mem64[(mem64[argv + i] >> 3) + B_DATA])
                 for i, read in ins])
    retv = mem64[f + F_RETV] >> 3
    for (i, write), value in zip(outs, out):
      write(mem64[(mem64[retv + i] >> 3) + B_DATA], value)
    return 0
  return run


def _common(site) -> bool:
  """The common site: the carrier and one operand in (and a per-device
  call's partition id), the carrier out (``print``, ``log``, a
  ``callback`` without results)."""
  i32, u32 = (np.dtype(np.int32), ()), (np.dtype(np.uint32), ())
  ins = site.avals_in
  if len(ins) == 3:   # (the partition id last)
    if ins[2] != u32 or 2 not in site.scalars:
      return False
    ins = ins[:2]
  return (len(ins) == 2 and len(site.avals_out) == 1
          and ins[0] == i32 and site.avals_out[0] == i32
          and ins[1] is not None and 0 in site.scalars
          and 1 not in site.scalars)


def inline(site):
  """What the handler needs to run a common site itself, with no frame of
  its own (:func:`_handle`): ``(host, view, shift, dtype, count, shape,
  per_device)``, ``view`` a typed view of memory for a 0-d operand read as
  one value (else None: a buffer copy of ``count`` elements, reshaped to
  ``shape`` unless None), ``per_device``: a partition id follows; None for
  any other site, or an operand of a sub-byte dtype or with no elements."""
  if not _common(site):
    return None
  per_device = len(site.avals_in) == 3
  dtype, shape = site.avals_in[1]
  count = int(np.prod(shape, dtype=np.int64))
  if not count or dtype in _abi.SUB_BYTE:
    return None
  if shape == () and dtype.name in _SCALAR_FORMATS:
    return (site.host, _typed(_SCALAR_FORMATS[dtype.name]),
            dtype.itemsize.bit_length() - 1, dtype, 1, None, per_device)
  return (site.host, None, 0, dtype, count,
          None if len(shape) == 1 else shape, per_device)


def compiled(inline, sig: bytes) -> tuple | None:
  """What the compiled entry (``ffi_abi.ENTRY``, ``_trampoline.c``) needs to
  run a common site itself: ``(host, shape, dtype, nbytes, per_device,
  sig)``, the operand made as ``numpy.empty(shape, dtype)`` and its
  ``nbytes`` copied in (the bits as they are, a NaN's payload too), once
  the frame's buffers matched ``sig`` (:func:`signature`); None where
  :func:`inline` is."""
  if inline is None:
    return None
  host, view, _, dtype, count, shape, per_device = inline
  if view is not None:
    shape = ()
  elif shape is None:
    shape = (count,)
  return (host, tuple(shape), dtype, count * dtype.itemsize, per_device,
          sig)
