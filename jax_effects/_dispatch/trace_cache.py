"""The traces of one ``jax_effects.jit`` function, kept by signature.

A ``PjitFunction``'s ``jax.jit`` objects trace ``g(*tokens, *args, **kwargs)``;
tracing ``g`` traces the user function to a closed jaxpr
(``jax.make_jaxpr``) that the token pass then threads. The same signature
(static leaves, avals of the dynamic ones, ordering mode, and JAX's trace
context, on which ``jax.jit`` keys its own caches: a trace under
``jax.numpy_rank_promotion("raise")`` or ``jax.default_matmul_precision``
is not one without) is traced againwhen the call learns a new chain (``NeedsTokens``: a new ``jax.jit`` object
for one more token) or gets a new shape of runtime token (a per-device
token); the cache keeps the last few jaxprs so the user function is traced
once per signature, as under ``jax.jit``. The cache belongs to the learnt
state every ``PjitFunction`` of one function shares, and holds the function
only weakly (``fun_ref``, see ``registry``).
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import jax
from jax import tree_util

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects

#: How many traces (jaxprs by signature) a function keeps for reuse.
KEPT_TRACES = 8


class TraceCache:
  """Jaxprs of ``fun`` by signature (at most :data:`KEPT_TRACES`, oldest
  dropped first). Registered with JAX's cache management, so
  ``jax.clear_caches()`` drops them, as it drops ``jax.jit``'s traces."""

  def __init__(self, fun_ref: Callable[[], Callable | None]):
    self._fun_ref = fun_ref
    self._traces: dict = {}
    self._lock = threading.Lock()
    _compat.register_cache(self, "jax_effects.jit kept traces")

  def clear(self) -> None:
    with self._lock:
      self._traces.clear()

  # JAX's cache protocol (``jax.clear_caches``, its cache statistics)
  cache_clear = clear

  def cache_info(self) -> str:
    return f"{len(self._traces)} of at most {KEPT_TRACES} traces kept"

  def cache_keys(self) -> list:
    return list(self._traces)

  def __len__(self) -> int:
    return len(self._traces)

  def trace(self, args, kwargs, keep: bool = True):
    """``(closed_jaxpr, dynamic_leaves, out_tree)`` of the user function on
    the dynamic (traced) leaves of ``(args, kwargs)``; ``keep=False``
    neither reads nor fills the cache."""
    leaves, treedef = tree_util.tree_flatten((args, kwargs))
    dyn_pos = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
    dyn = [leaves[i] for i in dyn_pos]
    signature = (treedef, tuple(x.aval if isinstance(x, jax.core.Tracer) else x
                                for x in leaves), _effects.get_ordering(),
                 _compat.trace_context())
    try:
      hit = self._traces.get(signature) if keep else None
    except TypeError:  # a static leaf that cannot be hashed
      signature = hit = None
    if hit is not None:
      return hit[0], dyn, hit[1]

    fun = self._fun_ref()
    if fun is None:
      raise ReferenceError("jax_effects.jit: the function was garbage-"
                           "collected")

    @functools.wraps(fun)
    def flat_fun(*dyn_vals):
      full = list(leaves)
      for i, x in zip(dyn_pos, dyn_vals):
        full[i] = x
      a, k = tree_util.tree_unflatten(treedef, full)
      return fun(*a, **k)

    closed, out_shape = _jax_api.make_jaxpr(flat_fun, return_shape=True)(*dyn)
    out_tree = tree_util.tree_structure(out_shape)
    if keep and signature is not None and not any(
        isinstance(c, jax.core.Tracer) for c in closed.consts):
      # (a jaxpr closing over an enclosing trace's values is not reusable)
      with self._lock:
        if len(self._traces) >= KEPT_TRACES:
          self._traces.pop(next(iter(self._traces)))
        self._traces[signature] = (closed, out_tree)
    return closed, dyn, out_tree
