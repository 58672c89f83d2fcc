"""One learnt state per (function, ``jit`` options), shared by its ``PjitFunction`` objects.

``jax.jit(f)`` written inline (a new object per call: in a loop, a lambda, a
library) traces ``f`` once, because JAX keys its caches by the function and
the options, holding the function weakly. ``jax_effects.jit`` does the same
one level up: every ``PjitFunction`` of the same function object and equal
options shares one :class:`~jax_effects._dispatch.core.Core` (the chains
learnt, the ``jax.jit`` objects and their executables, the kept traces, the
dispatch state), so a new ``PjitFunction`` of a known function starts where the
last one left off.

Identity of the function, as JAX's C++ cache: a bound method, a
``functools.partial`` or a lambda made anew for each call is a new function
(and is traced again, as under ``jax.jit``). The entry holds the function
weakly and goes when it does; the core holds it weakly too, so an entry
never keeps its function alive (each ``PjitFunction`` holds it strongly). A
function that cannot be weakly referenced, or options that cannot be
hashed, get a core of their own, not shared. Its part of the token calling
convention: none (a core's jax.jit objects follow ``convention``).
"""
from __future__ import annotations

import threading
from typing import Any, Callable
import weakref

#: (id(fun), options key) -> (weak reference to fun, core)
_cores: dict[tuple, tuple[weakref.ref, Any]] = {}
_lock = threading.Lock()


def _freeze(value):
  """A hashable stand-in for one ``jit`` option (TypeError if none)."""
  if isinstance(value, (tuple, list)):
    return (type(value), tuple(_freeze(v) for v in value))
  if isinstance(value, dict):
    return (dict, frozenset((k, _freeze(v)) for k, v in value.items()))
  if isinstance(value, (set, frozenset)):
    return (frozenset, frozenset(_freeze(v) for v in value))
  hash(value)
  return value


def options_key(jit_kwargs: dict):
  """Equal for equal ``jit`` options; None where one cannot be hashed."""
  if not jit_kwargs:
    return ()
  try:
    return frozenset((k, _freeze(v)) for k, v in jit_kwargs.items())
  except TypeError:
    return None


def core_for(fun: Callable, jit_kwargs: dict, make: Callable) -> Any:
  """The core of ``(fun, jit_kwargs)``: the shared one, or a new one made
  by ``make(fun_ref)`` (``fun_ref()`` returns ``fun``, or None once it is
  gone) and registered while ``fun`` lives."""
  options = options_key(jit_kwargs)
  key = (id(fun), options)
  entry = _cores.get(key) if options is not None else None
  if entry is not None and entry[0]() is fun:
    return entry[1]
  try:
    ref = weakref.ref(fun, lambda r, key=key: _drop(key, r))
  except TypeError:   # cannot be weakly referenced: not shared
    return make(lambda: fun)
  if options is None:
    return make(weakref.ref(fun))
  with _lock:
    entry = _cores.get(key)
    if entry is not None and entry[0]() is fun:   # made by another thread
      return entry[1]
    core = make(weakref.ref(fun))
    _cores[key] = (ref, core)
    return core


def _drop(key: tuple, ref: weakref.ref) -> None:
  # A weakref callback (possibly inside garbage collection, on any thread):
  # no lock. The entry is this function's while it dies: no other object
  # can have its id before it is freed.
  entry = _cores.get(key)
  if entry is not None and entry[0] is ref:
    _cores.pop(key, None)


def registered() -> int:
  """How many (function, options) cores are registered (for tests)."""
  return len(_cores)
