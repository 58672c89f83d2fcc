"""``jax_effects.jit``: the dispatch hook around ``jax.jit``.

A :class:`Function` owns ``jax.jit`` objects whose traced function is::

    g(t_1, ..., t_k, *args, **kwargs) -> (outputs, token)

where ``t_i`` is the calling thread's runtime token of the i-th ordered chain
the function uses (in a fixed order, :attr:`Function.keys`). The tokens are
the first ``k`` positional arguments (``static_argnums``/``donate_argnums``
are shifted by ``k``, ``in_shardings`` gets None for them): ``jax.jit``
refuses keyword arguments when ``in_shardings`` is given, and a tuple
argument would cost a pytree level on every dispatch. Tracing ``g``
traces the user function to a jaxpr and runs the token-threading pass on it
(``_pass.token_pass``), re-tracing the result into ``g``'s trace. The pass leaves
no JAX-level effect behind, so ``jax.jit``'s C++ fast path dispatches ``g``;
the Python hook around it only reads the runtime tokens from
``call_path`` and stores the returned token.

Which chains a function uses is learnt while tracing: a trace that finds a
chain the call did not pass a runtime token for raises :class:`NeedsTokens`,
the hook adds the chain to :attr:`Function.keys` and calls again (through a
new ``jax.jit`` object for the new number of tokens). Until a trace finds any
effect, calls go through a ``jax.jit`` with no token argument, and once a call
has found the function pure, calling the :class:`Function` *is* calling that
``jax.jit`` object (``__call__`` is a property returning it): a function with
no effects costs a plain ``jax.jit`` call. If a later signature of such a
function has effects, that trace cannot hand back to Python: it keeps the
effect equations (JAX's own ordered effects order them, after this thread's
earlier effects, through JAX's slower dispatch) and switches the function to
the threaded path for every later call.

Calls under an enclosing transformation or trace, and calls with
``jax.disable_jit()``, run the user function directly: the enclosing
``jax_effects.jit`` (or the eager impl rules) takes care of the effects.

The rest of ``jax.jit``'s API: ``trace``/``lower``/``eval_shape`` go through
the same learning as a call; :class:`Traced`, :class:`Lowered` and
:class:`Compiled` wrap JAX's stages of whichever ``jax.jit`` the call would
use and show the user's arguments and outputs (``args_info``, ``in_tree``,
``out_info``, ``input_shardings``, ...), never the token argument or
result; ``Compiled.__call__`` runs the dispatch hook. ``jax.export`` of a
function with effects is refused (host callbacks cannot be serialized); a
pure one exports as under ``jax.jit``.
"""
from __future__ import annotations

import functools
import inspect
import operator
import threading
import types
from typing import (TYPE_CHECKING, Any, Callable, Generic, ParamSpec, TypeVar,
                    overload)

import jax
from jax import tree_util
from jax.extend import core as jex_core
import jax.numpy as jnp

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._dispatch import call_path as _call_path
from jax_effects._dispatch import stages as _stages
from jax_effects._dispatch import trace_cache as _trace_cache
from jax_effects._pass import token_pass as _token_pass
from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import per_device as _per_device
from jax_effects._runtime import raising as _raising
from jax_effects._runtime import threads as _threads

# Set while a call can catch NeedsTokens (see Function._first_call).
_strict = threading.local()

TOKENS_KW = _call_path.TOKENS_KW

# Returned by a call that must be retried (after NeedsTokens).
_RETRY = object()


class NeedsTokens(Exception):
  """Raised from inside a trace: the call did not pass these chains' tokens."""

  def __init__(self, keys):
    super().__init__(f"jax_effects: retrace with runtime tokens for {keys}")
    self.keys = keys


def _signature_with_tokens(sig: inspect.Signature | None, k: int):
  """``sig`` (a user function's) with ``k`` runtime-token parameters first."""
  if sig is None:
    return None
  extra = [inspect.Parameter(f"{TOKENS_KW}_{i}", inspect.Parameter.POSITIONAL_ONLY)
           for i in range(k)]
  return sig.replace(parameters=[*extra, *sig.parameters.values()])


def _signature(fun) -> inspect.Signature | None:
  try:
    return inspect.signature(fun)
  except (TypeError, ValueError):
    return None


def _argnums(value) -> tuple:
  if value is None:
    return ()
  return (value,) if isinstance(value, int) else tuple(value)


def _threaded_jit_kwargs(jit_kwargs: dict, n_dynamic: int | None,
                         k: int) -> dict:
  """``jax.jit`` keyword arguments for ``g(t_1, ..., t_k, *args, **kwargs)``.

  Positional indices shift by ``k`` (negative ones are unchanged); the tokens
  get no sharding constraint (None) and no sharding on the output.
  ``n_dynamic`` is the number of non-static positional arguments, needed only
  when ``in_shardings`` is one sharding for every argument.
  """
  kwargs = dict(jit_kwargs)
  for name in ("static_argnums", "donate_argnums"):
    if kwargs.get(name) is not None:
      kwargs[name] = tuple(n + k if n >= 0 else n
                           for n in _argnums(kwargs[name]))
  if kwargs.get("in_shardings") is not None:
    s = kwargs["in_shardings"]
    if isinstance(s, (tuple, list)):
      kwargs["in_shardings"] = (*([None] * k), *s)
    else:
      kwargs["in_shardings"] = (*([None] * k), *([s] * n_dynamic))
  if "out_shardings" in kwargs:
    kwargs["out_shardings"] = (kwargs["out_shardings"], None)
  return kwargs


class _Threaded:
  """A :class:`Function`'s threaded path in one ordering mode.

  ``keys``: the ordered chains passed as runtime tokens, in order (learnt
  while tracing, :class:`NeedsTokens`). ``per_device_sharding``: sharding of
  the per-device token the function returned last (None: scalar tokens).
  ``jitted``: the ``jax.jit`` objects of ``g(*tokens, *args, **kwargs)`` for
  ``len(keys)`` tokens, by number of dynamic arguments (None unless one
  ``in_shardings`` is given for every argument); dropped when ``keys`` grows.
  """
  __slots__ = ("keys", "per_device_sharding", "jitted", "fast", "launch")

  def __init__(self):
    self.keys: tuple = ()
    self.per_device_sharding = None
    self.jitted: dict[int | None, Any] = {}
    #: The fast dispatch hook (``_call_path.fast_dispatch``) while it
    #: applies: one ordered chain, scalar tokens, one jax.jit for every call
    #: (see ``Function._refresh``); else None.
    self.fast: Callable | None = None
    #: Whether launches take ``_launch_lock.launch_lock`` (several CPU
    #: devices: see there).
    self.launch = _launch_lock.LaunchSite()


_P = ParamSpec("_P")
_R = TypeVar("_R")


class Function(Generic[_P, _R]):
  """A jitted function whose side effects are token-threaded.

  Call it like the function it wraps. Offers what a ``jax.jit`` object
  offers: ``.trace``, ``.lower`` (a :class:`Lowered` whose ``.as_text()`` is
  the StableHLO of the threaded computation), ``.eval_shape``,
  ``.clear_cache``, ``__wrapped__``, ``copy.copy``/``copy.deepcopy``/pickle
  (a fresh Function of the same function and options), and use as a method
  (a bound ``types.MethodType``).
  """

  def __init__(self, fun: Callable[_P, _R], **jit_kwargs: Any) -> None:
    if not callable(fun):
      raise TypeError(f"jax_effects.jit expects a callable, got {fun!r}")
    names = jit_kwargs.get("static_argnames") or ()
    if any(str(n).startswith(TOKENS_KW)
           for n in ((names,) if isinstance(names, str) else names)):
      raise ValueError(f"names starting with {TOKENS_KW} are reserved by "
                       "jax_effects")
    functools.update_wrapper(self, fun)
    self._fun = fun
    self._jit_kwargs = jit_kwargs
    self._signature = _signature(fun)
    self._effectful = False
    self._after_fallback = False
    self._dispatch = self._first_call
    self._first_call_guard = _compat.first_call_guard()
    self._traces = _trace_cache.TraceCache(fun)
    # Guards each mode's ``keys`` and ``jitted`` (see _keys_and_jit): a
    # ``jax.jit`` object is built for ``len(keys)`` tokens, and threads learn
    # and build concurrently.
    self._learn_lock = threading.RLock()
    #: ordering mode -> the threaded path in that mode
    self._modes: dict[str, _Threaded] = {}
    self._pure = jax.jit(self._wrap(self._trace_pure, None), **jit_kwargs)

  @property
  def keys(self) -> dict[str, tuple]:
    """Ordering mode -> the ordered chains passed as runtime tokens."""
    return {mode: t.keys for mode, t in self._modes.items()}

  def _threaded(self, mode: str) -> _Threaded:
    t = self._modes.get(mode)
    if t is None:
      t = self._modes.setdefault(mode, _Threaded())
    return t

  def __repr__(self):
    return f"<jax_effects.jit of {getattr(self._fun, '__qualname__', self._fun)}>"

  def __get__(self, instance: Any, owner: Any = None) -> Any:
    # As jax.jit objects: a bound method when looked up on an instance.
    if instance is None:
      return self
    return types.MethodType(self, instance)

  # --- tracing -----------------------------------------------------------------

  def _wrap(self, traced, tokens: int | None):
    """The function ``jax.jit`` traces: ``f``'s signature, with ``tokens``
    token parameters in front (None: no signature of ours, as for the pure
    path) so JAX names arguments as for ``f``."""
    @functools.wraps(self._fun)
    def g(*args, **kwargs):
      return traced(args, kwargs)
    if tokens is not None and self._signature is not None:
      g.__signature__ = _signature_with_tokens(self._signature, tokens)
    return g

  def _trace_pure(self, args, kwargs):
    closed, dyn, out_tree = self._traces.trace(args, kwargs)
    mode = _effects.get_ordering()
    keys = _token_pass.runtime_chain_keys(closed.effects, mode)
    if keys:  # unordered effects need the threaded path too, but no token
      # (unordered effects get a token too: the thread's initial token, never
      # stored back, so their carrier holds the thread's slot for errors)
      err = NeedsTokens(keys)
      if getattr(_strict, "on", False):
        raise err
      # A new signature of a function that was pure so far, called straight
      # into jax.jit's C++ path (no frame of ours to catch NeedsTokens): later
      # calls take the threaded path; this one keeps its effect equations, so
      # JAX's own ordered effects order them (its slower dispatch, once),
      # after this thread's effects dispatched so far.
      self._after_fallback = True   # (no fast hook until then: _refresh)
      self._learn(mode, err)
      _barrier.wait_for_thread()
      outs = jex_core.jaxpr_as_fun(closed)(*dyn)
      return tree_util.tree_unflatten(out_tree, outs)
    outs, _ = _token_pass.thread_program(closed, dyn, {}, mode)
    return tree_util.tree_unflatten(out_tree, outs)

  def _trace_threaded(self, mode, k, args, kwargs):
    runtime, args = args[:k], args[k:]
    if _compat.disable_jit_flag.value:
      # Under jax.disable_jit, jax.jit calls this function with the values
      # instead of tracing it (the fast hook does not check the flag): after
      # the thread's dispatched effects, the user function runs eagerly (its
      # effects through the eager impl, in order); any of the tokens, all
      # ready, is the new one.
      jax.block_until_ready(runtime)
      out = self._fun(*args, **kwargs)
      # (the hook stores a jax.Array: it reads its sharding)
      return out, _threads.as_array(
          runtime[0] if runtime else
          _threads.initial_token(_threads.thread_state()))
    closed, dyn, out_tree = self._traces.trace(args, kwargs)
    known = self._threaded(mode).keys
    missing = tuple(
        k for k in _token_pass.runtime_chain_keys(closed.effects, mode)
        if k not in known)
    if missing or len(runtime) != len(known):
      raise NeedsTokens(missing)
    outs, token = _token_pass.thread_program(
        closed, dyn, dict(zip(known, runtime)), mode)
    if token is None:
      token = jnp.zeros((), _errors.TOKEN_DTYPE)
    return tree_util.tree_unflatten(out_tree, outs), token

  def _threaded_jit(self, mode: str, args: tuple = ()):
    """The ``jax.jit`` of ``g(*tokens, *args, **kwargs)`` for ``mode``."""
    return self._keys_and_jit(mode, args)[1]

  def _keys_and_jit(self, mode: str, args: tuple = ()):
    """``(keys, jitted)``: ``mode``'s chains and the ``jax.jit`` of
    ``g(*tokens, *args, **kwargs)`` built for exactly ``len(keys)`` tokens
    (read together, under ``_learn_lock``: another thread may learn a chain
    meanwhile)."""
    n_dynamic = None
    s = self._jit_kwargs.get("in_shardings")
    if s is not None and not isinstance(s, (tuple, list)):
      # one sharding for all arguments: expand it per number of arguments
      n = len(args)
      static = {i % n for i in _argnums(self._jit_kwargs.get("static_argnums"))
                if -n <= i < n}
      n_dynamic = n - len(static)
    threaded = self._threaded(mode)
    with self._learn_lock:
      keys = threaded.keys
      jitted = threaded.jitted.get(n_dynamic)
      if jitted is None:
        k = len(keys)
        traced = functools.partial(self._trace_threaded, mode, k)
        jitted = jax.jit(self._wrap(traced, k),
                         **_threaded_jit_kwargs(self._jit_kwargs, n_dynamic, k))
        threaded.jitted[n_dynamic] = jitted
        self._refresh(mode)
    return keys, jitted

  def _refresh(self, mode: str) -> None:
    """Builds or drops ``mode``'s fast dispatch hook after its chains, its
    ``jax.jit`` objects or the shape of its tokens changed."""
    threaded = self._threaded(mode)
    with self._learn_lock:
      jitted = threaded.jitted.get(None)
      keys = threaded.keys
      if (len(keys) == 1 and keys[0] is not _effects.UNORDERED
          and threaded.per_device_sharding is None and jitted is not None
          and not self._after_fallback):
        threaded.fast = _call_path.fast_dispatch(
            mode, keys[0], jitted, fun=self._fun, general=self._call_threaded,
            learn=functools.partial(self._learn, mode), retry=NeedsTokens,
            per_device=functools.partial(self._per_device, mode),
            site=threaded.launch)
      else:
        threaded.fast = None

  def _per_device(self, mode: str, token) -> None:
    """A call in ``mode`` returned a per-device token (a shard_map program)."""
    self._threaded(mode).per_device_sharding = token.sharding
    self._refresh(mode)
    self._dispatch = self._call_threaded

  def _learn(self, mode: str, err: NeedsTokens) -> None:
    threaded = self._threaded(mode)
    with self._learn_lock:
      new = tuple(k for k in err.keys if k not in threaded.keys)
      if new:   # the jax.jit objects take len(keys) tokens: new ones for more
        threaded.keys += new
        threaded.jitted = {}
      self._refresh(mode)
    self._effectful = True
    self._dispatch = self._call_threaded

  # --- dispatch ------------------------------------------------------------------

  #: Calling a Function calls ``self._dispatch``: the ``jax.jit`` object
  #: itself once the function is known to be pure (no Python frame of ours:
  #: a plain ``jax.jit`` call), the fast hook of the current mode
  #: (``_Threaded.fast``) once a call found it applies, else
  #: :meth:`_first_call` or :meth:`_call_threaded`.
  if TYPE_CHECKING:   # (for type checkers: called like the wrapped function)
    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R: ...
  else:
    __call__ = property(operator.attrgetter("_dispatch"))

  def _first_call(self, *args, **kwargs):
    """Until a call finds the function pure: a pure call that may learn."""
    with self._first_call_guard:   # (JAX 0.8: one compile at a time)
      return self._learning_call(*args, **kwargs)

  def _learning_call(self, *args, **kwargs):
    if self._effectful:
      return self._call_threaded(*args, **kwargs)
    if _errors.deferred and _compat.at_top_level():
      _raising.raise_deferred(_threads.thread_state())
    previous = getattr(_strict, "on", False)
    _strict.on = True
    try:
      out = self._pure(*args, **kwargs)
    except NeedsTokens as err:
      self._learn(_effects.get_ordering(), err)
      out = _RETRY
    finally:
      _strict.on = previous
    if out is _RETRY:
      # Outside the handler: neither an error of the threaded call nor an
      # exception a user callback handles gets NeedsTokens as __context__.
      return self._call_threaded(*args, **kwargs)
    if not self._effectful:
      self._dispatch = self._pure
    return out

  def _call_threaded(self, *args, **kwargs):
    """The general dispatch hook (the fast one, ``_Threaded.fast``, is
    installed as ``_dispatch`` whenever it applies)."""
    if not _compat.compiled_dispatch():
      return self._fun(*args, **kwargs)
    mode = _effects.get_ordering()
    state = _threads.thread_state()
    if self._after_fallback:   # see _trace_pure: after JAX's ordered effects
      self._after_fallback = False
      _barrier.effects_barrier()
      for mode_ in list(self._modes):
        self._refresh(mode_)
    threaded = self._threaded(mode)
    while True:
      keys, jitted = self._keys_and_jit(mode, args)
      try:
        out, token = _call_path.dispatch(state, mode, keys,
                               threaded.per_device_sharding, jitted, args,
                               kwargs, threaded.launch)
      except NeedsTokens as err:
        self._learn(mode, err)
        continue
      if (token.sharding is not threaded.per_device_sharding
          and _per_device.kept_on_devices(token)):
        threaded.per_device_sharding = token.sharding
        self._refresh(mode)
      if threaded.fast is not None:
        self._dispatch = threaded.fast
      return out

  # --- the jax.jit API -----------------------------------------------------

  def trace(self, *args: Any, **kwargs: Any) -> _stages.Traced:
    """Traces for the given arguments (arrays or ``jax.ShapeDtypeStruct``).

    As ``jax.jit(f).trace``; the returned :class:`Traced` shows the user's
    arguments and outputs (not the runtime-token argument and result).
    """
    if not self._effectful:
      previous = getattr(_strict, "on", False)
      _strict.on = True
      try:
        return _stages.Traced(self, self._pure.trace(*args, **kwargs), None, ())
      except NeedsTokens as err:
        self._learn(_effects.get_ordering(), err)
      finally:
        _strict.on = previous
    mode = _effects.get_ordering()
    while True:
      keys, jitted = self._keys_and_jit(mode, args)
      tokens = tuple(jax.ShapeDtypeStruct((), _errors.TOKEN_DTYPE)
                     for _ in keys)
      try:
        traced = jitted.trace(*tokens, *args, **kwargs)
      except NeedsTokens as err:
        self._learn(mode, err)
        continue
      return _stages.Traced(self, traced, mode, keys)

  def lower(self, *args: Any, **kwargs: Any) -> _stages.Lowered:
    """Lowers for the given arguments (arrays or ``jax.ShapeDtypeStruct``)."""
    return self.trace(*args, **kwargs).lower()

  def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
    """Output shapes/dtypes (``jax.ShapeDtypeStruct`` s), as ``jax.eval_shape``."""
    return self.trace(*args, **kwargs).out_info

  def clear_cache(self) -> None:
    """Drops the kept traces and the ``jax.jit`` caches of this function."""
    self._traces.clear()
    self._pure.clear_cache()
    for threaded in list(self._modes.values()):
      for jitted in list(threaded.jitted.values()):
        jitted.clear_cache()

  def _cache_size(self) -> int:
    """Executables in this function's ``jax.jit`` caches (as ``jax.jit``'s)."""
    return self._pure._cache_size() + sum(
        j._cache_size() for t in list(self._modes.values())
        for j in list(t.jitted.values()))

  def __copy__(self) -> Function[_P, _R]:
    return Function(self._fun, **self._jit_kwargs)

  def __deepcopy__(self, memo: Any) -> Function[_P, _R]:
    # A fresh Function of the same function and options (as for jax.jit:
    # caches and learnt state are not copied; locks cannot be).
    return Function(self._fun, **self._jit_kwargs)

  def __reduce__(self):
    return (_rebuild, (self._fun, self._jit_kwargs))


def _rebuild(fun, jit_kwargs):
  return Function(fun, **jit_kwargs)


@overload
def jit(fun: Callable[_P, _R], /, **jit_kwargs: Any) -> Function[_P, _R]: ...
@overload
def jit(fun: None = None, /, **jit_kwargs: Any
        ) -> Callable[[Callable[_P, _R]], Function[_P, _R]]: ...


def jit(fun: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
  """Drop-in for ``jax.jit`` that keeps side effects in program order.

  Takes ``jax.jit``'s keyword arguments (``static_argnums``,
  ``static_argnames``, ``donate_argnums``, ``in_shardings``, ...). Usable as
  ``@jit``, ``@jit(static_argnums=...)`` or ``jit(f, ...)``. Returns a
  :class:`Function`, typed for type checkers as the function it wraps
  (``Function[P, R]``: called with ``f``'s parameters, returning ``f``'s
  result type).
  """
  if fun is None:
    return functools.partial(jit, **jit_kwargs)
  return Function(fun, **jit_kwargs)
