"""Device-side counters: an ``int32`` count kept inside a computation.

A :class:`Counter` is a chain of its own holding a number; ``counter_p``
sets it (op ``"set"``) or adds ``x`` to it (``"add"``, ``"add_elements"``)
and returns the new count: ``count' = counter_p(x; counter, op)``.

Part in the token calling convention (``design/tokens.md``): a chain key
with neither a compiler token nor a runtime token, threaded by the pass
like a carrier; it starts at 0 in each computation and orders nothing.
Used by ``jax_effects.progress`` (``every=k``).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._core import effects as _effects
from jax_effects._primitives import effect as _effect
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._runtime import placement as _placement

#: The dtype of every count (that of the carriers it is threaded with).
COUNT_DTYPE = np.int32

_ids = itertools.count(1)


class Counter:
  """One device-side count (a chain key of the pass; compared by identity).
  ``name`` sorts it among chain keys (after every ``Effect``)."""
  __slots__ = ("name", "description", "eager", "lock", "host_counts",
               "__weakref__")

  def __init__(self, description: str):
    self.name = f"~counter {next(_ids)}"
    self.description = description
    self.eager = threading.local()   # the count of eager code, per thread
    self.lock = threading.Lock()
    self.host_counts: dict = {}      # under plain jax.jit: per device

  def __repr__(self):
    return f"<{self.name}: {self.description}>"


@dataclasses.dataclass(frozen=True)
class CounterEffect(_compat.Effect):
  """JAX-level marker on a ``counter_p`` equation (see the module docstring)."""
  counter: Counter

  def __str__(self):
    return f"jax_effects[{self.counter.name}]"


_compat.allow_effect_types(CounterEffect)
# (an update in a scan body counts once per iteration under grad too)
_compat.keep_effects_in_loops(CounterEffect)
# Its chain is its Counter, which never leaves the computation.
_effects.register_chain_kind(CounterEffect, lambda effect, mode: effect.counter,
                             local_key_type=Counter)


counter_p = jcore.Primitive("jax_effects_counter")


def _abstract_eval(x, *, counter, op):
  # PLAIN_JIT_ORDER: under plain jax.jit, JAX orders it (_fallback_lowering)
  del op
  return x, {CounterEffect(counter), _effects.PLAIN_JIT_ORDER}


counter_p.def_effectful_abstract_eval(_abstract_eval)


def _impl(x, *, counter, op):
  """Eager: the count lives on the host, per thread."""
  state = counter.eager
  value = int(x) if op == "set" else getattr(state, "value", 0) + int(x)
  state.value = value
  return jnp.asarray(value, COUNT_DTYPE)


counter_p.def_impl(_impl)


def _jvp(primals, tangents, *, counter, op):
  del tangents
  out = counter_p.bind(*primals, counter=counter, op=op)
  return out, ad.Zero(jax.typeof(out).to_tangent_aval())


ad.primitive_jvps[counter_p] = _jvp


def _batcher(axis_data, args, dims, *, counter, op):
  del axis_data
  if op == "add_elements" and _effect.control_dependence.depth:
    raise _effect.elements_in_batched_loop_error(counter.description)
  if dims[0] is not None:
    raise NotImplementedError(
        f"{counter.description}: the count given to it is batched by "
        f"jax.vmap (it differs between the elements of the batch), but the "
        f"batch has one count: pass a count that is the same for every "
        f"element (e.g. the default n=1), or run the elements with "
        f"jax.lax.map or in a shard_map (one bar per device).")
  return counter_p.bind(*args, counter=counter, op=op), None


batching.fancy_primitive_batchers[counter_p] = _batcher


def _host_count(counter: Counter, op: str, x) -> tuple:
  """The count under plain ``jax.jit``: kept on the host, per device."""
  p = _placement.current()
  where = None if p is None else (p.device_id, p.shard_index)
  with counter.lock:
    counts = counter.host_counts
    value = int(x) if op == "set" else counts.get(where, 0) + int(x)
    counts[where] = value
  return (np.asarray(value, COUNT_DTYPE),)


def _fallback_lowering(ctx, x, *, counter, op):
  """Plain ``jax.jit``: an ordered host callback keeping the count."""
  host = _host_callback.HostCallback(
      functools.partial(_host_count, counter, op),
      f"{counter.description} (its count, kept on the host under plain "
      f"jax.jit)", (jax.core.ShapedArray((), COUNT_DTYPE),))
  return _effect.fallback_lowering(
      ctx, x, host_callback=host, effect=_effects.DEFAULT, ordered=True)


mlir.register_lowering(counter_p, _fallback_lowering, cacheable=False)


def _as_count(x):
  """``x`` as an ``int32`` scalar varying as the counter's carrier does."""
  x = jnp.asarray(x, COUNT_DTYPE)
  if jnp.shape(x):
    raise TypeError(f"a count must be a scalar, got shape {jnp.shape(x)}")
  return _compat.to_varying(x, jax.sharding.get_abstract_mesh().manual_axes)


def set_count(counter: Counter, value) -> jax.Array:
  """Sets ``counter`` to ``value``; returns it."""
  return counter_p.bind(_as_count(value), counter=counter, op="set")


def add_count(counter: Counter, n, elements: bool = False) -> jax.Array:
  """Adds ``n`` to ``counter``; returns the new count. ``elements``: ``n``
  counts the elements of the ``vmap``s around it."""
  return counter_p.bind(_as_count(n), counter=counter,
                        op="add_elements" if elements else "add")
