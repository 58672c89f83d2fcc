"""JAX's own host callbacks inside ``jax_effects.jit``: adopted by the pass.

``jax.debug.print``, ``jax.debug.log`` (``debug_print_p``),
``jax.debug.callback`` (``debug_callback_p``) and
``jax.experimental.io_callback`` (``io_callback_p``)
traced inside a ``jax_effects.jit`` function are converted by the
token-threading pass into ``threaded_effect_p`` equations, like
``jax_effects`` effects. Their part of the token calling convention:

* each one joins the chain of :data:`~jax_effects.DEFAULT`
  (:data:`~jax_effects.GLOBAL` in global mode): it takes and returns that
  chain's compiler token and carrier, so it runs in program order with every
  ``jax_effects`` effect of the default stream, inside the computation and
  across dispatches (the runtime token of ``DEFAULT``). That holds for
  ``ordered=True`` (JAX's ``OrderedDebugEffect``/``OrderedIOEffect``) and
  for JAX's default unordered callbacks (``DebugEffect``/``IOEffect``) alike:
  JAX promises no order for the latter, and program order is one, so
  existing code (which mostly calls ``jax.debug.print`` without
  ``ordered=True``) prints in program order by changing only its ``jit``;
* the host side is JAX's own (the debug primitives' impl, io_callback's
  host implementation), so arguments, formatting and results are exactly JAX's;
  where it runs is ours (``_runtime.placement``: once per device inside
  ``shard_map``/``pmap``, once otherwise), so it works on several devices and
  in ``shard_map``, where JAX refuses ordered callbacks, and an exception
  reaches the caller as itself, once (``_runtime.errors``);
* after the pass no JAX effect is left, so ``jax.jit``'s C++ fast path
  dispatches the function.

A ``jax.debug.print`` whose operands NumPy will print summarized (under the
print options JAX captured at its call site) passes only their edges to the
host, from every device's part under automatic partitioning
(:func:`summarized_print`, ``_primitives.edges``): the text is the same.

Differences from JAX's own lowering: ``io_callback``'s ``sharding=`` (the
device to run on) is ignored, the callback runs where ours run (the first
device of the computation); output of adopted callbacks is JAX's own (no
device prefix, not held by :func:`~jax_effects.deterministic`); an ordered
``io_callback`` under ``vmap`` is still refused by JAX while tracing, before
the pass.

Not adopted (left to JAX, which then also keeps its slower dispatch):
``jax.debug.callback(..., partitioned=True)`` (JAX runs it per shard under
automatic partitioning; ours would run once on the whole value), and a
callback inside a higher-order primitive the pass has no rule for.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import host_callback as _host_callback

#: JAX effect types of adopted callbacks -> whether JAX orders them.
_EFFECT_TYPES = {
    _compat.OrderedDebugEffect: True,
    _compat.DebugEffect: False,
    _compat.OrderedIOEffect: True,
    _compat.IOEffect: False,
}


def is_adoptable_effect(effect) -> bool:
  """Whether ``effect`` is the JAX effect of a callback the pass adopts."""
  return type(effect) in _EFFECT_TYPES


def chain_key(effect, mode: str):
  """The chain of an adopted JAX effect: DEFAULT (GLOBAL in global mode),
  whether JAX's effect is ordered or not (see the module docstring)."""
  del effect
  return _effects.GLOBAL if mode == "global" else _effects.DEFAULT


def _debug_host(primitive, params, *args):
  primitive.impl(*args, **params)   # JAX's host side: formats, calls, logs
  return ()


def _io_host(params, *args):
  # As JAX's callback lowering: results are NumPy arrays of JAX's canonical
  # dtypes (a float64 result of a float32 io_callback is float32 without
  # x64); shapes and dtypes are then checked against result_avals.
  return tuple(_canonical(np.asarray(r))
               for r in _compat.io_callback_impl(*args, **params))


def _canonical(a):
  dtype = jax.dtypes.canonicalize_dtype(a.dtype)
  return a if a.dtype == dtype else a.astype(dtype)


def summarized_print(eqn, description: str):
  """A ``jax.debug.print`` equation whose operands NumPy will print
  summarized, under the print options its call site captured: its
  ``HostCallback``, whose operands arrive as their edges and are formatted
  as the whole arrays (``_primitives.edges``), so only the edges leave the devices;
  None when every operand is shown whole (or the format has no
  placeholders: JAX then formats with the options of the callback's
  thread, unknown here), which JAX's own host side prints."""
  params = eqn.params
  if not params["has_placeholders"]:
    return None
  options = dict(params["np_printoptions"])
  edges = tuple(
      None if jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.extended)
      else _edges.plan(v.aval.shape, options) for v in eqn.invars)
  if all(e is None for e in edges):
    return None
  return _host_callback.HostCallback(
      functools.partial(_summarized_print_host,
                        _compat.debug_print_callback(params), edges),
      description, edges=edges)


def _summarized_print_host(callback, edges, *args):
  callback(*_edges.host_values(args, edges))
  return ()


_DEBUG_NAMES = {_compat.debug_callback_p: "jax.debug.callback",
                _compat.debug_print_p: "jax.debug.print"}


def adopt(eqn):
  """``(host_callback, jax_effect)`` for an adoptable equation, or None if
  the equation stays JAX's.

  A new :class:`~jax_effects._host_callback.HostCallback` per pass run (the pass runs
  once per trace of the function).
  """
  prim = eqn.primitive
  params = eqn.params
  (effect,) = [e for e in eqn.effects if is_adoptable_effect(e)]
  if prim in _DEBUG_NAMES:
    if params.get("partitioned"):
      return None
    name = _DEBUG_NAMES[prim]
    if prim is _compat.debug_print_p:
      name = f"jax.debug.print({params['fmt']!r})"
      summarized = summarized_print(eqn, f"{name} (adopted by jax_effects.jit)")
      if summarized is not None:
        return summarized, effect
    host = _host_callback.HostCallback(
        functools.partial(_debug_host, prim, dict(params)),
        f"{name} (adopted by jax_effects.jit)")
    return host, effect
  if prim is _compat.io_callback_p:
    result_avals = tuple(params["result_avals"])
    host_params = dict(callback=params["callback"], result_avals=result_avals,
                       sharding=None, ordered=params["ordered"])
    host = _host_callback.HostCallback(
        functools.partial(_io_host, host_params),
        "jax.experimental.io_callback (adopted by jax_effects.jit)",
        result_avals)
    return host, effect
  return None


PRIMITIVES = frozenset({_compat.debug_callback_p, _compat.debug_print_p,
                        _compat.io_callback_p})
