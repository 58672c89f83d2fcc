"""jax_effects' FFI target: one process-global custom call for every host call.

Every effect lowered for CPU is one custom call to :data:`TARGET` with two
string attributes: ``jax_effects_key``, bound in this process to a
``host_sites.Site`` (:data:`_sites`, held weakly), and ``jax_effects_spec``,
the site spec the key was made from (``host_keys``). A key not bound here
is rebuilt from its spec on its first call, or its effect fails with a
deferred error. Registry, lifetime and handler: ``design/host_target.md``.

Part in the token calling convention: none of its own; it carries the
carrier operand and result like any other (``host_call``).
"""
from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

from jax_effects import _compat
from jax_effects._primitives import host_keys as _keys
from jax_effects._primitives import host_sites as _host_sites
from jax_effects._primitives import host_specs as _specs

#: The custom-call target name (CPU).
TARGET = "jax_effects_host"
KEY_ATTR = "jax_effects_key"
SPEC_ATTR = "jax_effects_spec"
#: How many sites rebuilt from a spec are kept alive (the oldest dropped
#: first).
REBUILT_KEPT = 4096

_registered = False
_unavailable: str | None = None


def unavailable() -> str | None:
  """Why :data:`TARGET` is not registered in this process (None: it is)."""
  _register()
  return _unavailable


def _register() -> None:
  global _registered, _unavailable
  if _registered:
    return
  with _lock:
    if _registered:
      return
    import jax
    try:
      capsule = _host_sites.ENTRY.configure(
          _sites, _cold, np.empty, _host_sites.SiteMismatch)
      jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu", api_version=1)
    except Exception as err:  # noqa: BLE001 - XLA refused the handler
      _unavailable = f"XLA refused jax_effects' FFI host target: {err}"
    _registered = True


_lock = threading.RLock()
#: key (bytes) -> weak reference to its Site.
_sites: dict[bytes, weakref.ref] = {}
#: HostCallback -> {site spec text: Site}: a site lives while its effect does.
_holders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: Sites rebuilt from a spec, most recently bound last.
_rebuilt: "collections.OrderedDict[bytes, _host_sites.Site]" = (
    collections.OrderedDict())
#: Local sites given a key, per hash of their description.
_local_counts: dict[str, int] = {}


def _bind(key: bytes, site: _host_sites.Site) -> None:
  def dropped(ref, key=key, lock=_lock, sites=_sites):
    # (bound here: at interpreter exit the module's globals may be gone)
    with lock:
      if sites.get(key) is ref:
        del sites[key]
  _sites[key] = weakref.ref(site, dropped)


def _bound(key: bytes) -> _host_sites.Site | None:
  ref = _sites.get(key)
  return None if ref is None else ref()


def _cold(key: bytes, attrs: dict) -> _host_sites.Site:
  """The site of a key not bound here (``attrs``: the call's string
  attributes), rebuilt from the call's spec."""
  if set(attrs) != {KEY_ATTR, SPEC_ATTR} or attrs[KEY_ATTR].encode() != key:
    raise _host_sites.SiteMismatch(
        "a call of jax_effects' host target with attributes it does not know")
  text = attrs[SPEC_ATTR]
  problem = _keys.key_problem(key, text)
  if problem:   # (never bound: the key keeps naming what its spec says)
    raise _host_sites.SiteMismatch(problem)
  with _lock:
    site = _bound(key)
    if site is not None:
      return site
    site, failing = _keys.rebuild(key, text)
    # (a failing one is made again: a later registration of a named
    # callback makes it run; only a data key is ever bound from a module)
    if not failing and _keys.is_data_key(key):
      _bind(key, site)
      _rebuilt[key] = site
      while len(_rebuilt) > REBUILT_KEPT:
        _rebuilt.popitem(last=False)
  return site


def _not_exportable(host_callback, why) -> _keys.NotExportable:
  """The refusal to export ``host_callback``: its fix suggests first the
  call of jax_effects that exports in its place, where it has one (an
  adopted ``jax.debug.print``: ``jax_effects.print``)."""
  err = _keys.NotExportable(host_callback.description, why)
  if host_callback.instead:
    text = str(err)
    head, fix, rest = text.partition("Fix: ")
    use = f"use {host_callback.instead} instead, which exports"
    err.args = (f"{head}{fix}{use}; or {rest}" if fix else f"{text} Fix: {use}.",)
  return err


def _site_for(side, avals_in, avals_out,
              for_export: bool) -> _host_sites.Site:
  """The site of ``side`` (bound to its key, made if new)."""
  try:
    spec, why = _keys.site_spec(side, avals_in, avals_out)
  except _specs.NotData as err:
    spec, why = None, f"it has {err}"
  # (a spec of symbolic shapes is never lowered for execution)
  if spec is None or (for_export and why is not None):
    raise _not_exportable(side.host_callback, why)
  text = _specs.dumps(spec)
  with _lock:
    held = _holders.setdefault(side.host_callback.origin, {})
    site = held.get(text)
    if site is not None and _bound(site.key) is site:
      return site
    if why is None:
      key = _keys.key_of(text)
      site = _bound(key)
    else:
      h = _keys.local_hash(text)
      n = _local_counts.get(h, 0)
      _local_counts[h] = n + 1
      key = _keys.key_of(text, n)
      site = None
    if site is None:
      decoded_in = [_specs.decode_aval(a) for a in spec["site"]["in"]]
      decoded_out = [_specs.decode_aval(a) for a in spec["site"]["out"]]
      host = side.function([a for a in avals_out
                            if getattr(a, "dtype", None) is not None])
      site = _host_sites.Site(
          key, text, side.host_callback.description, host, decoded_in, decoded_out,
          _keys.scalars(spec["site"], decoded_in, side.where))
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
  (``host_keys.foreign_key``: its data key, else one no site is bound to)
  and exactly the two attributes this package writes; True if it changed
  anything. So a module reaches no host function it did not bring: not a
  local one of this process, whatever key (and attribute names) it
  copied."""
  from jax.interpreters import mlir
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
    new = _keys.foreign_key(key, spec)
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


def emit(ctx, side, operands, sharding, side_effect: bool = True) -> list:
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
  return custom_call(ctx, TARGET, operands, sharding, side_effect,
                     **{KEY_ATTR: site.key.decode(), SPEC_ATTR: site.spec})


def custom_call(ctx, target, operands, sharding, side_effect: bool = True,
                **attrs) -> list:
  """The results of an FFI custom call to ``target`` (side-effecting
  unless not ``side_effect``)."""
  import jax
  lower = _lowerings.get((target, side_effect))
  if lower is None:
    lower = _lowerings[target, side_effect] = (
        jax.ffi.build_ffi_lowering_function(target,
                                            has_side_effect=side_effect))
  op = lower(ctx, *operands, **attrs)
  if sharding is not None:
    _compat.set_sharding(ctx.module_context, op, sharding)
  return op.results


# Registered when jax_effects is imported: a process that only runs modules
# exported or cached by another one has lowered nothing of ours.
_register()
