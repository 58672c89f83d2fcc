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
FIRST       :meth:`Core.first_call`: the pure ``jax.jit``, learning (a trace
            that finds an effect raises ``NeedsTokens``: the chains are
            learnt and the call goes threaded)
PURE        the pure ``jax.jit`` object itself: a plain ``jax.jit`` call, no
            Python frame of ours
THREADED    :meth:`Core.call_threaded`: the general call path
            (``call_path.dispatch``)
FAST        the current mode's fast hook (``call_path.fast_dispatch``): one
            ordered chain, scalar tokens
FALLBACK    :meth:`Core.call_threaded`, after a PURE function's new signature
            had effects: traced straight from ``jax.jit``'s C++ path, that
            call ran them through JAX's ordered effects; the next threaded
            call first waits for them
==========  =================================================================

Transitions, each through :meth:`Core.enter` under :attr:`Core.lock`: FIRST
-> PURE when a first call found no effect; any -> THREADED when a trace
finds a chain (:meth:`Core.learn`) or a call returns a per-device token;
PURE -> FALLBACK (above); THREADED/FALLBACK -> FAST when a general call
finds the fast hook applies (FALLBACK first waits). A call under
``jax.disable_jit()`` runs the user function directly and changes nothing;
so does a threaded call under an enclosing trace, which threads its effects.
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
from jax_effects._pass import inlined_jit as _inlined_jit
from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import device_tokens as _device_tokens
from jax_effects._runtime import threads as _threads

FIRST, PURE, THREADED, FAST, FALLBACK = (
    "first", "pure", "threaded", "fast", "fallback")
NeedsTokens = _bodies.NeedsTokens
_RETRY = object()   # a first call that learnt: retried threaded


class _Threaded:
  """A function's threaded path in one ordering mode.

  ``keys``: the ordered chains passed as runtime tokens, in order.
  ``per_device_sharding``: sharding of the per-device token returned last
  (None: scalar tokens). ``jitted``: the ``jax.jit`` objects of ``g`` for
  ``len(keys)`` tokens, by ``convention.n_dynamic``; dropped when ``keys``
  grows. ``fast``: the fast hook while it applies, else None. ``launch``:
  whether launches take the launch lock (``_launch_lock``). ``may_fail``: a
  trace runs one of JAX's own host calls, which fail their execution when
  they raise (``ThreadTokens.tokens_for``; no fast hook).
  """
  __slots__ = ("keys", "per_device_sharding", "jitted", "fast", "launch",
               "may_fail")

  def __init__(self):
    self.keys: tuple = ()
    self.per_device_sharding = None
    self.jitted: dict[int | None, Any] = {}
    self.fast: Callable | None = None
    self.launch = _launch_lock.LaunchSite()
    self.may_fail = False


class Core:
  """What every ``PjitFunction`` of one (function, options) learnt (see above).

  The owner of its fast hooks (``call_path.FastHookOwner``): a hook falls
  back to :meth:`call_fun`/:meth:`call_threaded`, gives :meth:`learn` a
  :attr:`retry` and :meth:`per_device` a per-device token.
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
    self.pure = _jax_api.jit(self.traceable(
        functools.partial(_bodies.pure, self), None), **jit_kwargs)
    self.state = FIRST
    self.call: Callable = self.first_call

  def fun(self) -> Callable:
    fun = self.fun_ref()
    if fun is None:
      raise ReferenceError("jax_effects.jit: the function was garbage-"
                           "collected")
    return fun

  def call_fun(self, *args, **kwargs):
    """Under an enclosing trace or ``jax.disable_jit()``: the user function
    itself (the enclosing ``jax_effects.jit`` or the eager impl rules take
    care of the effects); traced, with this function's ``in_shardings`` and
    ``out_shardings`` as sharding constraints, as a nested ``jax.jit``
    applies them (``_pass.inlined_jit``)."""
    ins = self.jit_kwargs.get("in_shardings")
    outs = self.jit_kwargs.get("out_shardings")
    if (ins is None and outs is None) or _compat.disable_jit_flag.value:
      return self.fun()(*args, **kwargs)
    args = _inlined_jit.constrain_arguments(
        args, ins, _convention.argnums(self.jit_kwargs.get("static_argnums")))
    return _inlined_jit.constrain_tree(self.fun()(*args, **kwargs), outs)

  def traceable(self, body: Callable, tokens: int | None):
    return _convention.Traceable(body, self.fun_ref, self.names,
                                 self.signature, tokens)

  def enter(self, state: str, mode: str | None = None) -> None:
    """Switches to ``state`` (FAST: ``mode``'s hook); under :attr:`lock`."""
    if state is PURE:
      call = self.pure
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
          and self.state is not FALLBACK and not threaded.may_fail):
        threaded.fast = _call_path.fast_dispatch(
            self, mode, keys[0], jitted, site=threaded.launch)
      else:
        threaded.fast = None

  def learn(self, mode: str, err: NeedsTokens, fallback: bool = False):
    """A trace in ``mode`` found chains the call passed no token for."""
    threaded = self.threaded(mode)
    with self.lock:
      if fallback:
        self.enter(FALLBACK)
      new = tuple(k for k in err.keys if k not in threaded.keys)
      if new:   # the jax.jit objects take len(keys) tokens: new ones for more
        threaded.keys += new
        threaded.jitted = {}
      self.refresh(mode)
      if self.state is not FALLBACK:
        self.enter(THREADED)

  def may_fail(self, mode: str) -> None:
    """A trace in ``mode`` runs one of JAX's own host calls that fail their
    execution (``_Threaded.may_fail``)."""
    threaded = self.threaded(mode)
    if not threaded.may_fail:
      with self.lock:
        threaded.may_fail = True
        self.refresh(mode)
        if self.state is FAST:
          self.enter(THREADED)

  def per_device(self, mode: str, token) -> None:
    """A call in ``mode`` returned a per-device token (a shard_map program)."""
    with self.lock:
      self.threaded(mode).per_device_sharding = token.sharding
      self.refresh(mode)
      if self.state is not FALLBACK:
        self.enter(THREADED)

  # --- calls ---------------------------------------------------------------

  def first_call(self, *args, **kwargs):
    """FIRST: the pure ``jax.jit``, strict, learning."""
    if _compat.disable_jit_flag.value:   # eager: nothing to learn from
      return self.call_fun(*args, **kwargs)
    if _fork.forked_after_backend and _compat.at_top_level():
      raise _fork.refused(   # (compiling would hang)
          f"calling jax_effects.jit({self.names['__name__']})")
    with self.first_call_guard:   # (JAX 0.8: one compile at a time)
      if self.state is not FIRST:   # decided by another thread meanwhile
        return self.call(*args, **kwargs)
      if _errors.deferred and _compat.at_top_level():
        _errors.raise_deferred(_threads.thread_state())
      previous = getattr(_bodies.strict, "on", False)
      _bodies.strict.on = True
      try:
        out = self.pure(*args, **kwargs)
      except NeedsTokens as err:
        self.learn(_effects.get_ordering(), err)
        out = _RETRY
      finally:
        _bodies.strict.on = previous
      if out is _RETRY:
        # Outside the handler: neither an error of the threaded call nor an
        # exception a user callback handles gets NeedsTokens as __context__.
        return self.call_threaded(*args, **kwargs)
      with self.lock:
        if self.state is FIRST:
          self.enter(PURE)
      return out

  def call_threaded(self, *args, **kwargs):
    """THREADED, FALLBACK: the general call path."""
    if not _compat.compiled_dispatch():
      return self.call_fun(*args, **kwargs)
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
        may_fail = threaded.may_fail
        out, token = _call_path.dispatch(
            state, mode, keys, threaded.per_device_sharding, jitted, args,
            kwargs, threaded.launch, may_fail)
      except NeedsTokens as err:
        self.learn(mode, err)
        continue
      if threaded.may_fail and not may_fail:   # (learnt by this call's trace)
        state.mark_at_risk(keys)
      if (token.sharding is not threaded.per_device_sharding
          and _device_tokens.kept_on_devices(token)):
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
    return [self.pure, *(j for t in list(self.modes.values())
                         for j in list(t.jitted.values()))]

  def clear_cache(self) -> None:
    self.traces.clear()
    for jitted in self.jax_jits():
      jitted.clear_cache()

  def cache_size(self) -> int:
    return sum(j._cache_size() for j in self.jax_jits())
