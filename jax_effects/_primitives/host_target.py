"""jax_effects' FFI target: one process-global custom call for every host call.

Every effect lowered for CPU is one custom call to :data:`TARGET`, an XLA
FFI handler registered once per process (``ffi_abi.handler_capsule``,
written in Python: no C compiler), with two string attributes:

* ``jax_effects_key``: names the call site's host side. A :class:`Site`
  (the host function and how to read its operands and write its results) is
  bound to each key in this process (:data:`_sites`); the handler looks the
  key up on every call.
* ``jax_effects_spec``: the site spec (``host_specs``) the key was made
  from. A key not bound here (a module from another process: an exported
  one, or an executable whose host side is gone) is bound on its first call
  by rebuilding the site from its spec, when the spec is data
  (``host_specs``); otherwise the call's effect fails with a clear error,
  deferred like a callback's (``design/errors.md``), never an XLA error.

Keys (``design/host_target.md``): a site whose effect spec is data gets
``jfx1.D<hash of the site spec>`` (equal specs, equal host sides, in every
process); any other (*local*) ``jfx1.L<hash of its description and
layout>.<n>``, where ``n`` counts the local sites of that hash lowered in
this process (never reused; the same ``HostCallback`` lowered the same way
again gets its key again), so one program traced in the same order gets the
same keys in every process, and JAX's persistent cache hits; two different
functions never share a key in one process. A local site cannot be
exported (:func:`emit` refuses it, naming the effect and the fix).

One key, one host function (``design/host_target.md``): everything that
decides what the host side does is in the site spec the key is made from
(the ``vmap`` forms are kinds of their own, ``host_callback.wrapped_spec``);
a key arriving in a module is made again from its spec (:func:`key_problem`:
a mismatch is refused and never bound); a module's spec passes the kinds'
trace-time checks before anything is built from it; every frame's buffers
are checked against its site (:attr:`Site.match`, and ``Site.sig`` in the
compiled entry) on every call, before a byte of them is read.

Lifetime: the registry holds sites weakly; a site lives as long as one of
the executables it was lowered into (a keepalive of the lowering, which JAX
hands to the executable; never in an exported module) or the effect's
``HostCallback`` (its jaxpr) or the ``jax_effects.jit`` function that
lowered it (``keep_sites_in``; across ``jax.clear_caches()``) does; sites
rebuilt from a spec are kept in a
bounded store (:data:`REBUILT_KEPT`, the oldest dropped first) and rebuilt
again if dropped.

The handler runs on the thread XLA calls it on: the dispatching thread when
the CPU client runs the computation inline, else one of XLA's threads, whose
Python thread state it keeps (:func:`_pin`: created once per thread, not on
every call).

Part in the token calling convention: none of its own; it carries the
carrier operand and result like any other (``host_call``).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
import struct
import threading
import weakref
from typing import Callable

import numpy as np

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import ffi_abi as _abi
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._primitives import host_specs as _specs
from jax_effects._runtime import interrupts as _interrupts
from jax_effects._runtime import placement as _placement

#: The custom-call target name (CPU).
TARGET = "jax_effects_host"
KEY_ATTR = "jax_effects_key"
SPEC_ATTR = "jax_effects_spec"
#: How many sites rebuilt from a spec are kept alive (the oldest dropped
#: first; one dropped is rebuilt at its next call).
REBUILT_KEPT = 4096

mem32, mem64 = _abi.mem32, _abi.mem64
F_ARGV, F_RETV = _abi.F_ARGV, _abi.F_RETV
B_DATA = _abi.B_DATA


class UnboundHostFunction(LookupError):
  """A host call whose host side this process does not have: a named
  callback nobody registered, or a local host side that is gone."""


class SiteMismatch(Exception):
  """A call frame whose buffers are not what its spec says (never a user's
  error: the computation fails with it)."""


# --- registration ------------------------------------------------------------------

_registered = False
_unavailable: str | None = None


def unavailable() -> str | None:
  """Why this process lowers host calls to JAX's Python-callback target
  instead of :data:`TARGET` (None: the target is registered)."""
  _register()
  return _unavailable


def _register() -> None:
  global _registered, _unavailable
  if _registered:
    return
  with _lock:
    if _registered:
      return
    _unavailable = _abi.UNAVAILABLE
    if _unavailable is None:
      import jax
      try:
        capsule = _abi.handler_capsule(
            _handle, (_sites, np.empty, _uint32s, _raised))
        jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu",
                                    api_version=1)
      except Exception as err:  # noqa: BLE001 - XLA refused the handler
        _unavailable = _abi.UNAVAILABLE or (
            f"XLA refused jax_effects' FFI host target: {err}")
    _registered = True


# --- sites --------------------------------------------------------------------------

_lock = threading.RLock()
#: key (bytes) -> weak reference to its Site.
_sites: dict[bytes, weakref.ref] = {}
#: HostCallback -> {site spec text: Site}: a site lives while its effect does.
_holders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: Sites rebuilt from a spec, most recently bound last.
_rebuilt: "collections.OrderedDict[bytes, Site]" = collections.OrderedDict()
#: Local sites given a key, per hash of their description.
_local_counts: dict[str, int] = {}


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
    # The same for the compiled entry (:func:`_compiled`).
    self.compiled = None
    # ``match(argv, retv, nargs, nrets)``: whether a frame's buffers are
    # this site's (number, dtype, dims), checked on every call before a
    # byte of them is read (:func:`_matcher`); ``sig``: the same as the
    # compiled entry checks it (:func:`_signature`).
    self.match = _matcher(avals_in, avals_out)
    self.sig = _signature(avals_in, avals_out)

  def _first_run(self, frame: int) -> int:
    problem = _abi.check_frame(frame) or self._check(frame)
    if problem:
      raise SiteMismatch(problem)
    self.run = _runner(self)
    self.inline = _inline(self)
    self.compiled = _compiled(self.inline, self.sig)
    return self.run(frame)

  def _check(self, frame: int) -> str | None:
    """What differs between the frame's buffers and this site's spec."""
    return _mismatch(self.what, self.avals_in, self.avals_out, frame)


def _mismatch(site_what: str, avals_in, avals_out, frame: int) -> str | None:
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


def _matcher(avals_in, avals_out):
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


def _signature(avals_in, avals_out) -> bytes:
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
_uint32s: dict[int, np.uint32] = {}


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
    return _scalar(None if dtype == np.int32 else _uint32s, dtype)
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
  """``run(frame)`` of a checked site: reads the operands, calls the host
  function, writes its results (the handler runs the common site itself,
  :func:`_inline`)."""
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


def _common(site: Site) -> bool:
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


def _inline(site: Site):
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


def _compiled(inline, sig: bytes) -> tuple | None:
  """What the compiled entry (``ffi_abi.ENTRY``, ``_trampoline.c``) needs to
  run a common site itself: ``(host, shape, dtype, nbytes, per_device,
  sig)``, the operand made as ``numpy.empty(shape, dtype)`` and its
  ``nbytes`` copied in (the bits as they are, a NaN's payload too), once
  the frame's buffers matched ``sig`` (:func:`_signature`); None where
  :func:`_inline` is."""
  if inline is None:
    return None
  host, view, _, dtype, count, shape, per_device = inline
  if view is not None:
    shape = ()
  elif shape is None:
    shape = (count,)
  return (host, tuple(shape), dtype, count * dtype.itemsize, per_device,
          sig)


def _raised(exc: BaseException) -> int:
  """The XLA error for an exception out of the handler or a host function
  (an interrupt, or a bug of ours: users' errors are deferred): what
  :func:`_handle` returns, and the compiled entry for a site it ran."""
  try:
    return _abi.error(f"jax_effects host target: {type(exc).__name__}: "
                      f"{exc}")
  except BaseException:  # noqa: BLE001 - never out of a C callback
    return 0


def _bind(key: bytes, site: Site) -> None:
  """Binds ``key`` to ``site`` (weakly; under the lock)."""
  def dropped(ref, key=key, lock=_lock, sites=_sites):
    # (the lock and dict bound here: at interpreter exit the module's
    # globals may already be gone)
    with lock:
      if sites.get(key) is ref:
        del sites[key]
  _sites[key] = weakref.ref(site, dropped)


def _bound(key: bytes) -> Site | None:
  ref = _sites.get(key)
  return None if ref is None else ref()


# --- the handler --------------------------------------------------------------------

class _Pinned(threading.local):
  """``done``: this thread's Python thread state is kept (:func:`_pin`);
  unset on a thread whose state ctypes made for this call alone."""


_pinned = _Pinned()
_ensure = None


def _pin() -> None:
  """Keeps the Python thread state of an XLA thread calling the handler:
  ctypes creates one for a thread without one on every call and deletes it
  after (a dozen microseconds a call); one more ``PyGILState_Ensure``,
  never released, keeps it (one per XLA thread, for the process's life).
  Threads Python started have theirs already."""
  global _ensure
  thread = threading._active.get(threading.get_ident())
  if thread is None or isinstance(thread, threading._DummyThread):
    if _ensure is None:
      import ctypes
      _ensure = ctypes.pythonapi.PyGILState_Ensure
    _ensure()
  _pinned.done = True


mem8 = _abi.mem8


#: The words of a call frame the handler reads, at once: extension_start,
#: args.size, args.args, rets.size, rets.rets, attrs.size, attrs.types,
#: attrs.attrs (``ffi_abi.F_EXTENSION``, ``F_NARGS``, ``F_ARGV``,
#: ``F_NRETS``, ``F_RETV``, ``F_NATTRS``, ``F_ATTR_TYPES``, ``F_ATTRV``).
_FRAME = struct.Struct("<8xQ40xQ8xQ16xQ8xQ16xQQ8xQ")


def _handle(frame, mem64=mem64, mem32=mem32, mem8=mem8, sites=_sites,
            pinned=_pinned,
            pids=_uint32s, uint32=np.uint32, array=np.array,
            frombuffer=np.frombuffer, fields=_FRAME.unpack_from):
  """The FFI handler (see the module docstring): the address of an
  ``XLA_FFI_Error``, or 0. It runs on every host call, so a common site
  (:func:`_inline`) is run here, with no frame of its own; any other through
  its ``Site.run``. (Names bound as defaults, local to the frame; a
  buffer's data address is its word ``ffi_abi.B_DATA``, 3.)"""
  try:
    pinned.done
  except AttributeError:
    _pin()
  try:
    (extension, nargs, argv, nrets, retv, nattrs, types,
     attrv) = fields(mem8, frame)
    if extension:   # XLA's metadata query (registration)
      _abi.answer_metadata(frame)
      return 0
    if nattrs != 2 or mem32[types >> 2] != 4:
      raise SiteMismatch("a call of jax_effects' host target with "
                         "attributes it does not know")
    # The key: attribute 0 (attributes are sorted by name), a byte span.
    a = mem64[attrv >> 3] >> 3
    p = mem64[a]
    key = bytes(mem8[p:p + mem64[a + 1]])
    ref = sites.get(key)
    site = None if ref is None else ref()
    if site is None:
      site = _cold(frame, key)
    inline = site.inline
    if inline is None:
      return site.run(frame)   # (which checks the frame's buffers first)
    if not site.match(argv, retv, nargs, nrets):
      raise SiteMismatch(site._check(frame) or f"{site.what}: a call frame "
                         f"that does not fit its site")
    host, view, shift, dtype, count, shape, per_device = inline
    argv >>= 3
    carrier = mem32[mem64[(mem64[argv] >> 3) + 3] >> 2]   # (an int, as
    # the compiled entry passes it: the host functions read it by index)
    address = mem64[(mem64[argv + 1] >> 3) + 3]
    if view is not None:
      v = view[address >> shift]
      if v != v:   # (a NaN: copied as it is, its payload bits kept)
        return site.run(frame)
      x = array(v, dtype)
    elif shape is None:
      x = frombuffer(mem8, dtype, count, address).copy()
    else:
      x = frombuffer(mem8, dtype, count, address).reshape(shape).copy()
    if per_device:
      pid = mem32[mem64[(mem64[argv + 2] >> 3) + 3] >> 2] & 0xFFFFFFFF
      partition = pids.get(pid)
      if partition is None:
        partition = pids[pid] = uint32(pid)
      out = host(carrier, x, partition)
    else:
      out = host(carrier, x)
    mem32[mem64[(mem64[retv >> 3] >> 3) + 3] >> 2] = out[0]
    return 0
  except BaseException as exc:  # noqa: BLE001 - never out of a C callback
    return _raised(exc)


_interrupts.entry_frame(_handle)


def _cold(frame: int, key: bytes) -> Site:
  """The site of a key not bound in this process, rebuilt from the call's
  spec (and bound), or one whose effect fails with the reason it cannot be."""
  problem = _abi.check_frame(frame)
  if problem:
    raise SiteMismatch(problem)
  attrs = _abi.attr_strings(frame)
  if attrs is None or set(attrs) != {KEY_ATTR, SPEC_ATTR} or (
      attrs[KEY_ATTR].encode() != key):
    raise SiteMismatch("a call of jax_effects' host target with attributes "
                       "it does not know")
  text = attrs[SPEC_ATTR]
  problem = key_problem(key, text)
  if problem:   # (never bound: the key keeps naming what its spec says)
    raise SiteMismatch(problem)
  with _lock:
    site = _bound(key)
    if site is not None:
      return site
    site, failing = _rebuild(key, text)
    if not failing:   # (a failing one is made again: a later registration
      _bind(key, site)   # of a named callback makes it run)
      _rebuilt[key] = site
      while len(_rebuilt) > REBUILT_KEPT:
        _rebuilt.popitem(last=False)
  return site


def key_of(text: str, local_n: int | None = None) -> bytes:
  """The key of the site spec ``text``: a data site's (``local_n`` None),
  or the ``local_n``-th local site of that spec."""
  if local_n is None:
    return ("jfx1.D" + _specs.digest(text)).encode()
  return f"jfx1.L{_specs.digest(text, 20)}.{local_n}".encode()


_LOCAL_KEY = re.compile(rb"jfx1\.L([0-9a-f]{20})\.(0|[1-9][0-9]{0,17})")


def key_problem(key: bytes, text: str) -> str | None:
  """Why ``key`` is not the key of the spec ``text`` it arrived with (a
  module from elsewhere: exported, cached, or corrupt), or None. The key is
  made again from the spec: a data spec's hash; a local spec's hash and a
  count (such a site is never rebuilt, only named)."""
  shown = key.decode("utf-8", "replace")[:80]
  try:
    spec = json.loads(text)
    local = isinstance(spec, dict) and isinstance(spec.get("effect"), dict) \
        and "local" in spec["effect"]
  except ValueError:
    return (f"a call of jax_effects' host target whose spec is not JSON "
            f"(key {shown!r}): refused")
  if local:
    m = _LOCAL_KEY.fullmatch(key)
    if m is not None and m.group(1).decode() == _specs.digest(text, 20):
      return None
  elif key == key_of(text):
    return None
  return (f"a call of jax_effects' host target whose key {shown!r} is not "
          f"the key of the spec it carries (a corrupt or foreign module): "
          f"refused, and the key left unbound")


def _rebuild(key: bytes, text: str) -> tuple[Site, bool]:
  """``(site, failing)`` rebuilt from the spec ``text``; a failing site's
  effect reports why it cannot run (``UnboundHostFunction``, deferred as a
  callback's error)."""
  try:
    spec = json.loads(text)
    if spec.get("v") != _specs.VERSION:
      raise ValueError(f"spec version {spec.get('v')!r}, this jax_effects "
                       f"writes {_specs.VERSION}")
    site_spec = spec["site"]
    avals_in = [_specs.decode_aval(a) for a in site_spec["in"]]
    avals_out = [_specs.decode_aval(a) for a in site_spec["out"]]
    where = _decode_where(site_spec["where"])
    passthrough = int(site_spec["passthrough"])
    results = [_aval_of(a) for a in avals_out if a is not None]
  except Exception as err:  # noqa: BLE001 - a spec this version cannot read
    raise SiteMismatch(f"a call site spec jax_effects cannot read ({err})")
  effect = spec.get("effect") or {}
  failing = False
  try:
    if "local" in effect:
      raise UnboundHostFunction(
          f"{effect['local']}: its host function is a Python object of the "
          f"process that lowered it and is not bound in this one (its "
          f"executable outlived it, or the module came from another "
          f"process)")
    host_callback = _specs.rebuild_effect(effect)
    host_callback = dataclasses.replace(
        host_callback, chain=_decode_chain(site_spec.get("chain")),
        cleanup=bool(site_spec.get("cleanup", False)))
  except Exception as err:  # noqa: BLE001 - this effect fails, the rest runs
    what = effect.get("what") or effect.get("local") or "a jax_effects effect"
    exc = err if isinstance(err, UnboundHostFunction) else (
        UnboundHostFunction(f"{what} cannot run in this process: {err}"))

    def fail(*args):
      raise exc
    host_callback = _host_callback.HostCallback(
        fail, what, tuple(results[passthrough:]))
    failing = True
  host = _host_functions.host_function(
      host_callback, where, passthrough=passthrough,
      threaded=bool(site_spec["threaded"]), avals_out=results,
      entry=bool(site_spec["entry"]), operands=site_spec.get("operands"))
  site = Site(key, text, host_callback.description, host, avals_in, avals_out,
              _scalars(site_spec, avals_in, where))
  return site, failing


def _encode_chain(chain):
  """A chain key as data: an ``Effect``'s name, or None (unordered, or
  not on a chain)."""
  return chain.name if isinstance(chain, _effects.Effect) else None


def _decode_chain(name):
  return _effects.UNORDERED if name is None else _effects.Effect(name)


def _results_avals(avals_out):
  return [_aval_of(a) for a in avals_out if a is not None]


def _aval_of(decoded):
  import jax
  dtype, shape = decoded
  return jax.core.ShapedArray(shape, dtype)


def _n_tokens(avals) -> int:
  return sum(1 for a in avals if a is None)


def _scalars(site_spec, avals_in, where) -> frozenset:
  """Operand positions passed as NumPy scalars: the 0-d passthrough ones
  (the carrier) and a per-device call's partition id (the last)."""
  tokens = _n_tokens(avals_in)
  out = {tokens + i for i in range(site_spec["passthrough"])
         if avals_in[tokens + i][1] == ()}
  if where.table is not None:
    out.add(len(avals_in) - 1)
  return frozenset(out)


# --- lowering -----------------------------------------------------------------------

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _encode_where(where: _placement.Where) -> dict:
  def one(p):
    shard = p.shard_index
    return [p.device_id, list(shard) if isinstance(shard, tuple) else shard,
            p.process_index]
  if where.table is not None:
    return {"table": [one(p) for p in where.table]}
  return {"fixed": None if where.fixed is None else one(where.fixed)}


def _decode_where(data) -> _placement.Where:
  def one(p):
    device, shard, process = p
    return _placement.Placement(
        device, tuple(shard) if isinstance(shard, list) else shard, process)
  if "table" in data:
    return _placement.Where(None, tuple(one(p) for p in data["table"]))
  fixed = data["fixed"]
  return _placement.Where(None if fixed is None else one(fixed), None)


def _physical(aval):
  """What the custom call passes for ``aval`` (a token stays a token)."""
  if getattr(aval, "dtype", None) is None:
    return aval
  return _compat.physical_aval(aval)


def site_spec(side, avals_in, avals_out) -> tuple[dict, str | None]:
  """``(spec, why_local)``: the site spec of ``side`` lowered with these
  custom-call avals; ``why_local`` says why its host side is not data
  (None: it is)."""
  host_callback = side.host_callback
  effect = host_callback.spec
  why = None
  if not isinstance(effect, dict):
    why = effect if isinstance(effect, str) else (
        "its host side is a Python function of this process")
    effect = {"local": _ADDRESS.sub("", host_callback.description)}
  site = {"in": [_specs.encode_aval(_physical(a)) for a in avals_in],
          "out": [_specs.encode_aval(_physical(a)) for a in avals_out],
          "where": _encode_where(side.where), "passthrough": side.passthrough,
          "threaded": side.threaded, "entry": side.entry,
          "operands": side.operands,
          # (the chain names what the host keeps for an execution: two
          # sites of one effect on two chains are two sites)
          "chain": _encode_chain(host_callback.chain),
          "cleanup": bool(host_callback.cleanup)}
  return {"v": _specs.VERSION, "effect": effect, "site": site}, why


def _site_for(side, avals_in, avals_out, for_export: bool) -> Site:
  """The site of ``side`` (bound to its key, made if new)."""
  try:
    spec, why = site_spec(side, avals_in, avals_out)
  except _specs.NotData as err:
    spec, why = None, f"it has {err}"
  description = side.host_callback.description
  if for_export and why is not None:
    raise NotExportable(description, why)
  if spec is None:   # (symbolic shapes: never lowered for execution)
    raise NotExportable(description, why)
  text = _specs.dumps(spec)
  with _lock:
    held = _holders.setdefault(side.host_callback.root, {})
    site = held.get(text)
    if site is not None and _bound(site.key) is site:
      return site
    if why is None:
      key = key_of(text)
      site = _bound(key)
    else:
      h = _specs.digest(text, 20)
      n = _local_counts.get(h, 0)
      _local_counts[h] = n + 1
      key = key_of(text, n)
      site = None
    if site is None:
      decoded_in = [_specs.decode_aval(a) for a in spec["site"]["in"]]
      decoded_out = [_specs.decode_aval(a) for a in spec["site"]["out"]]
      host = side.function([a for a in avals_out
                            if getattr(a, "dtype", None) is not None])
      site = Site(key, text, description, host, decoded_in, decoded_out,
                  _scalars(spec["site"], decoded_in, side.where))
      _bind(key, site)
    held[text] = site
  return site


class NotExportable(ValueError):
  """An effect whose host side only its own process has, lowered for
  ``jax.export``."""

  def __init__(self, what: str, why: str):
    fix = ("give it a stable name, jax_effects.callback("
           "jax_effects.register_callback('my_callback', fn), ...), and "
           "register the function under that name in the process that calls "
           "the exported function too: "
           "jax_effects.register_callback('my_callback', fn)"
           if what.startswith("jax_effects.callback") else
           "export the function without it, or run it around the exported "
           "call")
    super().__init__(
        f"jax.export cannot export {what}: {why}, which another process "
        f"cannot rebuild. Fix: {fix}.")


_lowerings: dict = {}


class _Owner(threading.local):
  """Where the sites lowered on this thread are kept strongly: the kept
  traces of the ``jax_effects.jit`` function whose program was traced last
  on it (``keep_sites_in``, set by its bodies when ``jax.jit`` traces them;
  the lowering follows on the same thread). ``jax.jit``'s C++ dispatch runs
  an executable long after the Python objects of its lowering (and their
  keepalives) may have gone, as long as the function's ``jax.jit`` objects
  live: so do its sites. (A lowering of no function of ours, plain
  ``jax.jit`` code, keeps them in the last one traced: longer than needed,
  never shorter.)"""
  holder = None   # (a weak reference to an object with ``sites``)


_owner = _Owner()


def keep_sites_in(owner) -> None:
  """The sites lowered next on this thread are kept in ``owner.sites`` (a
  set), while ``owner`` lives (held weakly here)."""
  _owner.holder = weakref.ref(owner)


def emit(ctx, side, operands, sharding) -> list:
  """Emits the custom call of ``side`` (a ``host_call.HostSide``) to
  :data:`TARGET` in ``ctx`` (whose avals are the call's: tokens included);
  returns its results."""
  import jax
  for_export = _compat.lowering_for_export(ctx)
  site = _site_for(side, ctx.avals_in, ctx.avals_out, for_export)
  if not for_export:   # (jax.export refuses keepalives: rebuilt there)
    _compat.keep_alive_with_executable(ctx, site)
    holder = _owner.holder
    owner = None if holder is None else holder()
    if owner is not None:
      owner.sites.add(site)
  lower = _lowerings.get(TARGET)
  if lower is None:
    lower = _lowerings[TARGET] = jax.ffi.build_ffi_lowering_function(
        TARGET, has_side_effect=True)
  op = lower(ctx, *operands, **{KEY_ATTR: site.key.decode(),
                                SPEC_ATTR: site.spec})
  if sharding is not None:
    _compat.set_sharding(ctx.module_context, op, sharding)
  return op.results


# Registered when jax_effects is imported: a process that only runs modules
# exported or cached by another one has lowered nothing of ours.
_register()
