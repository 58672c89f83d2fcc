"""The traces of one ``jax_effects.jit`` function, kept by signature.

A ``Function``'s ``jax.jit`` objects trace ``g(*tokens, *args, **kwargs)``;
tracing ``g`` traces the user function to a closed jaxpr
(``jax.make_jaxpr``) that the token pass then threads. The same signature
(static leaves, avals of the dynamic ones, ordering mode) is traced again
when the call learns a new chain (``NeedsTokens``: a new ``jax.jit`` object
for one more token) or gets a new shape of runtime token (a per-device
token); the cache keeps the last few jaxprs so the user function is traced
once per signature, as under ``jax.jit``.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import jax
from jax import tree_util

from jax_effects._core import effects as _effects

#: How many traces (jaxprs by signature) a function keeps for reuse.
KEPT_TRACES = 8


class TraceCache:
  """Jaxprs of ``fun`` by signature (at most :data:`KEPT_TRACES`, oldest
  dropped first)."""

  def __init__(self, fun: Callable):
    self._fun = fun
    self._traces: dict = {}
    self._lock = threading.Lock()

  def clear(self) -> None:
    with self._lock:
      self._traces.clear()

  def trace(self, args, kwargs):
    """``(closed_jaxpr, dynamic_leaves, out_tree)`` of the user function on
    the dynamic (traced) leaves of ``(args, kwargs)``."""
    leaves, treedef = tree_util.tree_flatten((args, kwargs))
    dyn_pos = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
    dyn = [leaves[i] for i in dyn_pos]
    signature = (treedef, tuple(x.aval if isinstance(x, jax.core.Tracer) else x
                                for x in leaves), _effects.get_ordering())
    try:
      hit = self._traces.get(signature)
    except TypeError:  # a static leaf that cannot be hashed
      signature = hit = None
    if hit is not None:
      return hit[0], dyn, hit[1]

    fun = self._fun

    @functools.wraps(fun)
    def flat_fun(*dyn_vals):
      full = list(leaves)
      for i, x in zip(dyn_pos, dyn_vals):
        full[i] = x
      a, k = tree_util.tree_unflatten(treedef, full)
      return fun(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dyn)
    out_tree = tree_util.tree_structure(out_shape)
    if signature is not None and not any(
        isinstance(c, jax.core.Tracer) for c in closed.consts):
      # (a jaxpr closing over an enclosing trace's values is not reusable)
      with self._lock:
        if len(self._traces) >= KEPT_TRACES:
          self._traces.pop(next(iter(self._traces)))
        self._traces[signature] = (closed, out_tree)
    return closed, dyn, out_tree
