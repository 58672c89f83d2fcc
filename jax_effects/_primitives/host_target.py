"""jax_effects' FFI target: one process-global custom call for every host call.

Every effect lowered for CPU is one custom call to :data:`TARGET` with two
string attributes: ``jax_effects_key``, bound in this process to a
:class:`Site` (:data:`_sites`, held weakly), and ``jax_effects_spec``,
the site spec the key was made from. A key not bound here is rebuilt from
its spec on its first call, or its effect fails with a deferred error.
Registry, lifetime and handler: ``design/host_target.md``. Four parts:

* A :class:`Site` is what a key is bound to: its host function and, in
  :attr:`Site.c`, everything ``_trampoline.c`` (:data:`ENTRY`, the one
  entry XLA calls) needs, made here when the site is made: the description
  it checks every call frame against before it reads a byte (per buffer
  its kind, XLA dtype code, rank, byte size and dims), how it hands each
  operand over (:data:`INT`, :data:`ARRAY`, :data:`BYTES`), and the site's
  one runner, which it calls with the operands and whose results it writes
  back.
* Keys and site specs. A site spec (:func:`site_spec`) names everything
  that decides what a host side does; its key is made from it
  (``design/host_target.md``, "Keys"): ``jfx1.D<hash>`` when its effect
  spec is data, else (a *local* site) ``jfx1.L<hash>.<n>``. A key arriving
  in a module is checked against its spec (:func:`key_problem`) before a
  site is rebuilt (:func:`rebuild`); a local site is never rebuilt, nor
  exported (:class:`NotExportable`), nor reached by an exported module:
  every key of a module called here that is not a data key becomes
  ``jfx1.F<hash>`` (:func:`foreign_key`), which no site is ever bound to.
* The registry (:data:`_sites`), the handler's cold path (:func:`_cold`),
  the screening of modules from elsewhere (:func:`screen_module`) and
  :func:`emit_own`.
* Which custom call: :func:`emit` (and :func:`emit_ordered` under plain
  ``jax.jit``, with JAX's compiler token) emits a :class:`HostSide`'s host
  function as jax_effects' own FFI target on CPU (:func:`emit_own`; see
  :func:`_own_target`), else as one of JAX's callback targets
  (``design/host_target.md``, "Which custom call, by platform").

Part in the token calling convention: the call takes the chain's carrier
as an operand and returns it (the data dependency that orders the calls);
on our target the carrier is one of a site's passthrough operands
(:class:`Site`), arriving (with a partition id) as a Python int, its
result written as an int32.

Program order across ordered-effect kinds under plain ``jax.jit``. JAX
gives each ordered effect kind its own compiler-token chain: ours
(``PLAIN_JIT_ORDER``), ``jax.debug.*(ordered=True)``'s and
``io_callback(ordered=True)``'s. The chains are mutually unordered, so XLA
may run an effect of one kind before an earlier effect of another, in an
order that changes from one process to the next. So where a function
lowered by plain ``jax.jit`` holds ``PLAIN_JIT_ORDER``, every ordered host
call in it is a *join*: it takes the ``after_all`` of every ordered
chain's current token and hands its returned token to every chain
(:func:`join`, :func:`set_joined`). Our lowering rules do it, and JAX's
own ordered callbacks' rules are wrapped to do it
(:func:`in_program_order`); a region without ``PLAIN_JIT_ORDER`` lowers
exactly as JAX lowers it. A control-flow region carries each chain's
token in and out, so joins at every level give program order through
loops, branches and nested functions. From JAX 0.10 an uncacheable rule
sees every ordered token of its region (``_compat.RULES_SEE_EVERY_TOKEN``);
JAX 0.8/0.9 show a rule its own only, and there the chains stay as JAX
orders them (``design/errors.md``). Inside ``jax_effects.jit`` none of
this applies: JAX's callbacks are adopted into one chain by the token
pass.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib.machinery
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import pathlib
import re
import struct
import sys
import threading
from typing import Any, Callable
import weakref

import jax
from jax.interpreters import mlir
import numpy as np

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._core import effects as _effects
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._primitives import host_specs as _specs
from jax_effects._runtime import interrupts as _interrupts
from jax_effects._runtime import placement as _placement


# --- the entry and a site's one description for it ---------------------------

def _installed_entry():
  """The compiled entry of the installed ``jax_effects`` distribution,
  loaded as ``_trampoline``, where the imported ``jax_effects`` is another
  copy (a source tree, imported in its own folder: the README's first
  command, run in the checkout after ``pip install .``; ``python -m`` puts
  the working folder first on ``sys.path``, and a clean tree has no
  compiled parts) that lacks it and the distribution holds the C source it
  was built from, byte for byte the imported tree's; else None."""
  module = f"{__package__}._trampoline"
  here = pathlib.Path(__file__).parent
  try:
    source = (here / "_trampoline.c").read_bytes()
  except OSError:   # (no C source beside the module: nothing to compare)
    return None
  stem = module.replace(".", "/")
  for dist in importlib.metadata.distributions(name="jax_effects"):
    try:
      files = {str(f): f for f in dist.files or ()}
      if f"{stem}.c" not in files:
        continue
      built = next((files[stem + suffix] for suffix
                    in importlib.machinery.EXTENSION_SUFFIXES
                    if stem + suffix in files), None)
      if built is None:
        continue
      path = pathlib.Path(dist.locate_file(built))
      if (path.parent.resolve() == here.resolve()
          or pathlib.Path(dist.locate_file(files[f"{stem}.c"])).read_bytes()
          != source):
        continue
      spec = importlib.util.spec_from_file_location(
          module, path,
          loader=importlib.machinery.ExtensionFileLoader(module, str(path)))
      loaded = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(loaded)
    except (OSError, ImportError, ValueError):
      continue
    sys.modules[module] = loaded
    setattr(sys.modules[__package__], "_trampoline", loaded)
    return loaded
  return None


def _entry():
  try:
    from jax_effects._primitives import _trampoline
    return _trampoline
  except ImportError:
    # (a checkout's source tree, imported in its folder after
    # ``pip install .``: the installed copy's, built from the same source)
    found = _installed_entry()
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
  """One call site's host side (module docstring): ``side``'s (a
  :class:`HostSide`) lowered under the key ``key`` of the site spec text
  ``spec``, whose avals ``avals_in`` and ``avals_out`` are decoded
  (:func:`decoded`). Passed as Python ints: 0-d passthrough operands (the
  carrier) and the partition id."""
  __slots__ = ("key", "spec", "what", "c", "__weakref__")

  def __init__(self, key: bytes, spec: str, side, avals_in: list,
               avals_out: list):
    self.key = key
    self.spec = spec
    self.what = side.host_callback.description
    host = side.function(_results(avals_out))
    tokens = avals_in.count(None)
    scalars = {tokens + i for i in range(side.passthrough)
               if avals_in[tokens + i][1] == ()}
    if side.where.table is not None:
      scalars.add(len(avals_in) - 1)
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


def decoded(site: dict) -> tuple[list, list]:
  """A site spec's ``"in"`` and ``"out"`` avals: ``(dtype, shape)``, or
  None for a token."""
  return tuple([_specs.decode_aval(a) for a in site[k]] for k in ("in", "out"))


def _results(avals: list) -> list:
  """The arrays of decoded ``avals`` (tokens left out)."""
  return [jax.core.ShapedArray(shape, dtype) for dtype, shape in filter(None, avals)]


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


# --- keys and site specs -----------------------------------------------------

class UnboundHostFunction(LookupError):
  """A host call whose host side this process does not have: a named
  callback nobody registered, or a local host side that is gone."""


#: Mixed into local keys' hashes where a module called here cannot be
#: screened (:func:`foreign_key`; ``_compat.screen_exported_calls``): a
#: secret of this process, so no module can carry one of its local keys
#: (the cost: a local effect's module text, so JAX's persistent cache key,
#: then differs between processes). Empty where modules are screened.
_LOCAL_SALT = "" if _compat.call_exported_p is not None else os.urandom(16).hex()


def local_hash(text: str) -> str:
  """The hash part of the keys of local site spec ``text``."""
  return _specs.digest(_LOCAL_SALT + text, 20)


def key_of(text: str, local_n: int | None = None) -> bytes:
  """The key of the site spec ``text``: a data site's (``local_n`` None),
  or the ``local_n``-th local site of that spec."""
  if local_n is None:
    return ("jfx1.D" + _specs.digest(text)).encode()
  return f"jfx1.L{local_hash(text)}.{local_n}".encode()


_DATA_KEY = re.compile(rb"jfx1\.D[0-9a-f]{32}")
_LOCAL_KEY = re.compile(rb"jfx1\.L([0-9a-f]{20})\.(0|[1-9][0-9]{0,17})")
_FOREIGN_KEY = re.compile(rb"jfx1\.F([0-9a-f]{20})")


def is_data_key(key: bytes) -> bool:
  return _DATA_KEY.fullmatch(key) is not None


def foreign_key(key: bytes, text: str) -> bytes:
  """The key a host call of a module from elsewhere (an exported function
  called in this process) is given: ``key`` if it is a data key (a data
  key names one data site in every process: whatever runs under it is
  the code and data of its spec's hash), else ``jfx1.F<hash of text>``,
  a key no site is ever bound to: its effect fails with
  ``UnboundHostFunction`` (a local spec) or is refused (any other), and
  never reaches a local host function of this process, whatever key the
  module carried (``design/host_target.md``, "One key, one host
  function")."""
  return key if is_data_key(key) else f"jfx1.F{_specs.digest(text, 20)}".encode()


def key_problem(key: bytes, text: str) -> str | None:
  """Why ``key`` is not the key of the spec ``text`` it arrived with, or
  None (a local key: its hash, its count never checked; a foreign key:
  its hash)."""
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
    if m is not None and m.group(1).decode() == local_hash(text):
      return None
    m = _FOREIGN_KEY.fullmatch(key)
    if m is not None and m.group(1).decode() == _specs.digest(text, 20):
      return None
  elif key == key_of(text):
    return None
  if _FOREIGN_KEY.fullmatch(key):
    return ("a call of jax_effects' host target in a module from elsewhere "
            "whose key is not the key of the spec it carries (a corrupt or "
            "forged module; its key, not a data key, was replaced on "
            "arrival): refused")
  return (f"a call of jax_effects' host target whose key {shown!r} is not "
          f"the key of the spec it carries (a corrupt or foreign module): "
          f"refused, and the key left unbound")


def rebuild(key: bytes, text: str) -> tuple[Site, bool]:
  """``(site, failing)`` rebuilt from the spec ``text``; a failing site's
  effect raises ``UnboundHostFunction``, deferred as a callback's error."""
  try:
    spec = json.loads(text)
    if spec.get("v") != _specs.VERSION:
      raise ValueError(f"spec version {spec.get('v')!r}, this jax_effects "
                       f"writes {_specs.VERSION}")
    site_spec = spec["site"]
    avals_in, avals_out = decoded(site_spec)
    side = HostSide(None, _decode_where(site_spec["where"]),
                    int(site_spec["passthrough"]), bool(site_spec["threaded"]),
                    bool(site_spec["entry"]), site_spec.get("operands"))
    results = _results(avals_out)[side.passthrough:]
  except Exception as err:  # noqa: BLE001 - a spec this version cannot read
    raise SiteMismatch(f"a call site spec jax_effects cannot read ({err})")
  effect = spec.get("effect") or {}
  failing = False
  try:
    if "local" in effect:
      raise UnboundHostFunction(
          f"{effect['local']}: its host function is a Python object of the "
          f"process that lowered it" + (
              ", which an exported module cannot bring: a module called in "
              "this process never runs a local host function, whatever key "
              "it carries" if _FOREIGN_KEY.fullmatch(key) else
              " and is not bound in this one (its executable outlived it, "
              "or the module came from another process)"))
    chain = site_spec.get("chain")
    host_callback = dataclasses.replace(
        _specs.rebuild_effect(effect),
        chain=_effects.UNORDERED if chain is None else _effects.Effect(chain),
        cleanup=bool(site_spec.get("cleanup", False)))
  except Exception as err:  # noqa: BLE001 - this effect fails, the rest runs
    what = effect.get("what") or effect.get("local") or "a jax_effects effect"
    exc = err if isinstance(err, UnboundHostFunction) else (
        UnboundHostFunction(f"{what} cannot run in this process: {err}"))

    def fail(*args):
      raise exc
    host_callback = _host_callback.HostCallback(fail, what, tuple(results))
    failing = True
  side = dataclasses.replace(side, host_callback=host_callback)
  return Site(key, text, side, avals_in, avals_out), failing


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _encode_where(where: _placement.Where) -> dict:
  """``where`` as data: each placement's fields (JSON writes a tuple as a
  list)."""
  if where.table is not None:
    return {"table": [dataclasses.astuple(p) for p in where.table]}
  return {"fixed": None if where.fixed is None else dataclasses.astuple(where.fixed)}


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
  return aval if getattr(aval, "dtype", None) is None else _compat.physical_aval(aval)


def site_spec(side, avals_in, avals_out) -> tuple[dict, str | None]:
  """``(spec, why_local)``: the site spec of ``side`` lowered with these
  avals; ``why_local``: why its host side is not data (None: it is)."""
  host_callback = side.host_callback
  effect, chain = host_callback.spec, host_callback.chain
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
          # sites of one effect on two chains are two sites; an Effect's
          # name, or None)
          "chain": chain.name if isinstance(chain, _effects.Effect) else None,
          "cleanup": bool(host_callback.cleanup)}
  return {"v": _specs.VERSION, "effect": effect, "site": site}, why


class NotExportable(ValueError):
  """An effect whose host side only its process has, lowered for export:
  the refusal to export ``host_callback``, whose fix suggests first the
  call of jax_effects that exports in its place, where it has one (an
  adopted ``jax.debug.print``: ``jax_effects.print``)."""

  def __init__(self, host_callback, why: str):
    what = host_callback.description
    fix = ("give it a stable name, jax_effects.callback("
           "jax_effects.register_callback('my_callback', fn), ...), and "
           "register the function under that name in the process that calls "
           "the exported function too: "
           "jax_effects.register_callback('my_callback', fn)"
           if what.startswith("jax_effects.callback") else
           "export the function without it, or run it around the exported "
           "call")
    if host_callback.instead:
      fix = f"use {host_callback.instead} instead, which exports; or {fix}"
    super().__init__(
        f"jax.export cannot export {what}: {why}, which another process "
        f"cannot rebuild. Fix: {fix}.")


# --- the target, its registry of sites, emit ---------------------------------

#: The custom-call target name (CPU).
TARGET = "jax_effects_host"
KEY_ATTR = "jax_effects_key"
SPEC_ATTR = "jax_effects_spec"
#: How many sites rebuilt from a spec are kept alive (the oldest dropped
#: first).
REBUILT_KEPT = 4096
#: How many local sites lowered last under plain ``jax.jit`` (outside any
#: ``jax_effects.jit`` function, which keeps its own) are kept alive, the
#: oldest dropped first: a computation may run on after its function, its
#: caches and its executable are gone (design/host_target.md, "Registry and
#: lifetime").
LOCAL_KEPT = 4096

_unavailable: str | None = None


def unavailable() -> str | None:
  """Why :data:`TARGET` is not registered in this process (None: it is;
  registered when this module is imported, at its end)."""
  return _unavailable


_lock = threading.RLock()
#: key (bytes) -> weak reference to its Site.
_sites: dict[bytes, weakref.ref] = {}
#: HostCallback -> {site spec text: Site}: a site lives while its effect does.
_holders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: Sites rebuilt from a spec, most recently bound last (REBUILT_KEPT; a key
#: is rebuilt only while no site is bound to it).
_rebuilt: "collections.deque[Site]" = collections.deque(maxlen=REBUILT_KEPT)
#: Local sites given a key, counted per hash of their description.
_local_counts: dict = collections.defaultdict(itertools.count)
#: The local sites lowered last under plain jax.jit (LOCAL_KEPT).
_local_kept: "collections.deque[Site]" = collections.deque(maxlen=LOCAL_KEPT)


def _bind(key: bytes, site: Site) -> None:
  def dropped(ref, key=key, lock=_lock, sites=_sites):
    # (bound here: at interpreter exit the module's globals may be gone)
    with lock:
      if sites.get(key) is ref:
        del sites[key]
  _sites[key] = weakref.ref(site, dropped)


def _bound(key: bytes) -> Site | None:
  ref = _sites.get(key)
  return None if ref is None else ref()


def _cold(key: bytes, attrs: dict) -> Site:
  """The site of a key not bound here (``attrs``: the call's string
  attributes), rebuilt from the call's spec."""
  if set(attrs) != {KEY_ATTR, SPEC_ATTR} or attrs[KEY_ATTR].encode() != key:
    raise SiteMismatch(
        "a call of jax_effects' host target with attributes it does not know")
  text = attrs[SPEC_ATTR]
  problem = key_problem(key, text)
  if problem:   # (never bound: the key keeps naming what its spec says)
    raise SiteMismatch(problem)
  with _lock:
    site = _bound(key)
    if site is not None:
      return site
    site, failing = rebuild(key, text)
    # (a failing one is made again: a later registration of a named
    # callback makes it run; only a data key is ever bound from a module)
    if not failing and is_data_key(key):
      _bind(key, site)
      _rebuilt.append(site)
  return site


def _site_for(side, avals_in, avals_out,
              for_export: bool) -> Site:
  """The site of ``side`` (bound to its key, made if new)."""
  try:
    spec, why = site_spec(side, avals_in, avals_out)
  except _specs.NotData as err:
    spec, why = None, f"it has {err}"
  # (a spec of symbolic shapes is never lowered for execution)
  if spec is None or (for_export and why is not None):
    raise NotExportable(side.host_callback, why)
  text = _specs.dumps(spec)
  with _lock:
    held = _holders.setdefault(side.host_callback.origin, {})
    site = held.get(text)
    if site is not None and _bound(site.key) is site:
      return site
    if why is None:
      key = key_of(text)
      site = _bound(key)
    else:
      key = key_of(text, next(_local_counts[local_hash(text)]))
      site = None
    if site is None:
      site = Site(key, text, side, *decoded(spec["site"]))
      _bind(key, site)
    held[text] = site
  return site


def _operations(op):
  """``op`` and every operation nested in it."""
  yield op
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        yield from _operations(child.operation)


def _string(ir, attr) -> str | None:
  try:
    return ir.StringAttr(attr).value
  except ValueError:   # (not a string attribute, or not UTF-8)
    return None


_CONFIGS = ("mhlo.backend_config", "backend_config")


def _ffi_strings(ir, attrs) -> tuple[bytes, str, bool]:
  """``(key, spec, ours)`` of a custom call's FFI attributes: the two
  string attributes the handler reads (the key first by name), and
  whether they are exactly the two this package writes (``ours``);
  ``(b"", "", False)`` where they are not two strings."""
  found = None
  for name in _CONFIGS:
    if name not in attrs:
      continue
    try:
      d = ir.DictAttr(attrs[name])
    except ValueError:   # (not a dict: a string the FFI would parse, unless empty)
      if _string(ir, attrs[name]) != "":
        return b"", "", False
      continue
    if found is not None:
      return b"", "", False
    found = d
  if found is None or len(found) != 2:
    return b"", "", False
  (k, key), (s, spec) = sorted(
      (found[i].name, _string(ir, found[i].attr)) for i in range(2))
  if key is None or spec is None:
    return b"", "", False
  return key.encode(), spec, (k, s) == (KEY_ATTR, SPEC_ATTR)


def screen_module(module) -> bool:
  """Gives every host call of ``module`` (an exported function called in
  this process: a module from elsewhere) the key it may carry
  (:func:`foreign_key`: its data key, else one no site is bound to)
  and exactly the two attributes this package writes; True if it changed
  anything. So a module reaches no host function it did not bring: not a
  local one of this process, whatever key (and attribute names) it
  copied."""
  ir = mlir.ir
  changed = False
  for op in _operations(module.operation):
    if op.name != "stablehlo.custom_call":
      continue
    attrs = op.attributes
    if "call_target_name" not in attrs or _string(
        ir, attrs["call_target_name"]) != TARGET:
      continue
    key, spec, ours = _ffi_strings(ir, attrs)
    new = foreign_key(key, spec)
    if ours and new == key:
      continue
    for name in _CONFIGS:
      if name in attrs:
        del attrs[name]
    attrs["mhlo.backend_config"] = ir.DictAttr.get({
        KEY_ATTR: ir.StringAttr.get(new.decode()),
        SPEC_ATTR: ir.StringAttr.get(spec)})
    changed = True
  return changed


_compat.screen_exported_calls(screen_module)


_lowerings: dict = {}


#: ``holder``: a weak reference to the ``jax_effects.jit`` function traced
#: last on this thread, which keeps the sites lowered on it strongly (its
#: C++ dispatch may outlive the lowering's keepalives).
_owner = threading.local()


def keep_sites_in(owner) -> None:
  """The sites lowered next on this thread are kept in ``owner.sites``."""
  _owner.holder = weakref.ref(owner)


def emit_own(ctx, side, operands, sharding, side_effect: bool = True) -> list:
  """The results of the custom call of ``side`` to :data:`TARGET` (one
  XLA may not remove, unless not ``side_effect``)."""
  for_export = _compat.lowering_for_export(ctx)
  site = _site_for(side, ctx.avals_in, ctx.avals_out, for_export)
  if not for_export:   # (jax.export refuses keepalives: rebuilt there)
    _compat.keep_alive_with_executable(ctx, site)
    holder = getattr(_owner, "holder", None)
    owner = None if holder is None else holder()
    if owner is not None:
      owner.sites.add(site)
    elif not is_data_key(site.key):   # (plain jax.jit: LOCAL_KEPT)
      _local_kept.append(site)
  return custom_call(ctx, TARGET, operands, sharding, side_effect,
                     **{KEY_ATTR: site.key.decode(), SPEC_ATTR: site.spec})


def custom_call(ctx, target, operands, sharding, side_effect: bool = True,
                **attrs) -> list:
  """The results of an FFI custom call to ``target`` (side-effecting
  unless not ``side_effect``)."""
  lower = _lowerings.get((target, side_effect))
  if lower is None:
    lower = _lowerings[target, side_effect] = (
        jax.ffi.build_ffi_lowering_function(target,
                                            has_side_effect=side_effect))
  op = lower(ctx, *operands, **attrs)
  if sharding is not None:
    _compat.set_sharding(ctx.module_context, op, sharding)
  return op.results


# --- which custom call a host call lowers to; program order --------------------

# Custom-call targets of JAX's Python callbacks (jaxlib registers them).
FFI_TARGETS = {"cpu": "xla_ffi_python_cpu_callback",
                "cuda": "xla_ffi_python_gpu_callback",
                "rocm": "xla_ffi_python_gpu_callback"}


@dataclasses.dataclass(frozen=True, eq=False)
class HostSide:
  """The host side of one lowered effect: the arguments of
  ``host_functions.host_function`` (compared by identity)."""
  host_callback: Any
  where: _placement.Where
  passthrough: int
  threaded: bool
  entry: bool = False
  operands: int | None = None

  def function(self, avals_out) -> Callable:
    """The function XLA calls; ``avals_out``: passthrough ones first."""
    return _host_functions.host_function(
        self.host_callback, self.where, passthrough=self.passthrough,
        threaded=self.threaded, avals_out=avals_out, entry=self.entry,
        operands=self.operands)


def once_across_devices(ctx) -> bool:
  """Whether ``ctx`` is partitioned automatically over several devices."""
  axis_context = ctx.module_context.axis_context
  return (isinstance(axis_context, _compat.ShardingContext)
          and axis_context.num_devices > 1)


def _own_target(ctx, target) -> bool:
  """Whether the call goes to our target: on CPU, unless the partitioner
  places it (Shardy keeps ``MAXIMAL`` only on JAX's callback targets)."""
  platforms = ctx.module_context.platforms
  return (target is None and len(platforms) == 1 and platforms[0] == "cpu"
          and not once_across_devices(ctx)
          and unavailable() is None)


def _refuse_export(ctx, side) -> None:
  """Refuses, in our words, a host call of one of JAX's Python callback
  targets over several devices in a module lowered for ``jax.export``
  (whose ``host_callbacks`` JAX cannot serialize: it would raise its own
  ``NotImplementedError`` after lowering)."""
  if not (_compat.lowering_for_export(ctx) and once_across_devices(ctx)):
    return
  what = getattr(getattr(side, "host_callback", None), "description", None) or "an effect"
  raise NotImplementedError(
      f"jax.export cannot export {what} over several devices as it is "
      f"lowered here (under plain jax.jit, automatic partitioning): its "
      f"host call is one of JAX's Python callback targets, whose "
      f"host_callbacks jax.export cannot serialize. Fix: export a "
      f"jax_effects.jit function, jax.export.export(jax_effects.jit(f), "
      f"disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("
      f"jax_effects.HOST_TARGET)]), whose effects over several devices "
      f"export")


def emit(ctx, side, operands, sharding, target=None):
  """The results of the custom call of ``side`` (a :class:`HostSide`, or a
  host function for JAX's ``target``): off our target, what
  ``emit_python_callback`` emits without its per-call wrapper (costlier
  than the callback) and token (the carrier orders the call)."""
  if isinstance(side, HostSide) and _own_target(ctx, target):
    return emit_own(ctx, side, operands, sharding)
  _refuse_export(ctx, side)
  if isinstance(side, HostSide):
    side = side.function(ctx.avals_out)
  if target is None:
    target = FFI_TARGETS[ctx.module_context.platforms[0]]
  ctx.module_context.add_host_callback(side)
  index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
  return custom_call(ctx, target, operands, sharding, index=index)


def emit_ordered(ctx, side: HostSide, token, operands, avals_in, avals_out,
                 sharding):
  """``(results, token')`` of an effect under plain ``jax.jit``, with JAX's
  compiler ``token`` (None: unordered) first, as off CPU."""
  sub_ctx = dataclasses.replace(ctx, avals_in=list(avals_in), avals_out=list(avals_out))
  if not _own_target(ctx, None):
    _refuse_export(ctx, side)
    results, token, _ = mlir.emit_python_callback(
        sub_ctx, side.function(avals_out), token, operands, avals_in,
        avals_out, has_side_effect=True, returns_token=token is not None,
        sharding=sharding)
    return results, token
  if token is None:
    return emit_own(sub_ctx, side, operands, sharding), None
  token_aval = _compat.abstract_token
  sub_ctx = dataclasses.replace(ctx, avals_in=[token_aval, *avals_in],
                                avals_out=[token_aval, *avals_out])
  token, *results = emit_own(
      sub_ctx, side, [token, *operands],
      _compat.with_token_sharding(sharding, bool(avals_out)))
  return results, token


def gathered(ctx, args, avals) -> list:
  """The operands of a callback that runs once, annotated replicated (no
  "involuntary full rematerialization" warning) if partitioned."""
  if not once_across_devices(ctx):
    return list(args)
  return [_compat.replicated(ctx, x, aval) if aval.shape else x
          for x, aval in zip(args, avals)]


# --- program order across ordered-effect kinds, plain jax.jit ----------------

def join(ctx, own):
  """The token an ordered host call of effect ``own`` takes: its chain's
  token, joined with every other ordered chain's when ``ctx`` lowers for
  plain ``jax.jit`` (``PLAIN_JIT_ORDER`` among its tokens)."""
  tokens = ctx.tokens_in
  if not _joins(ctx):
    return tokens.get(own)
  distinct = []   # (IR values, compared by ==)
  for token in (tokens.get(e) for e in tokens.effects()):
    if not any(token == seen for seen in distinct):
      distinct.append(token)
  return distinct[0] if len(distinct) == 1 else jcore.hlo.after_all(distinct)


def _joins(ctx) -> bool:
  return (_compat.RULES_SEE_EVERY_TOKEN
          and _effects.PLAIN_JIT_ORDER in ctx.tokens_in.effects())


def set_joined(ctx, own, token) -> None:
  """Sets ``ctx``'s output tokens: ``token`` for ``own`` and, where
  :func:`join` joined the chains, every other chain after ``token`` too
  (each by its own ``after_all``: a computation's output tokens must be
  distinct values)."""
  tokens = ctx.tokens_in
  if not _joins(ctx):
    ctx.set_tokens_out(tokens.update_tokens(mlir.TokenSet({own: token})))
    return
  ctx.set_tokens_out(mlir.TokenSet({
      e: token if e == own else jcore.hlo.after_all([token, tokens.get(e)])
      for e in tokens.effects()}))


def in_program_order(rule):
  """JAX's lowering ``rule`` of an ordered callback primitive, made a join
  (the module docstring) where the region holds ``PLAIN_JIT_ORDER``."""

  def rule_in_program_order(ctx, *args, **params):
    if not (_compat.jax_callback_is_ordered(params) and _joins(ctx)):
      return rule(ctx, *args, **params)
    tokens = ctx.tokens_in
    joined = join(ctx, _effects.PLAIN_JIT_ORDER)
    inner = ctx.replace(
        tokens_in=mlir.TokenSet({e: joined for e in tokens.effects()}),
        tokens_out=None)
    results = rule(inner, *args, **params)
    # (the one chain whose token the rule replaced is its own)
    own, token = next(
        ((e, t) for e in tokens.effects()
         if (t := inner.tokens_out.get(e)) != joined),
        (_effects.PLAIN_JIT_ORDER, joined))
    set_joined(ctx, own, token)
    return results

  rule_in_program_order.jax_effects_wraps = rule
  return rule_in_program_order


if _compat.RULES_SEE_EVERY_TOKEN:
  _compat.wrap_jax_callback_lowerings(in_program_order)


# Registered when jax_effects is imported: a process that only runs modules
# exported or cached by another one has lowered nothing of ours.
try:
  _capsule = ENTRY.configure(_sites, _cold, np.empty, SiteMismatch)
  jax.ffi.register_ffi_target(TARGET, _capsule, platform="cpu", api_version=1)
except Exception as err:  # noqa: BLE001 - XLA refused the handler
  _unavailable = f"XLA refused jax_effects' FFI host target: {err}"
