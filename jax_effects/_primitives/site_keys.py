"""Site specs and keys: what a host call's two attributes say, and whether
they agree.

A *site spec* (:func:`site_spec`) is an effect spec (``host_specs``) plus
what the lowering decided: the custom call's operand and result avals, the
placement, how many passthrough operands lead, the chain, whether the
effect is its chain's entry. Its canonical text is the custom call's
``jax_effects_spec`` attribute; the key (:func:`key_of`) is made from it:
``jfx1.D<hash>`` for a data site (equal specs, equal host sides, in every
process), ``jfx1.L<hash>.<n>`` for the ``n``-th local site of that hash in
this process. :func:`key_problem` makes a key arriving in a module again
from its spec and refuses a mismatch (``design/host_target.md``, "One key,
one host function").

Part in the token calling convention: a spec's ``passthrough`` operands
come first, the carrier among them (``scalars``: read as NumPy scalars);
the chain a site's carrier names is in its spec.
"""
from __future__ import annotations

import json
import re

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import host_specs as _specs
from jax_effects._runtime import placement as _placement


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


def _encode_chain(chain):
  """A chain key as data: an ``Effect``'s name, or None (unordered, or
  not on a chain)."""
  return chain.name if isinstance(chain, _effects.Effect) else None


def decode_chain(name):
  return _effects.UNORDERED if name is None else _effects.Effect(name)


def aval_of(decoded):
  import jax
  dtype, shape = decoded
  return jax.core.ShapedArray(shape, dtype)


def _n_tokens(avals) -> int:
  return sum(1 for a in avals if a is None)


def scalars(site_spec, avals_in, where) -> frozenset:
  """Operand positions passed as NumPy scalars: the 0-d passthrough ones
  (the carrier) and a per-device call's partition id (the last)."""
  tokens = _n_tokens(avals_in)
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


def decode_where(data) -> _placement.Where:
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
