"""The learnt state of one ``jax_effects.jit`` function: its dispatch states.

A :class:`Core` belongs to one (function, ``jit`` options) and is shared by
every ``PjitFunction`` of them (:func:`core_for`, keyed weakly by the
function as ``jax.jit``'s caches are; a function that cannot be weakly
referenced, or options that cannot be hashed, get a core of their own).
It holds what calls learn: per ordering mode the chains passed as runtime
tokens and the ``jax.jit`` objects of ``g`` for them (``tracing``), the kept
traces, and the dispatch state (FIRST, PURE, THREADED, FAST, FALLBACK),
which decides what calling a ``PjitFunction`` calls (:attr:`Core.call`);
every change goes through :meth:`Core.enter` under :attr:`Core.lock`. The
states, their transitions and how learning goes one way (a trace returns
what it found to its call): ``design/architecture.md``, ``_dispatch``.
Nothing here keeps a function alive.

Its part of the token calling convention: which tokens a call passes
(``keys``), see ``tracing``.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable
import weakref

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._dispatch import call_path as _call_path
from jax_effects._dispatch import tracing as _tracing
from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import token_store as _token_store

FIRST, PURE, THREADED, FAST, FALLBACK = (
    "first", "pure", "threaded", "fast", "fallback")


class _Threaded:
  """A function's threaded path in one ordering mode.

  ``keys``: the ordered chains passed as runtime tokens, in order.
  ``per_device_sharding``: that of the per-device token returned last (None:
  scalar tokens). ``jitted``: ``g``'s ``jax.jit`` objects for ``len(keys)``
  tokens, by ``tracing.n_dynamic``. ``fast``: the fast hook while it
  applies. ``launch``: the ``launch_lock`` site of its launches.
  """
  __slots__ = ("keys", "per_device_sharding", "jitted", "fast", "launch")

  def __init__(self):
    self.keys: tuple = ()
    self.per_device_sharding = None
    self.jitted: dict[int | None, Any] = {}
    self.fast: Callable | None = None
    self.launch = _launch_lock.LaunchSite()


class Core:
  """What every ``PjitFunction`` of one (function, options) learnt."""

  def __init__(self, fun_ref: Callable, fun: Callable, jit_kwargs: dict):
    self.fun_ref = fun_ref
    self.jit_kwargs = jit_kwargs
    try:
      self.signature: inspect.Signature | None = inspect.signature(fun)
    except (TypeError, ValueError):   # (where it has none)
      self.signature = None
    self.names = _tracing.names_of(fun)
    self.traces = _tracing.TraceCache(fun_ref)
    #: Guards state changes and each mode's ``keys``/``jitted``.
    self.lock = threading.RLock()
    self.first_call_guard = _compat.first_call_guard()
    self.modes: dict[str, _Threaded] = {}
    #: ``jax.jit`` of the user function, effects kept (``tracing.plain``):
    #: the PURE target, and what a call under a trace binds (a nested jit).
    self.plain = _jax_api.jit(self.traceable(functools.partial(
        _tracing.plain, self.traces, self.effects_found), None), **jit_kwargs)
    self.state = FIRST
    self.call: Callable = self.first_call

  def traceable(self, body: Callable, tokens: int | None):
    return _tracing.Traceable(body, self.fun_ref, self.names,
                              self.signature, tokens)

  def enter(self, state: str, mode: str | None = None) -> None:
    """Switches to ``state`` (FAST: ``mode``'s hook); under :attr:`lock`."""
    self.state = state
    if state is PURE:
      self.call = self.plain
    elif state is FAST:
      self.call = self.modes[mode].fast
    elif state is FIRST:
      self.call = self.first_call
    else:   # THREADED, FALLBACK
      self.call = self.call_threaded

  def threaded(self, mode: str) -> _Threaded:
    return self.modes.get(mode) or self.modes.setdefault(mode, _Threaded())

  # --- learning ----------------------------------------------------------

  def keys_and_jit(self, mode: str, args: tuple = ()):
    """``(keys, jitted)``: ``mode``'s chains and ``g``'s ``jax.jit`` for
    ``len(keys)`` tokens, read together."""
    n_dynamic = _tracing.n_dynamic(self.jit_kwargs, args)
    threaded = self.threaded(mode)
    with self.lock:
      keys = threaded.keys
      jitted = threaded.jitted.get(n_dynamic)
      if jitted is None:
        k = len(keys)
        body = functools.partial(_tracing.threaded, self.traces, mode, keys)
        jitted = _jax_api.jit(self.traceable(body, k),
                              **_tracing.threaded_jit_kwargs(
                                  self.jit_kwargs, n_dynamic, k))
        threaded.jitted[n_dynamic] = jitted
        self.refresh(mode)
    return keys, jitted

  def refresh(self, *modes: str) -> None:
    """Builds or drops the fast hook of each of ``modes`` (none: of every
    mode) after its chains, its ``jax.jit`` objects or the shape of its
    tokens changed."""
    with self.lock:
      for mode in modes or list(self.modes):
        threaded = self.threaded(mode)
        jitted = threaded.jitted.get(None)
        keys = threaded.keys
        if (len(keys) == 1 and keys[0] is not _effects.UNORDERED
            and jitted is not None
            and self.state is not FALLBACK and not self.traces.may_fail):
          # (none where computations may fail as a whole: tokens_for waits)
          threaded.fast = _call_path.fast_dispatch(
              mode, keys[0], jitted, site=threaded.launch,
              general=self.call_threaded,
              sharding=threaded.per_device_sharding)   # (None: scalar tokens)
        else:
          threaded.fast = None

  def learn(self, mode: str, keys: tuple) -> None:
    """A trace in ``mode`` found the chains ``keys``."""
    threaded = self.threaded(mode)
    with self.lock:
      new = tuple(k for k in keys if k not in threaded.keys)
      if new:   # the jax.jit objects take len(keys) tokens: new ones for more
        threaded.keys += new
        threaded.jitted = {}
      self.refresh(mode)
      if self.state is not FALLBACK:
        self.enter(THREADED)

  def effects_found(self) -> None:
    """:attr:`plain` traced a program with effects: in PURE, possibly a call
    from ``jax.jit``'s C++ path about to run them through JAX's ordered
    effects; it follows the thread's effects, the next call waits (FALLBACK).
    """
    if self.state is not PURE:
      return
    with self.lock:
      if self.state is not PURE:
        return
      self.enter(FALLBACK)
    _barrier.wait_for_thread()

  # --- calls ---------------------------------------------------------------

  @_compat.api_boundary   # (a user error's traceback shows no frame of ours)
  def first_call(self, *args, **kwargs):
    """FIRST: traces :attr:`plain`; threaded with effects, else PURE."""
    if not _compat.compiled_dispatch():
      return call_nested(self, *args, **kwargs)
    if _fork.forked_after_backend:
      raise _fork.refused(   # (compiling would hang)
          f"calling jax_effects.jit({self.names['__name__']})")
    with self.first_call_guard:   # (JAX 0.8: one compile at a time)
      if self.state is not FIRST:   # decided by another thread meanwhile
        return self.call(*args, **kwargs)
      if _errors.deferred:
        _errors.raise_deferred(_threads.thread_state())
      mode = _effects.get_ordering()
      keys = chains(_tracing.program_effects(
          self.traces, self.plain, args, kwargs), mode)
      if keys is not None:
        self.learn(mode, keys)
        return self.call_threaded(*args, **kwargs)
      with self.lock:
        if self.state is FIRST:
          self.enter(PURE)
      # (the trace is jax.jit's: this call compiles it, it does not retrace)
      return self.plain(*args, **kwargs)

  @_compat.api_boundary
  def call_threaded(self, *args, **kwargs):
    """THREADED, FALLBACK: the general call path."""
    if not _compat.compiled_dispatch():
      return call_nested(self, *args, **kwargs)
    mode = _effects.get_ordering()
    state = _threads.thread_state()
    if self.state is FALLBACK:   # after JAX's ordered effects: wait for them
      _barrier.effects_barrier()
      with self.lock:
        if self.state is FALLBACK:
          self.enter(THREADED)
          self.refresh()
    threaded = self.threaded(mode)
    if self.traces.user_code and threaded.launch.finish is None:
      _launch_lock.wait_for_user_code(threaded.launch)
    while True:
      keys, jitted = self.keys_and_jit(mode, args)
      may_fail = self.traces.may_fail
      try:
        out, token = _call_path.dispatch(
            state, mode, keys, threaded.per_device_sharding, jitted, args,
            kwargs, threaded.launch, may_fail)
      except _call_path.NeedsTokens as err:
        self.learn(mode, err.keys)
        continue
      if self.traces.user_code and threaded.launch.finish is None:
        # (learnt by this call's trace: it runs user code, launch_lock)
        _launch_lock.wait_for_user_code(threaded.launch)
        if state.dispatching == 0:   # (not inside a call of its own)
          _launch_lock.finish(token, state.python_thread)
      if self.traces.may_fail and not may_fail:
        # (learnt by this call's trace: it may fail as a whole, no hook)
        state.mark_at_risk(keys)
        with self.lock:
          self.refresh()
          if self.state is FAST:
            self.enter(THREADED)
      if (token.sharding is not threaded.per_device_sharding
          and _token_store.kept_on_devices(token)):
        with self.lock:   # (learnt here only: the fast hook comes here)
          threaded.per_device_sharding = token.sharding
          self.refresh(mode)
          if self.state is FAST and self.call is not threaded.fast:
            self.enter(THREADED)   # (its hook went)
      if threaded.fast is not None and self.call is not threaded.fast:
        with self.lock:
          if threaded.fast is not None and self.state is not FALLBACK:
            self.enter(FAST, mode)
      return out

  # --- caches ----------------------------------------------------------------

  def jax_jits(self) -> list:
    """Every ``jax.jit`` object of this core."""
    return [self.plain, *(j for t in list(self.modes.values())
                         for j in list(t.jitted.values()))]

  def clear_cache(self) -> None:
    self.traces.clear()
    for jitted in self.jax_jits():
      jitted.clear_cache()

  def cache_size(self) -> int:
    return sum(j._cache_size() for j in self.jax_jits())


def chains(effects, mode: str) -> tuple | None:
  """The runtime-token chains of a program with JAX ``effects``, or None
  when it has nothing to thread (no effect, no counter)."""
  if not _effects.chain_keys(effects, mode):
    return None
  return _effects.runtime_chain_keys(effects, mode)


# --- outside the threaded path ---------------------------------------------


def call_nested(core: Core, *args, **kwargs):
  """Under an enclosing trace: a nested jit of :attr:`Core.plain`, as
  ``jax.jit``'s call binds; under an eagerly applied transformation, ordered
  around the thread's calls (``design/architecture.md``, ``_dispatch``).
  """
  if (_compat.disable_jit_flag.value
      or _compat.enclosing_staging() == "pmap"):
    # (pmap staged as itself, an option of JAX 0.8 and 0.9: inside it the
    # function runs, so an effect refuses it naming itself, bind_effect)
    return core.traces.fun()(*args, **kwargs)
  if not _compat.eager_transformation():
    return core.plain(*args, **kwargs)
  state = _threads.thread_state()
  if _errors.deferred:
    _errors.raise_deferred(state)
  _barrier.wait_for_thread()
  out = core.plain(*args, **kwargs)
  token = _compat.jax_runtime_token(_effects.PLAIN_JIT_ORDER)
  if token is not None:
    _token_store.settled(token)   # (a failure there is the computation's)
  if _errors.deferred:
    _errors.raise_deferred(state)
  return out


# --- one core per (function, options) ----------------------------------------

#: (id(fun), options key) -> (weak reference to fun, core)
_cores: dict[tuple, tuple[weakref.ref, Core]] = {}
_cores_lock = threading.Lock()


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


def core_for(fun: Callable, jit_kwargs: dict) -> Core:
  """The core of ``(fun, jit_kwargs)``: the shared one, or a new one
  registered while ``fun`` lives (see the module docstring)."""
  try:   # (equal for equal options)
    options = frozenset((k, _freeze(v)) for k, v in jit_kwargs.items())
  except TypeError:   # an option that cannot be hashed: not shared
    options = None
  key = (id(fun), options)
  entry = _cores.get(key) if options is not None else None
  if entry is not None and entry[0]() is fun:
    return entry[1]
  try:
    ref = weakref.ref(fun, lambda r, key=key: _drop(key, r))
  except TypeError:   # cannot be weakly referenced: not shared
    return Core(lambda: fun, fun, jit_kwargs)
  if options is None:
    return Core(weakref.ref(fun), fun, jit_kwargs)
  with _cores_lock:
    entry = _cores.get(key)
    if entry is not None and entry[0]() is fun:   # made by another thread
      return entry[1]
    core = Core(weakref.ref(fun), fun, jit_kwargs)
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
