"""Specs: a host side written as data, from which any process rebuilds it.

Where a host side is fully determined by data, its front end describes it
as a JSON-able *effect spec* (``HostCallback.spec``, ``{"kind": ...}``) and
builds its host function from it with the function it registered for its
kind (:func:`register_kind`); else ``HostCallback.spec`` says why not (a
*local* host side). A *site spec* (``host_target.site_spec``) adds what the
lowering decided; serialized by :func:`dumps`, it is the custom call's
``jax_effects_spec`` attribute (``design/host_target.md``).

Part in the token calling convention: none (the carrier's place in a site
spec is the convention's: ``passthrough`` operands first).
"""
from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Callable

import numpy as np
from jax import tree_util

#: Version of the spec format (a site spec's ``"v"``).
VERSION = 1


class NotData(Exception):
  """What a host side is made of cannot be written as data."""


def dumps(spec: dict) -> str:
  """The canonical JSON text of a spec (sorted keys, no spaces)."""
  return json.dumps(spec, sort_keys=True, separators=(",", ":"), allow_nan=True)


def digest(text: str, n: int = 32) -> str:
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


def encode_aval(aval) -> list:
  """``[dtype name, shape]`` (``["token"]`` for a token)."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return ["token"]
  try:
    dims = [int(n) for n in shape]
  except TypeError:
    raise NotData(f"an operand of symbolic shape {shape}") from None
  return [np.dtype(dtype).name, dims]


def decode_aval(data):
  """``(numpy dtype, shape)``, or None for a token."""
  if data == ["token"]:
    return None
  name, shape = data
  return _dtype(name), tuple(int(n) for n in shape)


def _dtype(name: str) -> np.dtype:
  import jax.numpy as jnp   # (ml_dtypes' names: bfloat16, float8_*, int4)
  found = getattr(jnp, name, None)
  return np.dtype(name if found is None else found)


_STATIC = (str, int, float, bool)


def encode_tree(tree, operand_leaves: set) -> Any:
  """``tree`` as data: the leaf at flat position ``i`` is ``{"op": j}``
  when ``i`` is the ``j``-th of ``operand_leaves``, else its value."""
  leaves = tree_util.tree_leaves(tree)
  order = sorted(operand_leaves)
  index = {pos: j for j, pos in enumerate(order)}
  walked = []

  def walk(x):
    t = type(x)
    if x is None:
      return {"n": 0}
    if t is tuple or t is list:
      return {"t" if t is tuple else "l": [walk(v) for v in x]}
    if t is dict:
      if not all(type(k) is str for k in x):
        raise NotData("a dict with keys that are not str")
      return {"d": [[k, walk(x[k])] for k in sorted(x)]}
    if not tree_util.all_leaves([x]):
      raise NotData(f"a pytree node of type {t.__name__}")
    pos = len(walked)   # (its flat position)
    walked.append(x)
    if pos in index:
      return {"op": index[pos]}
    if t not in _STATIC:
      raise NotData(f"a static argument of type {t.__name__}")
    return {"v": x}

  out = walk(tree)
  if len(walked) != len(leaves) or any(a is not b for a, b in
                                       zip(walked, leaves)):
    raise NotData("a pytree JAX flattens differently")
  return out


def decode_tree(data, values) -> Any:
  """The pytree of :func:`encode_tree`'s ``data`` with these ``values``."""
  if "op" in data:
    return values[data["op"]]
  if "v" in data:
    return data["v"]
  if "t" in data:
    return tuple(decode_tree(d, values) for d in data["t"])
  if "l" in data:
    return [decode_tree(d, values) for d in data["l"]]
  return {k: decode_tree(d, values) for k, d in data["d"]} if "d" in data else None


_MAKERS = {"t": tuple, "l": list, "d": dict}


def _shallow(data) -> tuple | None:
  """``(make, keys, items, slots)``: how :func:`tree_decoder` builds the
  node ``data`` of leaves (None for a deeper node)."""
  if "op" in data:
    return None, None, None, data["op"]
  kind = next((k for k in _MAKERS if k in data), None)
  if kind is None:
    return None, None, data.get("v"), None
  children = data[kind]
  keys = [k for k, _ in children] if kind == "d" else None
  if keys is not None:
    children = [d for _, d in children]
  if any(k in child for child in children for k in _MAKERS):
    return None
  slots = [(i, child["op"]) for i, child in enumerate(children) if "op" in child]
  return _MAKERS[kind], keys, [child.get("v") for child in children], slots


def flat_arguments(data) -> tuple | None:
  """``(items, slots, keys, kw_items, kw_slots)`` of an ``(args, kwargs)``
  tree (:func:`encode_tree`) whose children are all leaves: the arguments'
  static values (operands None) and ``(position, operand)`` pairs, the
  keyword arguments' names, values and ``(name, operand)`` pairs; else None."""
  if "t" not in data or len(data["t"]) != 2:
    return None
  args, kwargs = (_shallow(d) for d in data["t"])
  if (args is None or kwargs is None or args[0] is not tuple
      or kwargs[0] is not dict):
    return None
  keys = kwargs[1]
  return (args[2], args[3], keys, kwargs[2], [(keys[i], j) for i, j in kwargs[3]])


def check_tree(data, what: str = "a tree") -> int:
  """Checks ``data`` is :func:`encode_tree`'s; returns its operand count."""
  ops = []

  def walk(d, depth):
    if depth > 64:
      raise NotData(f"{what} nested deeper than 64")
    if not isinstance(d, dict) or len(d) != 1:
      raise NotData(f"{what} with a node that is not one of encode_tree's")
    (tag, v), = d.items()
    if tag == "op":
      if type(v) is not int or v < 0:
        raise NotData(f"{what} with an operand index {v!r}")
      ops.append(v)
    elif tag == "v":
      if type(v) not in _STATIC:
        raise NotData(f"{what} with a static leaf of type "
                      f"{type(v).__name__}")
    elif tag == "n":
      if v != 0:
        raise NotData(f"{what} with a bad None node")
    elif tag in ("t", "l"):
      if not isinstance(v, list):
        raise NotData(f"{what} with a bad sequence node")
      for x in v:
        walk(x, depth + 1)
    elif tag == "d":
      if not isinstance(v, list):
        raise NotData(f"{what} with a bad dict node")
      for kv in v:
        if (not isinstance(kv, list) or len(kv) != 2
            or type(kv[0]) is not str):
          raise NotData(f"{what} with a dict entry whose key is not a str")
        walk(kv[1], depth + 1)
    else:
      raise NotData(f"{what} with a node {tag!r}")

  walk(data, 0)
  if sorted(ops) != list(range(len(ops))):
    raise NotData(f"{what} whose operands are not numbered 0 to "
                  f"{len(ops) - 1} once each")
  return len(ops)


def tree_decoder(data) -> Callable:
  """``decode(values)``: :func:`decode_tree` of ``data``, a tuple of nodes
  of leaves (plain ``(args, kwargs)``) read once here."""
  parts = ([_shallow(d) for d in data["t"]] if "t" in data else [None])
  if None in parts:
    def decode_deep(values):
      return decode_tree(data, values)
    return decode_deep

  def decode(values):
    out = []
    for make, keys, items, slots in parts:
      if make is None:   # (a leaf: its value, or its operand's)
        out.append(items if slots is None else values[slots])
        continue
      row = list(items)
      for i, j in slots:
        row[i] = values[j]
      out.append(make(row) if keys is None else make(zip(keys, row)))
    return tuple(out)
  return decode


_kinds: dict[str, Callable] = {}
_kinds_lock = threading.Lock()


def register_kind(kind: str, rebuild: Callable) -> None:
  """``rebuild(spec) -> HostCallback`` builds the host side of effect specs
  ``{"kind": kind, ...}`` (a front end registers its kinds when imported)."""
  with _kinds_lock:
    _kinds[kind] = rebuild


def rebuild_effect(spec: dict):
  """The ``HostCallback`` of an effect spec (its kind's rebuild function)."""
  kind = spec.get("kind") if isinstance(spec, dict) else None
  rebuild = _kinds.get(kind)
  if rebuild is None:
    raise NotData(f"an effect of kind {kind!r}, which this version of "
                  f"jax_effects does not know (it knows {sorted(_kinds)})")
  return rebuild(spec)
