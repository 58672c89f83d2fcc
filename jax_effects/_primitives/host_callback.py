"""``HostCallback``: the side-effect primitives' parameter, and its vmap forms.

:class:`HostCallback` holds the user-facing function's host side (``fn``),
built once when the effect is bound and never mutated. :class:`BatchedHost`,
:class:`MaskedHost` and :class:`LiveMasked` are its ``fn`` under ``vmap``
(``design/transformations.md``). No part in the token calling convention.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_effects._primitives import host_specs as _host_specs


@dataclasses.dataclass(frozen=True, eq=False)
class HostCallback:
  """A host function run by a side-effect primitive (a primitive parameter,
  compared by identity): ``fn`` takes the flat operands as NumPy arrays and
  returns results matching ``result_avals``. ``eager``: run instead outside
  any trace. ``reads_placement``: ``fn`` calls
  ``_runtime.placement.current()``. ``edges``: an ``edges.Edges`` or None
  per last operand. ``cleanup``: runs also after an earlier failure of its
  chain. ``user_code``: ``fn`` may dispatch or block (``design/errors.md``).
  ``spec``: the host side as data (``host_specs``), or why not, or None.
  ``instead``: the call of jax_effects that exports, which ``jax.export``'s
  refusal of this one suggests (an adopted JAX callback's), or None.
  """
  fn: Callable[..., Sequence[Any]]
  description: str
  result_avals: tuple = ()
  traced_in_branch: bool = False
  eager: Callable[..., None] | None = None
  reads_placement: bool = False
  batch_once: bool = False
  edges: tuple = ()
  counts_elements: bool = False
  cleanup: bool = False
  chain: Any = None
  user_code: bool = False
  #: The effect as its front end bound it, kept by every form made of it:
  #: a lowered form's site lives as long as the effect does.
  origin: Any = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    if self.origin is None:
      object.__setattr__(self, "origin", self)
  spec: dict | str | None = None
  instead: str | None = None

  def __repr__(self):
    return f"<host callback {self.description}>"

  def __call__(self, *args):
    """Runs ``fn`` and checks its results (eagerly, and per batch element)."""
    results = self.fn(*args)
    if not self.result_avals:
      return ()
    return check_results(self.description, results, self.result_avals)


def on_chain(host_callback: HostCallback, chain) -> HostCallback:
  """``host_callback`` with ``chain`` set (one object per chain)."""
  if host_callback.chain is chain:
    return host_callback
  by_chain = host_callback.__dict__.setdefault("_on_chains", {})
  if chain not in by_chain:   # (setdefault: one object per chain on every thread)
    by_chain.setdefault(chain, dataclasses.replace(host_callback, chain=chain))
  return by_chain[chain]


def check_results(description, results, avals):
  if not isinstance(results, (tuple, list)) or len(results) != len(avals):
    n = len(results) if isinstance(results, (tuple, list)) else "a non-sequence"
    raise TypeError(
        f"{description} returned {n} results; expected {len(avals)} "
        f"(shapes/dtypes {[str(a.str_short()) for a in avals]})")
  out = []
  for i, (r, aval) in enumerate(zip(results, avals)):
    if type(r) is not np.ndarray:
      # Python scalars and lists take the declared dtype, like literals
      # (np.float64, a float, has its own dtype).
      python = (isinstance(r, (bool, int, float, complex, list, tuple))
                and not isinstance(r, np.generic))
      r = np.asarray(r, dtype=aval.dtype if python else None)
    if r.dtype != aval.dtype:
      # Compared after JAX's canonicalization, as io_callback compares.
      canonical = jax.dtypes.canonicalize_dtype(r.dtype)
      if canonical == aval.dtype:
        r = np.asarray(r, canonical)
      elif canonical != r.dtype:
        raise TypeError(
            f"{description} result #{i} has shape {r.shape} and dtype "
            f"{r.dtype}; expected shape {aval.shape} and dtype {aval.dtype} "
            f"({r.dtype} counts as {canonical} with jax_enable_x64 off)")
    if r.shape != aval.shape or r.dtype != aval.dtype:
      raise TypeError(
          f"{description} result #{i} has shape {r.shape} and dtype {r.dtype}; "
          f"expected shape {aval.shape} and dtype {aval.dtype}")
    out.append(r)
  return tuple(out)


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class BatchedHost:
  """Host function of a vmapped effect: the element callback per element.
  ``levels[i][j]``: operand ``i`` has the batch axis of vmap level ``j``
  (outermost first). ``live``: which elements run (else zeros)."""
  element: HostCallback
  batch_shape: tuple
  levels: tuple
  element_avals: tuple

  def __call__(self, *args, live=None):
    shape = self.batch_shape
    outs = [np.zeros(shape + a.shape, a.dtype) for a in self.element_avals]
    for idx in np.ndindex(*shape):
      if live is not None and not live[idx]:
        continue
      el_args = []
      for x, lv in zip(args, self.levels):
        sub = tuple(i for i, has in zip(idx, lv) if has)
        el_args.append(np.asarray(x[sub]) if sub else x)
      results = self.element(*el_args)
      for out, r in zip(outs, results):
        out[idx] = r
    return tuple(outs)


def batched(host_callback: HostCallback, element: HostCallback,
            shape: tuple, levels: tuple, spec) -> HostCallback:
  """``host_callback`` run as ``element`` per element of a vmap batch."""
  avals = element.result_avals if element is host_callback else (
      host_callback.fn.element_avals)
  return dataclasses.replace(
      host_callback, fn=BatchedHost(element, shape, levels, avals),
      result_avals=tuple(jax.core.ShapedArray(shape + a.shape, a.dtype)
                         for a in avals), eager=None, spec=spec)


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class MaskedHost:
  """Host function of an effect in a vmapped ``cond`` branch: runs where
  its first operand (the element took the branch) is True, else zeros."""
  inner: Callable
  result_avals: tuple

  def __call__(self, taken, *args):
    if np.asarray(taken):
      return self.inner(*args)
    return tuple(np.zeros(a.shape, a.dtype) for a in self.result_avals)


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class LiveMasked:
  """Host function of a vmapped effect in vmapped ``while_loop``s: an
  element runs while each predicate (the first operands) is True."""
  inner: BatchedHost
  reshapes: tuple

  def __call__(self, *args):
    k = len(self.reshapes)
    live = np.ones(self.inner.batch_shape, dtype=bool)
    for m, rs in zip(args[:k], self.reshapes):
      live &= np.reshape(np.asarray(m, dtype=bool), rs)
    return self.inner(*args[k:], live=live)


def wrapped_spec(inner, kind: str, **fields):
  """The spec of a form ``kind`` of an effect whose spec is ``inner``
  (another key than the element's), or ``inner`` if that is not data."""
  return {"kind": kind, "inner": inner, **fields} if isinstance(inner, dict) else inner


def _rebuild_batched(spec) -> HostCallback:
  element = _host_specs.rebuild_effect(spec["inner"])
  shape = tuple(int(n) for n in spec["shape"])
  levels = tuple(tuple(bool(b) for b in lv) for lv in spec["levels"])
  if any(len(lv) != len(shape) for lv in levels):
    raise _host_specs.NotData("a batched form whose levels do not fit its "
                              "batch shape")
  return batched(element, element, shape, levels, spec)


def in_branch(inner: HostCallback, spec) -> HostCallback:
  """``inner`` in a vmapped ``cond`` branch (:class:`MaskedHost`)."""
  return dataclasses.replace(
      inner, fn=MaskedHost(inner.fn, tuple(inner.result_avals)),
      traced_in_branch=False, eager=None, spec=spec)


def _rebuild_masked(spec) -> HostCallback:
  return in_branch(_host_specs.rebuild_effect(spec["inner"]), spec)


def _rebuild_live(spec) -> HostCallback:
  inner = _host_specs.rebuild_effect(spec["inner"])
  if not isinstance(inner.fn, BatchedHost):
    raise _host_specs.NotData("a live-masked form of an unbatched effect")
  reshapes = tuple(tuple(int(n) for n in r) for r in spec["reshapes"])
  if any(len(r) != len(inner.fn.batch_shape) for r in reshapes):
    raise _host_specs.NotData("a live-masked form whose masks do not fit "
                              "its batch")
  return dataclasses.replace(inner, fn=LiveMasked(inner.fn, reshapes), spec=spec)


_host_specs.register_kind("batched", _rebuild_batched)
_host_specs.register_kind("masked", _rebuild_masked)
_host_specs.register_kind("live", _rebuild_live)


def _alignments(mask_shape: tuple, batch_shape: tuple) -> list[tuple]:
  """Increasing positions p with batch_shape[p[i]] == mask_shape[i]."""
  return [p for p in itertools.combinations(range(len(batch_shape)),
                                            len(mask_shape))
          if all(batch_shape[j] == n for j, n in zip(p, mask_shape))]


def masked(host_callback: HostCallback, masks: Sequence):
  """``(host_callback', extra_operands)``: skip elements where a mask (the
  batched predicate of an enclosing vmapped ``while_loop``) is False."""
  fn = host_callback.fn
  what = host_callback.description
  if not isinstance(fn, BatchedHost):
    raise AssertionError(
        f"{what}: inside a vmapped while_loop but not batched")
  shape = fn.batch_shape
  reshapes = []
  for m in masks:
    mshape = tuple(jnp.shape(m))
    found = _alignments(mshape, shape)
    if len(found) != 1:
      raise NotImplementedError(
          f"{what} is inside a jax.lax.while_loop whose predicate jax.vmap "
          f"batched over axes of sizes {mshape}, but the effect is batched "
          f"over vmap axes of sizes {shape}, so which element is still "
          f"iterating is ambiguous. Give the vmapped axes different sizes, or "
          f"move the effect out of the loop.")
    (pos,) = found
    reshapes.append(tuple(shape[j] if j in pos else 1 for j in range(len(shape))))
  run = LiveMasked(fn, tuple(reshapes))
  return (dataclasses.replace(
      host_callback, fn=run, spec=wrapped_spec(
          host_callback.spec, "live",
          reshapes=[list(r) for r in run.reshapes])),
          [jnp.asarray(m, dtype=bool) for m in masks])
