"""``jax_effects.jit``: the dispatch hook around ``jax.jit``.

A :class:`Function` owns ``jax.jit`` objects whose traced function is::

    g((t_1, ..., t_k), *args, **kwargs) -> (outputs, token)

where ``t_i`` is the calling thread's runtime token of the i-th ordered chain
the function uses (in a fixed order, :attr:`Function.keys`). The token tuple
is the first positional argument (``static_argnums``/``donate_argnums`` are
shifted by one, ``in_shardings`` gets None for it): ``jax.jit`` refuses
keyword arguments when ``in_shardings`` is given. Tracing ``g``
traces the user function to a jaxpr and runs the token-threading pass on it
(``_thread_tokens``), re-tracing the result into ``g``'s trace. The pass leaves
no JAX-level effect behind, so ``jax.jit``'s C++ fast path dispatches ``g``;
the Python hook around it only reads the runtime tokens from
:mod:`~jax_effects._runtime_tokens` and stores the returned token.

Which chains a function uses is learnt while tracing: a trace that finds a
chain the call did not pass a runtime token for raises :class:`NeedsTokens`,
the hook adds the chain to :attr:`Function.keys` and calls again (a new token
tuple length is a new ``jax.jit`` cache entry). Until a trace finds any
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
"""
from __future__ import annotations

import functools
import inspect
import operator
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import tree_util
from jax.extend import core as jex_core

from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _runtime_tokens
from jax_effects import _thread_tokens

#: How many traces (jaxprs by signature) a Function keeps for reuse.
_KEPT_TRACES = 8

# Set while a call can catch NeedsTokens (see Function._first_call).
_strict = threading.local()

TOKENS_KW = "__jax_effects_runtime_tokens__"


class NeedsTokens(Exception):
  """Raised from inside a trace: the call did not pass these chains' tokens."""

  def __init__(self, keys):
    super().__init__(f"jax_effects: retrace with runtime tokens for {keys}")
    self.keys = keys


def _signature_with_tokens(fun):
  """``fun``'s signature with the runtime-token tuple as first parameter."""
  try:
    sig = inspect.signature(fun)
  except (TypeError, ValueError):
    return None
  extra = inspect.Parameter(TOKENS_KW, inspect.Parameter.POSITIONAL_ONLY)
  return sig.replace(parameters=[extra, *sig.parameters.values()])


def _argnums(value) -> tuple:
  if value is None:
    return ()
  return (value,) if isinstance(value, int) else tuple(value)


def _threaded_jit_kwargs(jit_kwargs: dict, n_dynamic: int | None) -> dict:
  """``jax.jit`` keyword arguments for ``g(tokens, *args, **kwargs)``.

  Positional indices shift by one (negative ones are unchanged); the token
  tuple gets no sharding constraint (None) and no sharding on the output.
  ``n_dynamic`` is the number of non-static positional arguments, needed only
  when ``in_shardings`` is one sharding for every argument.
  """
  kwargs = dict(jit_kwargs)
  for name in ("static_argnums", "donate_argnums"):
    if kwargs.get(name) is not None:
      kwargs[name] = tuple(n + 1 if n >= 0 else n
                           for n in _argnums(kwargs[name]))
  if kwargs.get("in_shardings") is not None:
    s = kwargs["in_shardings"]
    if isinstance(s, (tuple, list)):
      kwargs["in_shardings"] = (None, *s)
    else:
      kwargs["in_shardings"] = (None, *([s] * n_dynamic))
  if "out_shardings" in kwargs:
    kwargs["out_shardings"] = (kwargs["out_shardings"], None)
  return kwargs


class Function:
  """A jitted function whose side effects are token-threaded.

  Call it like the function it wraps. ``.lower(*args, **kwargs)`` returns a
  :class:`Lowered` whose ``.as_text()`` is the StableHLO of the threaded
  computation.
  """

  def __init__(self, fun: Callable, **jit_kwargs):
    if not callable(fun):
      raise TypeError(f"jax_effects.jit expects a callable, got {fun!r}")
    if TOKENS_KW in (jit_kwargs.get("static_argnames") or ()):
      raise ValueError(f"{TOKENS_KW} is reserved by jax_effects")
    functools.update_wrapper(self, fun)
    self._fun = fun
    self._jit_kwargs = jit_kwargs
    self._signature = _signature_with_tokens(fun)
    self._effectful = False
    self._after_fallback = False
    self._dispatch = self._first_call
    self._traces: dict = {}  # see _trace
    self._traces_lock = threading.Lock()
    #: mode -> sharding of the per-device token this function returned last
    self._per_device_sharding: dict[str, Any] = {}
    #: ordering mode -> tuple of ordered chain keys passed as runtime tokens
    self.keys: dict[str, tuple] = {}
    self._threaded: dict[str, Any] = {}
    self._pure = jax.jit(self._wrap(self._trace_pure), **jit_kwargs)

  def __repr__(self):
    return f"<jax_effects.jit of {getattr(self._fun, '__qualname__', self._fun)}>"

  def __get__(self, instance, owner=None):
    if instance is None:
      return self
    return functools.partial(self, instance)

  # --- tracing -----------------------------------------------------------------

  def _wrap(self, traced):
    @functools.wraps(self._fun)
    def g(*args, **kwargs):
      return traced(args, kwargs)
    if self._signature is not None:
      g.__signature__ = self._signature
    return g

  def _trace(self, args, kwargs):
    """Traces the user function on the dynamic leaves of ``(args, kwargs)``.

    The last few traces are kept by signature (static leaves and avals): the
    retry after :class:`NeedsTokens`, or a new shape of runtime token (a
    per-device token, see ``_runtime_tokens.per_device_tokens``), reuses the
    jaxpr, so the user function is traced once per signature, as under
    ``jax.jit``.
    """
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

    @functools.wraps(self._fun)
    def flat_fun(*dyn_vals):
      full = list(leaves)
      for i, x in zip(dyn_pos, dyn_vals):
        full[i] = x
      a, k = tree_util.tree_unflatten(treedef, full)
      return self._fun(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dyn)
    out_tree = tree_util.tree_structure(out_shape)
    if signature is not None and not any(
        isinstance(c, jax.core.Tracer) for c in closed.consts):
      # (a jaxpr closing over an enclosing trace's values is not reusable)
      with self._traces_lock:
        if len(self._traces) >= _KEPT_TRACES:
          self._traces.pop(next(iter(self._traces)))
        self._traces[signature] = (closed, out_tree)
    return closed, dyn, out_tree

  def _trace_pure(self, args, kwargs):
    closed, dyn, out_tree = self._trace(args, kwargs)
    mode = _effects.get_ordering()
    keys = _thread_tokens.chain_keys(closed.effects, mode)
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
      self._learn(mode, err)
      self._after_fallback = True
      _runtime_tokens.wait_for_thread()
      outs = jex_core.jaxpr_as_fun(closed)(*dyn)
      return tree_util.tree_unflatten(out_tree, outs)
    outs, _ = _thread_tokens.thread_tokens(closed, dyn, {}, mode)
    return tree_util.tree_unflatten(out_tree, outs)

  def _trace_threaded(self, mode, args, kwargs):
    runtime, *args = args
    closed, dyn, out_tree = self._trace(tuple(args), kwargs)
    known = self.keys.get(mode, ())
    missing = tuple(k for k in _thread_tokens.chain_keys(closed.effects, mode)
                    if k not in known)
    if missing or len(runtime) != len(known):
      raise NeedsTokens(missing)
    outs, token = _thread_tokens.thread_tokens(
        closed, dyn, dict(zip(known, runtime)), mode)
    if token is None:
      token = jnp.zeros((), _runtime_tokens.TOKEN_DTYPE)
    return tree_util.tree_unflatten(out_tree, outs), token

  def _threaded_jit(self, mode: str, args: tuple = ()):
    """The ``jax.jit`` of ``g(tokens, *args, **kwargs)`` for ``mode``."""
    key = mode
    n_dynamic = None
    s = self._jit_kwargs.get("in_shardings")
    if s is not None and not isinstance(s, (tuple, list)):
      # one sharding for all arguments: expand it per number of arguments
      n = len(args)
      static = {i % n for i in _argnums(self._jit_kwargs.get("static_argnums"))
                if -n <= i < n}
      key = (mode, n_dynamic := n - len(static))
    jitted = self._threaded.get(key)
    if jitted is None:
      jitted = jax.jit(self._wrap(functools.partial(self._trace_threaded, mode)),
                       **_threaded_jit_kwargs(self._jit_kwargs, n_dynamic))
      self._threaded[key] = jitted
    return jitted

  def _learn(self, mode: str, err: NeedsTokens) -> None:
    known = self.keys.get(mode, ())
    self.keys[mode] = known + tuple(k for k in err.keys if k not in known)
    self._effectful = True
    self._dispatch = self._call_threaded

  # --- dispatch ------------------------------------------------------------------

  #: Calling a Function calls ``self._dispatch``: the ``jax.jit`` object
  #: itself once the function is known to be pure (no Python frame of ours:
  #: a plain ``jax.jit`` call), else :meth:`_first_call` or
  #: :meth:`_call_threaded`.
  __call__ = property(operator.attrgetter("_dispatch"))

  def _first_call(self, *args, **kwargs):
    """Until a call finds the function pure: a pure call that may learn."""
    if self._effectful:
      return self._call_threaded(*args, **kwargs)
    if _runtime_tokens._deferred and _compat.at_top_level():
      _runtime_tokens.raise_deferred(_runtime_tokens.thread_tokens())
    previous = getattr(_strict, "on", False)
    _strict.on = True
    try:
      out = self._pure(*args, **kwargs)
    except NeedsTokens as err:
      self._learn(_effects.get_ordering(), err)
      return self._call_threaded(*args, **kwargs)
    finally:
      _strict.on = previous
    if not self._effectful:
      self._dispatch = self._pure
    return out

  def _call_threaded(self, *args, **kwargs):
    if not _compat.at_top_level() or _compat.disable_jit_flag.value:
      return self._fun(*args, **kwargs)
    mode = _effects.get_ordering()
    state = _runtime_tokens.thread_tokens()
    if _runtime_tokens._deferred:   # an earlier call's callback failed
      _runtime_tokens.raise_deferred(state)   # before dispatching anything
    if state.mode != mode:   # after a mode switch: follow earlier dispatches
      _runtime_tokens.switch_mode(state, mode)
    if self._after_fallback:   # see _trace_pure: after JAX's ordered effects
      self._after_fallback = False
      _runtime_tokens.effects_barrier()
    while True:
      keys = self.keys.get(mode, ())
      tokens = _runtime_tokens.tokens_for(
          state, keys, self._per_device_sharding.get(mode))
      jitted = self._threaded.get(mode) or self._threaded_jit(mode, args)
      try:
        out, token = jitted(tokens, *args, **kwargs)
      except NeedsTokens as err:
        self._learn(mode, err)
        continue
      except Exception as err:  # noqa: BLE001 - an execution error or not
        _runtime_tokens.reraise(err, state)
      try:
        if token.ndim:
          self._per_device_sharding[mode] = token.sharding
        _runtime_tokens.update(state, keys, token)
      except BaseException:
        # KeyboardInterrupt (SIGINT) landing after the computation was
        # dispatched: its token is still stored, so what follows waits for it.
        _runtime_tokens.store_interrupted(state, keys, token)
        raise
      if state.own_errors:   # a callback of this call failed (ran inline)
        _runtime_tokens.raise_own(state, token)
      return out

  def lower(self, *args, **kwargs) -> "Lowered":
    """Lowers for the given arguments (arrays or ``jax.ShapeDtypeStruct``)."""
    if not self._effectful:
      previous = getattr(_strict, "on", False)
      _strict.on = True
      try:
        return Lowered(self, self._pure.lower(*args, **kwargs), None, ())
      except NeedsTokens as err:
        self._learn(_effects.get_ordering(), err)
      finally:
        _strict.on = previous
    mode = _effects.get_ordering()
    while True:
      keys = self.keys.get(mode, ())
      tokens = tuple(jax.ShapeDtypeStruct((), _runtime_tokens.TOKEN_DTYPE)
                     for _ in keys)
      try:
        lowered = self._threaded_jit(mode, args).lower(tokens, *args,
                                                       **kwargs)
      except NeedsTokens as err:
        self._learn(mode, err)
        continue
      return Lowered(self, lowered, mode, keys)


class Lowered:
  """A lowered :class:`Function`; ``.as_text()`` shows the threaded StableHLO."""

  def __init__(self, function: Function, lowered, mode, keys):
    self._function = function
    self._lowered = lowered
    self._mode = mode
    self._keys = keys

  def as_text(self, *args, **kwargs) -> str:
    return self._lowered.as_text(*args, **kwargs)

  def compiler_ir(self, *args, **kwargs):
    return self._lowered.compiler_ir(*args, **kwargs)

  def compile(self, *args, **kwargs) -> "Compiled":
    return Compiled(self._lowered.compile(*args, **kwargs), self._mode,
                    self._keys)


class Compiled:
  """A compiled :class:`Function`; calling it runs the dispatch hook."""

  def __init__(self, compiled, mode, keys):
    self._compiled = compiled
    self._mode = mode
    self._keys = keys

  def as_text(self) -> str:
    return self._compiled.as_text()

  def __call__(self, *args, **kwargs):
    if self._mode is None:
      return self._compiled(*args, **kwargs)
    state = _runtime_tokens.thread_tokens()
    if _runtime_tokens._deferred:   # an earlier call's callback failed
      _runtime_tokens.raise_deferred(state)   # before dispatching anything
    if state.mode != self._mode:
      _runtime_tokens.switch_mode(state, self._mode)
    # compiled for scalar tokens (see Function.lower): no per-device sharding
    tokens = _runtime_tokens.tokens_for(state, self._keys, None)
    try:
      out, token = self._compiled(tokens, *args, **kwargs)
    except Exception as err:  # noqa: BLE001 - an execution error or not
      _runtime_tokens.reraise(err, state)
    try:
      _runtime_tokens.update(state, self._keys, token)
    except BaseException:   # see Function._call_threaded
      _runtime_tokens.store_interrupted(state, self._keys, token)
      raise
    if state.own_errors:   # a callback of this call failed (ran inline)
      _runtime_tokens.raise_own(state, token)
    return out


def jit(fun: Callable | None = None, **jit_kwargs):
  """Drop-in for ``jax.jit`` that keeps side effects in program order.

  Takes ``jax.jit``'s keyword arguments (``static_argnums``,
  ``static_argnames``, ``donate_argnums``, ``in_shardings``, ...). Usable as
  ``@jit``, ``@jit(static_argnums=...)`` or ``jit(f, ...)``.
  """
  if fun is None:
    return functools.partial(jit, **jit_kwargs)
  return Function(fun, **jit_kwargs)
