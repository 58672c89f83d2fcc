"""What a ``jax_effects.jit`` function's ``jax.jit`` objects trace.

Its part of the token calling convention (``design/tokens.md``, "At the
``jax.jit`` boundary"): the threaded ``jax.jit`` object for the ``k``
chains ``keys`` traces ``g(t_1, ..., t_k, *args, **kwargs) -> (outputs,
token)``, whose body (:func:`threaded`)
runs the token-threading pass on the user function's kept trace
(:class:`TraceCache`): ``jax.jit`` sees no effect and keeps its C++ fast
path. The plain one traces ``g(*args, **kwargs) -> outputs`` with the
user's options, effects kept (:func:`plain`): the call of a pure function,
and the nested jit a call under another trace binds.

Nothing here learns: a threaded trace that finds a chain ``keys`` lacks
raises ``call_path.NeedsTokens`` to its call; a first call learns from
:func:`program_effects`; a plain trace tells its function only that it
found effects (``on_effects``). ``jax.jit`` also calls the bodies with
values: under ``jax.disable_jit()`` the user function runs eagerly; under
``jax_debug_nans``/``jax_debug_infs`` JAX's de-optimized re-run evaluates
the program equation by equation (:func:`replay`), its effects, which ran
in the computation, not run again (``threaded.already_ran``).

``g``'s options and face are made here too: the ``k`` runtime tokens are
``g``'s first positional parameters (named with the reserved prefix
:data:`TOKENS_KW`), so the user's options shift
(:func:`threaded_jit_kwargs`), and :class:`Traceable` shows the user's
function to JAX.
"""
from __future__ import annotations

import collections
import functools
import inspect
import threading
from typing import Callable

import jax
from jax import tree_util
import jax.numpy as jnp

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._core import jaxpr_eval as _jaxpr_eval
from jax_effects._dispatch import call_path as _call_path
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import host_target as _host_target
from jax_effects._primitives import threaded as _threaded_primitive
from jax_effects._runtime import token_value as _token_value
from jax_effects._runtime import threads as _threads


# --- g's options and face ----------------------------------------------------

TOKENS_KW = _call_path.TOKENS_KW


def argnums(value) -> tuple:
  """``static_argnums``/``donate_argnums`` as a tuple."""
  if value is None:
    return ()
  return (value,) if isinstance(value, int) else tuple(value)


def check_names(jit_kwargs: dict) -> None:
  """Refuses static argument names that would clash with the tokens'."""
  names = jit_kwargs.get("static_argnames") or ()
  if any(str(n).startswith(TOKENS_KW)
         for n in ((names,) if isinstance(names, str) else names)):
    raise ValueError(f"names starting with {TOKENS_KW} are reserved by "
                     "jax_effects")


def n_dynamic(jit_kwargs: dict, args: tuple) -> int | None:
  """The number of non-static positional arguments of a call with ``args``
  where one ``in_shardings`` is given for every argument (it is expanded
  per argument, so the threaded ``jax.jit`` depends on it); else None."""
  s = jit_kwargs.get("in_shardings")
  if s is None or isinstance(s, (tuple, list)):
    return None
  n = len(args)
  static = {i % n for i in argnums(jit_kwargs.get("static_argnums"))
            if -n <= i < n}
  return n - len(static)


def threaded_jit_kwargs(jit_kwargs: dict, n_dynamic: int | None,
                        k: int) -> dict:
  """``jax.jit`` keyword arguments for ``g(t_1, ..., t_k, *args, **kwargs)``:
  positional indices shift by ``k`` (negative ones do not), the tokens get
  no sharding, nor does the returned one. ``n_dynamic``: :func:`n_dynamic`.
  """
  kwargs = dict(jit_kwargs)
  for name in ("static_argnums", "donate_argnums"):
    if kwargs.get(name) is not None:
      kwargs[name] = tuple(n + k if n >= 0 else n
                           for n in argnums(kwargs[name]))
  s = kwargs.get("in_shardings")
  if s is not None:
    per_argument = s if isinstance(s, (tuple, list)) else [s] * n_dynamic
    kwargs["in_shardings"] = (*([None] * k), *per_argument)
  if "out_shardings" in kwargs:
    kwargs["out_shardings"] = (kwargs["out_shardings"], None)
  return kwargs


class Traceable:
  """``g``: calls ``body(args, kwargs)``; looks like the user's function
  (``names``, its signature with ``tokens`` token parameters first, its
  ``__wrapped__`` through ``fun_ref``), so JAX names and locates its code.
  """

  def __init__(self, body: Callable, fun_ref: Callable[[], Callable | None],
               names: dict, sig: inspect.Signature | None,
               tokens: int | None):
    self._body = body
    self._fun_ref = fun_ref
    self.__dict__.update(names)
    if sig is not None and tokens is not None:
      sig = sig.replace(parameters=[
          *(inspect.Parameter(f"{TOKENS_KW}_{i}",
                              inspect.Parameter.POSITIONAL_ONLY)
            for i in range(tokens)),
          *sig.parameters.values()])
    if sig is not None:
      self.__signature__ = sig

  def __call__(self, *args, **kwargs):
    return self._body(args, kwargs)

  @property
  def __wrapped__(self):
    return self._fun_ref()

  def __repr__(self):
    return f"<function {self.__dict__.get('__qualname__', '?')}>"


def names_of(fun) -> dict:
  """The attributes a :class:`Traceable` copies from ``fun``."""
  out = {name: getattr(fun, name) for name in
         ("__module__", "__name__", "__qualname__", "__doc__")
         if hasattr(fun, name)}
  if "__name__" not in out:   # (callable objects, partials)
    out["__name__"] = type(fun).__name__
  return out


# --- the kept traces ---------------------------------------------------------

#: How many traces (jaxprs by signature) a function keeps for reuse.
KEPT_TRACES = 8
#: Sites of a function's programs kept after ``jax.clear_caches()``
#: (``TraceCache.clear``), the oldest dropped first.
KEPT_RETIRED_SITES = 4096


class TraceCache:
  """The traces of one function by signature: ``(closed jaxpr, out tree)``.

  Keyed by the static leaves, the avals of the dynamic ones, the ordering
  mode and JAX's trace context (as ``jax.jit`` keys its caches), at most
  :data:`KEPT_TRACES`, so the user function is traced once per signature
  though ``g`` is traced again (a new chain, a per-device token, the plain
  object). Holds the function weakly; ``jax.clear_caches()`` drops them.
  """

  def __init__(self, fun_ref: Callable[[], Callable | None]):
    self._fun_ref = fun_ref
    self._traces: dict = {}
    #: A trace runs one of JAX's host calls that fail their execution
    #: (``token_pass.host_calls``; ``ThreadTokens.tokens_for``).
    self.may_fail = False
    #: A trace runs the user's own code on the host
    #: (``token_pass.host_calls``; ``launch_lock.finish``).
    self.user_code = False
    #: The host target's sites of this function's programs
    #: (``host_target.keep_sites_in``), kept past ``jax.clear_caches()``.
    self.sites: set = set()
    #: Sites of programs lowered before a ``jax.clear_caches()``.
    self._retired: collections.deque = collections.deque(
        maxlen=KEPT_RETIRED_SITES)
    self._lock = threading.Lock()
    _compat.register_cache(self, "jax_effects.jit kept traces")

  def fun(self) -> Callable:
    fun = self._fun_ref()
    if fun is None:
      raise ReferenceError("jax_effects.jit: the function was garbage-"
                           "collected")
    return fun

  def clear(self) -> None:
    with self._lock:
      self._traces.clear()
      # An executable lowered before may still run: its sites stay, retired
      # (``design/host_target.md``: a site in use is never unbound).
      self._retired.extend(self.sites)
      self.sites = set()

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

    fun = self.fun()

    @functools.wraps(fun)
    def flat_fun(*dyn_vals):
      full = list(leaves)
      for i, x in zip(dyn_pos, dyn_vals):
        full[i] = x
      a, k = tree_util.tree_unflatten(treedef, full)
      return fun(*a, **k)

    closed, out_shape = _jax_api.make_jaxpr(flat_fun, return_shape=True)(*dyn)
    out_tree = tree_util.tree_structure(out_shape)
    if not (self.may_fail and self.user_code):
      may_fail, user_code = _token_pass.host_calls(closed.jaxpr)
      self.may_fail = self.may_fail or may_fail
      self.user_code = self.user_code or user_code
    if keep and signature is not None and not any(
        isinstance(c, jax.core.Tracer) for c in closed.consts):
      # (a jaxpr closing over an enclosing trace's values is not reusable)
      with self._lock:
        if len(self._traces) >= KEPT_TRACES:
          self._traces.pop(next(iter(self._traces)))
        self._traces[signature] = (closed, out_tree)
    return closed, dyn, out_tree


# --- the bodies --------------------------------------------------------------

def _called_with_values() -> str | None:
  """Why ``jax.jit`` calls a body with values rather than tracing it:
  "eager" (``jax.disable_jit()``), "replay" (JAX's de-optimized re-run
  after a NaN/Inf), or None (a trace: ``jax.jit``'s, or ``.trace()``'s,
  which traces under ``jax.disable_jit()`` too)."""
  if _compat.building_jaxpr():
    return None
  if _compat.disable_jit_flag.value:
    return "eager"
  if _compat.at_top_level():
    if jax.config.jax_debug_nans or jax.config.jax_debug_infs:
      return "replay"
    return "eager"
  return None


def plain(traces: TraceCache, on_effects: Callable[[], None], args, kwargs):
  """The body of the plain ``jax.jit``: the user function as ``jax.jit``
  traces it, effects kept; the same jaxpr wherever it is traced. Finding
  effects it calls ``on_effects()``."""
  how = _called_with_values()
  if how == "eager":
    return traces.fun()(*args, **kwargs)
  if how == "replay":
    return replay(traces, None, (), (), args, kwargs)
  closed, dyn, out_tree = traces.trace(args, kwargs)
  _host_target.keep_sites_in(traces)   # (what jax.jit lowers next)
  mode = _effects.get_ordering()
  if _effects.chain_keys(closed.effects, mode):   # (effects, counters)
    if getattr(_discovery, "traces", None) is traces:
      raise FoundEffects(closed.effects)
    on_effects()
    outs = _jaxpr_eval.eval_jaxpr(closed.jaxpr, closed.consts, dyn,
                                  _jaxpr_eval.rebind, _token_pass.unchanged)
  else:   # (the pass re-binds it unchanged, or refuses an effect that a
          # reduction's combiner hides from the equations' effects)
    outs, _ = _token_pass.thread_program(closed, dyn, {}, mode)
  return tree_util.tree_unflatten(out_tree, outs)


class FoundEffects(Exception):
  """Raised out of a plain trace that :func:`program_effects` started, at
  the effects it found (``effects``: the program's JAX effects)."""

  def __init__(self, effects):
    super().__init__("jax_effects: a plain trace found effects (internal)")
    self.effects = effects


#: ``traces``: the TraceCache whose plain trace program_effects started.
_discovery = threading.local()


def program_effects(traces: TraceCache, plain_jit, args, kwargs):
  """The JAX effects of ``plain_jit``'s program for ``(args, kwargs)``,
  from a ``.trace()`` that stops once it finds effects (the threaded trace
  comes next, reusing the kept trace of the user function)."""
  saved = getattr(_discovery, "traces", None)
  _discovery.traces = traces
  try:
    return plain_jit.trace(*args, **kwargs).jaxpr.effects
  except FoundEffects as found:
    return found.effects
  finally:
    _discovery.traces = saved


def threaded(traces: TraceCache, mode: str, keys: tuple, args, kwargs):
  """The body of the threaded ``jax.jit`` for the runtime tokens of
  ``keys``: raises ``call_path.NeedsTokens`` (to the call) for the chains
  its program uses that ``keys`` lacks."""
  k = len(keys)
  runtime, args = args[:k], args[k:]
  how = _called_with_values()
  if how == "eager":
    # After the thread's dispatched effects (the tokens are ready), the user
    # function runs eagerly; any of the tokens, all ready, is the new one.
    jax.block_until_ready(runtime)
    out = traces.fun()(*args, **kwargs)
    # (the hook stores a jax.Array: it reads its sharding)
    return out, _threads.as_array(
        runtime[0] if runtime else
        _threads.thread_state().initial_token())
  if how == "replay":
    return replay(traces, mode, keys, runtime, args, kwargs)
  closed, dyn, out_tree = traces.trace(args, kwargs)
  _host_target.keep_sites_in(traces)   # (what jax.jit lowers next)
  missing = tuple(
      key for key in _effects.runtime_chain_keys(closed.effects, mode)
      if key not in keys)
  if missing:
    raise _call_path.NeedsTokens(missing)
  outs, token = _token_pass.thread_program(
      closed, dyn, dict(zip(keys, runtime)), mode, stretches=True)
  if token is None:
    token = jnp.zeros((), _token_value.TOKEN_DTYPE)
  return tree_util.tree_unflatten(out_tree, outs), token


def replay(traces: TraceCache, mode: str | None, keys: tuple,
           runtime: tuple, args, kwargs):
  """JAX's de-optimized re-run after a NaN/Inf (the module docstring): the
  threaded program evaluated equation by equation, each effect returning its
  token and carrier unchanged and zeros. ``mode`` None: the plain body."""
  closed, dyn, out_tree = traces.trace(args, kwargs, keep=False)
  mode_ = _effects.get_ordering() if mode is None else mode
  with jax.disable_jit(), _threaded_primitive.already_ran():
    if mode is None:
      keys = _effects.runtime_chain_keys(closed.effects, mode_)
      runtime = [jnp.zeros((), _token_value.TOKEN_DTYPE) for _ in keys]
    outs, token = _token_pass.thread_program(
        closed, dyn, dict(zip(keys, runtime)), mode_)
  outs = tree_util.tree_unflatten(out_tree, outs)
  return outs if mode is None else (outs, token)
