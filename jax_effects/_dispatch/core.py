"""The learnt state of one ``jax_effects.jit`` function, and the states its calls go through.

A :class:`Core` belongs to one (function, ``jit`` options) and is shared by
every ``PjitFunction`` of them (``registry``). It holds what calls learn: per
ordering mode the chains passed as runtime tokens and the ``jax.jit``
objects of ``g`` for them (``convention``, ``bodies``); the kept traces;
and the dispatch state, which decides what calling a ``PjitFunction`` calls
(:attr:`Core.call`):

==========  =================================================================
state       call target
==========  =================================================================
FIRST       :meth:`Core.first_call`: traces :attr:`Core.plain`; a program
            with effects learns its chains (:meth:`Core.learn`) and the call
            goes threaded, one without is a plain call (PURE)
PURE        :attr:`Core.plain` itself: a plain ``jax.jit`` call, no Python
            frame of ours
THREADED    :meth:`Core.call_threaded`: the general call path
            (``call_path.dispatch``)
FAST        the current mode's fast hook (``call_path.fast_dispatch``): one
            ordered chain, scalar tokens
FALLBACK    :meth:`Core.call_threaded`, after :attr:`Core.plain` traced a
            program with effects in PURE (:meth:`Core.effects_found`):
            possibly a call straight from ``jax.jit``'s C++ path, which ran
            them through JAX's ordered effects; the next threaded call first
            waits for them
==========  =================================================================

Transitions, each through :meth:`Core.enter` under :attr:`Core.lock`: FIRST
-> PURE when a first call found no effect; any -> THREADED when a call
learns a chain (from the first call's traced program, or a threaded trace's
:class:`NeedsTokens`, raised to the call) or a call returns a per-device
token; PURE -> FALLBACK (above); THREADED/FALLBACK -> FAST when a general
call finds the fast hook applies (FALLBACK first waits). Under an enclosing
trace every state binds :attr:`Core.plain`, a nested jit
(:meth:`Core.call_nested`); under ``jax.disable_jit()`` the user function
runs; neither changes the state.
Its part of the token calling convention: which tokens a call passes
(``keys``), see ``convention``.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable


from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._dispatch import bodies as _bodies
from jax_effects._dispatch import call_path as _call_path
from jax_effects._dispatch import convention as _convention
from jax_effects._dispatch import trace_cache as _trace_cache
from jax_effects._pass import token_pass as _token_pass
from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import per_device as _per_device
from jax_effects._runtime import raising as _raising
from jax_effects._runtime import threads as _threads

FIRST, PURE, THREADED, FAST, FALLBACK = (
    "first", "pure", "threaded", "fast", "fallback")
NeedsTokens = _bodies.NeedsTokens


class _Threaded:
  """A function's threaded path in one ordering mode.

  ``keys``: the ordered chains passed as runtime tokens, in order.
  ``per_device_sharding``: sharding of the per-device token returned last
  (None: scalar tokens). ``jitted``: the ``jax.jit`` objects of ``g`` for
  ``len(keys)`` tokens, by ``convention.n_dynamic``; dropped when ``keys``
  grows. ``fast``: the fast hook while it applies, else None. ``launch``:
  whether launches take the launch lock (``_launch_lock``).
  """
  __slots__ = ("keys", "per_device_sharding", "jitted", "fast", "launch")

  def __init__(self):
    self.keys: tuple = ()
    self.per_device_sharding = None
    self.jitted: dict[int | None, Any] = {}
    self.fast: Callable | None = None
    self.launch = _launch_lock.LaunchSite()


class Core:
  """What every ``PjitFunction`` of one (function, options) learnt (see above).

  The owner of its fast hooks (``call_path.FastHookOwner``): a hook falls
  back to :meth:`call_nested`/:meth:`call_threaded`, gives :meth:`learn` a
  :attr:`retry`'s chains and :meth:`per_device` a per-device token.
  """
  #: Raised by a trace that finds a chain the call passed no token for.
  retry = NeedsTokens

  def __init__(self, fun_ref: Callable, fun: Callable, jit_kwargs: dict):
    self.fun_ref = fun_ref
    self.jit_kwargs = jit_kwargs
    self.signature = _convention.signature(fun)
    self.names = _convention.names_of(fun)
    self.traces = _trace_cache.TraceCache(fun_ref)
    #: Guards state changes and each mode's ``keys``/``jitted`` (a jax.jit
    #: is built for ``len(keys)`` tokens while threads learn concurrently).
    self.lock = threading.RLock()
    self.first_call_guard = _compat.first_call_guard()
    self.modes: dict[str, _Threaded] = {}
    #: ``jax.jit`` of the user function as ``jax.jit`` traces it, effects
    #: kept (``bodies.plain``): the PURE target, and what a call under an
    #: enclosing trace binds (a nested jit).
    self.plain = _jax_api.jit(self.traceable(
        functools.partial(_bodies.plain, self), None), **jit_kwargs)
    self.state = FIRST
    self.call: Callable = self.first_call

  def fun(self) -> Callable:
    fun = self.fun_ref()
    if fun is None:
      raise ReferenceError("jax_effects.jit: the function was garbage-"
                           "collected")
    return fun

  def call_fun(self, *args, **kwargs):
    """Under ``jax.disable_jit()``: the user function itself (the eager
    impl of each effect orders it)."""
    return self.fun()(*args, **kwargs)

  def call_nested(self, *args, **kwargs):
    """Under an enclosing trace: a nested jit, as ``jax.jit``'s call binds.

    The enclosing trace gets one ``jit`` equation of :attr:`plain` (effects
    kept), which it transforms, caches and compiles as it does
    ``jax.jit``'s: inside an outer ``jax_effects.jit`` the pass inlines it
    and threads its effects with the outer's tokens. Under a transformation
    applied eagerly (``grad``/``vmap``/``jvp`` at the top level) JAX runs
    the jit before the bind returns, its effects ordered by JAX's own
    ordered effect (``effect._fallback_lowering``): around it the call
    raises the thread's pending errors, waits for the effects the thread
    dispatched before, then for the computation's (JAX's runtime token), so
    the thread's later calls follow it, and raises the errors of its
    callbacks (``design/errors.md``).
    """
    if _compat.disable_jit_flag.value:
      return self.call_fun(*args, **kwargs)
    if not _compat.eager_transformation():
      return self.plain(*args, **kwargs)
    state = _threads.thread_state()
    if _errors.deferred:
      _raising.raise_deferred(state)
    _barrier.wait_for_thread()
    out = self.plain(*args, **kwargs)
    token = _compat.jax_runtime_token(_effects.PLAIN_JIT_ORDER)
    if token is not None:
      token.block_until_ready()
    if _errors.deferred:
      _raising.raise_deferred(state)
    return out

  def traceable(self, body: Callable, tokens: int | None):
    return _convention.Traceable(body, self.fun_ref, self.names,
                                 self.signature, tokens)

  def enter(self, state: str, mode: str | None = None) -> None:
    """Switches to ``state`` (FAST: ``mode``'s hook); under :attr:`lock`."""
    if state is PURE:
      call = self.plain
    elif state is FAST:
      call = self.modes[mode].fast
    elif state is FIRST:
      call = self.first_call
    else:   # THREADED, FALLBACK
      call = self.call_threaded
    self.state = state
    self.call = call

  def threaded(self, mode: str) -> _Threaded:
    t = self.modes.get(mode)
    if t is None:
      t = self.modes.setdefault(mode, _Threaded())
    return t

  # --- learning ----------------------------------------------------------

  def keys_and_jit(self, mode: str, args: tuple = ()):
    """``(keys, jitted)``: ``mode``'s chains and the ``jax.jit`` of ``g``
    built for exactly ``len(keys)`` tokens, read together."""
    n_dynamic = _convention.n_dynamic(self.jit_kwargs, args)
    threaded = self.threaded(mode)
    with self.lock:
      keys = threaded.keys
      jitted = threaded.jitted.get(n_dynamic)
      if jitted is None:
        k = len(keys)
        body = functools.partial(_bodies.threaded, self, mode, k)
        jitted = _jax_api.jit(self.traceable(body, k),
                         **_convention.threaded_jit_kwargs(
                             self.jit_kwargs, n_dynamic, k))
        threaded.jitted[n_dynamic] = jitted
        self.refresh(mode)
    return keys, jitted

  def refresh(self, mode: str) -> None:
    """Builds or drops ``mode``'s fast hook after its chains, its ``jax.jit``
    objects or the shape of its tokens changed."""
    threaded = self.threaded(mode)
    with self.lock:
      jitted = threaded.jitted.get(None)
      keys = threaded.keys
      if (len(keys) == 1 and keys[0] is not _effects.UNORDERED
          and threaded.per_device_sharding is None and jitted is not None
          and self.state is not FALLBACK):
        threaded.fast = _call_path.fast_dispatch(
            self, mode, keys[0], jitted, site=threaded.launch)
      else:
        threaded.fast = None

  def learn(self, mode: str, keys: tuple) -> None:
    """A trace in ``mode`` found ``keys`` (the chains its program uses; a
    caller's, from a ``Traced`` or a :class:`NeedsTokens`)."""
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
    """:attr:`plain` traced a program with effects (``bodies.plain``).

    The one thing a trace tells the core: in PURE, calls go straight into
    ``jax.jit``'s C++ path, where no frame of ours runs, so this trace may
    be one such call's, about to run its effects through JAX's ordered
    effects: it follows the thread's dispatched effects, and the next call
    goes the general way (FALLBACK), which waits for it. Any other state
    learns its chains from its own calls.
    """
    if self.state is not PURE:
      return
    with self.lock:
      if self.state is not PURE:
        return
      self.enter(FALLBACK)
    _barrier.wait_for_thread()

  def per_device(self, mode: str, token) -> None:
    """A call in ``mode`` returned a per-device token (a shard_map program)."""
    with self.lock:
      self.threaded(mode).per_device_sharding = token.sharding
      self.refresh(mode)
      if self.state is not FALLBACK:
        self.enter(THREADED)

  # --- calls ---------------------------------------------------------------

  def first_call(self, *args, **kwargs):
    """FIRST: traces :attr:`plain`; with effects the call goes threaded,
    else it is a plain ``jax.jit`` call (PURE)."""
    if not _compat.compiled_dispatch():
      return self.call_nested(*args, **kwargs)
    if _fork.forked_after_backend:
      raise _fork.refused(   # (compiling would hang)
          f"calling jax_effects.jit({self.names['__name__']})")
    with self.first_call_guard:   # (JAX 0.8: one compile at a time)
      if self.state is not FIRST:   # decided by another thread meanwhile
        return self.call(*args, **kwargs)
      if _errors.deferred:
        _raising.raise_deferred(_threads.thread_state())
      mode = _effects.get_ordering()
      keys = self.chains(self.plain.trace(*args, **kwargs), mode)
      if keys is not None:
        self.learn(mode, keys)
        return self.call_threaded(*args, **kwargs)
      with self.lock:
        if self.state is FIRST:
          self.enter(PURE)
      # (the trace is jax.jit's: this call compiles it, it does not retrace)
      return self.plain(*args, **kwargs)

  @staticmethod
  def chains(traced, mode: str) -> tuple | None:
    """The runtime-token chains of a traced :attr:`plain` program, or None
    when it has nothing to thread (no effect, no counter)."""
    effects = traced.jaxpr.effects
    if not _token_pass.chain_keys(effects, mode):
      return None
    return _token_pass.runtime_chain_keys(effects, mode)

  def call_threaded(self, *args, **kwargs):
    """THREADED, FALLBACK: the general call path."""
    if not _compat.compiled_dispatch():
      return self.call_nested(*args, **kwargs)
    mode = _effects.get_ordering()
    state = _threads.thread_state()
    if self.state is FALLBACK:   # after JAX's ordered effects: wait for them
      _barrier.effects_barrier()
      with self.lock:
        if self.state is FALLBACK:
          self.enter(THREADED)
          for mode_ in list(self.modes):
            self.refresh(mode_)
    threaded = self.threaded(mode)
    while True:
      keys, jitted = self.keys_and_jit(mode, args)
      try:
        out, token = _call_path.dispatch(
            state, mode, keys, threaded.per_device_sharding, jitted, args,
            kwargs, threaded.launch)
      except NeedsTokens as err:
        self.learn(mode, err.keys)
        continue
      if (token.sharding is not threaded.per_device_sharding
          and _per_device.kept_on_devices(token)):
        with self.lock:
          threaded.per_device_sharding = token.sharding
          self.refresh(mode)
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
