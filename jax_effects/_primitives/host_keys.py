"""Keys and site specs of jax_effects' FFI target (``host_target``).

A site spec (:func:`site_spec`) names everything that decides what a host
side does; its key is made from it (``design/host_target.md``, "Keys"):
``jfx1.D<hash>`` when its effect spec is data, else (a *local* site)
``jfx1.L<hash>.<n>``. A key arriving in a module is checked against its
spec (:func:`key_problem`) before a site is rebuilt (:func:`rebuild`); a
local site is never rebuilt, nor exported (:class:`NotExportable`), nor
reached by an exported module: every key of a module called here that is
not a data key becomes ``jfx1.F<hash>`` (:func:`foreign_key`), which no
site is ever bound to.

Part in the token calling convention: none; the carrier is one of a site's
passthrough operands, passed as a NumPy scalar (:func:`scalars`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

import jax

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._primitives import host_sites as _host_sites
from jax_effects._primitives import host_specs as _specs
from jax_effects._runtime import placement as _placement


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


def rebuild(key: bytes, text: str) -> tuple[_host_sites.Site, bool]:
  """``(site, failing)`` rebuilt from the spec ``text``; a failing site's
  effect raises ``UnboundHostFunction``, deferred as a callback's error."""
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
    results = [jax.core.ShapedArray(shape, dtype)
               for dtype, shape in filter(None, avals_out)]
  except Exception as err:  # noqa: BLE001 - a spec this version cannot read
    raise _host_sites.SiteMismatch(
        f"a call site spec jax_effects cannot read ({err})")
  effect = spec.get("effect") or {}
  failing = False
  try:
    if "local" in effect and _FOREIGN_KEY.fullmatch(key):
      raise UnboundHostFunction(
          f"{effect['local']}: its host function is a Python object of the "
          f"process that lowered it, which an exported module cannot "
          f"bring: a module called in this process never runs a local "
          f"host function, whatever key it carries")
    if "local" in effect:
      raise UnboundHostFunction(
          f"{effect['local']}: its host function is a Python object of the "
          f"process that lowered it and is not bound in this one (its "
          f"executable outlived it, or the module came from another "
          f"process)")
    host_callback = dataclasses.replace(
        _specs.rebuild_effect(effect), chain=_decode_chain(site_spec.get("chain")),
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
  return _host_sites.Site(key, text, host_callback.description, host, avals_in, avals_out,
                          scalars(site_spec, avals_in, where)), failing


def _encode_chain(chain):
  """A chain key as data: an ``Effect``'s name, or None."""
  return chain.name if isinstance(chain, _effects.Effect) else None


def _decode_chain(name):
  return _effects.UNORDERED if name is None else _effects.Effect(name)


def scalars(site_spec, avals_in, where) -> frozenset:
  """Operand positions passed as NumPy scalars: 0-d passthrough ones (the
  carrier) and the partition id."""
  tokens = sum(1 for a in avals_in if a is None)
  out = {tokens + i for i in range(site_spec["passthrough"])
         if avals_in[tokens + i][1] == ()}
  if where.table is not None:
    out.add(len(avals_in) - 1)
  return frozenset(out)


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
  return aval if getattr(aval, "dtype", None) is None else _compat.physical_aval(aval)


def site_spec(side, avals_in, avals_out) -> tuple[dict, str | None]:
  """``(spec, why_local)``: the site spec of ``side`` lowered with these
  avals; ``why_local``: why its host side is not data (None: it is)."""
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


class NotExportable(ValueError):
  """An effect whose host side only its process has, lowered for export."""

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
