"""What a ``jax_effects.jit`` function's ``jax.jit`` objects trace, with which options.

Its part of the token calling convention (``design/tokens.md``). A
function's threaded ``jax.jit`` object for the ordered chains ``keys``
(``k`` of them) traces::

    g(t_1, ..., t_k, *args, **kwargs) -> (outputs, token)

whose body (:func:`threaded`) traces the user function once per signature
(:class:`TraceCache`) and runs the token-threading pass on its jaxpr
(``_pass.token_pass``), re-tracing the result into ``jax.jit``'s trace: the
pass leaves no JAX effect behind, so ``jax.jit`` keeps its C++ fast path.
The runtime tokens are the first ``k`` positional arguments (``jax.jit``
refuses keyword arguments when ``in_shardings`` is given, and a tuple
argument would cost a pytree level on every dispatch), so the user's
``static_argnums``/``donate_argnums`` shift by ``k``, ``in_shardings`` gets
None for the tokens and ``out_shardings`` None for the returned token
(:func:`threaded_jit_kwargs`). The *plain* ``jax.jit`` object traces
``g(*args, **kwargs) -> outputs`` with the user's options unchanged, its
body (:func:`plain`) the user function as ``jax.jit`` traces it, effects
kept: the call of a pure function, and the nested jit a call under another
trace binds.

Nothing here learns. A threaded trace that finds a chain its call passed
no runtime token for raises ``call_path.NeedsTokens`` out of ``jax.jit``'s
trace, to the call, which learns the chain and calls again through a
``jax.jit`` object for the new number of tokens; a first call learns from
a trace of the plain program, stopped once effects are found
(:func:`program_effects`). The one thing a trace tells its function is
that a plain program had effects (:func:`plain`'s ``on_effects``): a
function known to be pure is called straight through ``jax.jit``'s C++
path, where no frame of ours runs.

``g`` is a ``jit_options.Traceable``: named, signed and located as the user's
function (``jax.jit`` names the computation and resolves
``static_argnames`` from it) but holding it only weakly, as the traces do
(the learnt state that owns them is shared by every ``PjitFunction`` of
the function and must not keep it alive: ``core``).

``jax.jit`` also calls the bodies with values instead of tracers:

* under ``jax.disable_jit()``: the user function runs eagerly, its effects
  through the eager impl, after the thread's dispatched effects (every
  function, with effects or not; ``.trace()``/``.lower()`` still trace);
* under ``jax_debug_nans``/``jax_debug_infs``, after a computation returned
  a NaN or Inf, JAX calls the function again, "de-optimized", to find the
  operation that made it (:func:`replay`): the program the computation ran
  is evaluated equation by equation at the top level under
  ``jax.disable_jit()``, so JAX's checks name the operation, and its
  effects, which already ran in the computation, are not run again
  (``threaded.already_ran``). Their results there are zeros.
"""
from __future__ import annotations

import collections
import functools
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

NeedsTokens = _call_path.NeedsTokens

# --- the kept traces --------------------------------------------------------------

#: How many traces (jaxprs by signature) a function keeps for reuse.
KEPT_TRACES = 8
#: Sites of a function's programs kept after ``jax.clear_caches()``
#: (``TraceCache.clear``), the oldest dropped first.
KEPT_RETIRED_SITES = 4096


class TraceCache:
  """The traces of one function by signature: ``(closed jaxpr, out tree)``.

  Tracing ``g`` traces the user function to a closed jaxpr
  (``jax.make_jaxpr``) that a body then threads or re-emits. ``g`` is traced
  again for the same signature (static leaves, avals of the dynamic ones,
  ordering mode, and JAX's trace context, on which ``jax.jit`` keys its own
  caches: a trace under ``jax.numpy_rank_promotion("raise")`` or
  ``jax.default_matmul_precision`` is not one without) when a call learns a
  new chain (a new ``jax.jit`` object for one more token), gets a new shape
  of runtime token (a per-device token), or goes through the plain
  ``jax.jit`` object too (a nested call): at most :data:`KEPT_TRACES` are
  kept (oldest dropped first), so the user function is traced once per
  signature, as under ``jax.jit``. Holds the function only weakly
  (``fun_ref``). Registered with JAX's cache management, so
  ``jax.clear_caches()`` drops them, as it drops ``jax.jit``'s traces.
  """

  def __init__(self, fun_ref: Callable[[], Callable | None]):
    self._fun_ref = fun_ref
    self._traces: dict = {}
    #: Set once a trace runs one of JAX's own host calls that fail their
    #: execution when they raise (``token_pass.may_fail``): what the
    #: function's dispatches learn from it (``ThreadTokens.tokens_for``).
    self.may_fail = False
    #: Set once a trace runs the user's own function on the host
    #: (``token_pass.runs_user_code``): the function's calls wait for their
    #: computations (``_runtime.launch_lock.finish``).
    self.user_code = False
    #: The host target's sites lowered for this function's programs, kept
    #: while its jax.jit objects (and their executables) may run them
    #: (``host_target.keep_sites_in``): ``jax.clear_caches()`` does not
    #: drop them (:meth:`clear`).
    self.sites: set = set()
    #: Sites of programs lowered before a ``jax.clear_caches()``, most
    #: recent last (at most :data:`KEPT_RETIRED_SITES`).
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
      # An executable lowered before the clear may still run: one in
      # flight, or one that a call racing with the clear put back in
      # jax.jit's C++ cache after it was emptied (its Python lowering,
      # whose keepalives hold its sites, gone with JAX's caches). Its
      # sites stay (retired, in a bounded store): a site in use is never
      # unbound by a clear (``design/host_target.md``).
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
    if not self.may_fail and _token_pass.may_fail(closed.jaxpr):
      self.may_fail = True
    if not self.user_code and _token_pass.runs_user_code(closed.jaxpr):
      self.user_code = True
    if keep and signature is not None and not any(
        isinstance(c, jax.core.Tracer) for c in closed.consts):
      # (a jaxpr closing over an enclosing trace's values is not reusable)
      with self._lock:
        if len(self._traces) >= KEPT_TRACES:
          self._traces.pop(next(iter(self._traces)))
        self._traces[signature] = (closed, out_tree)
    return closed, dyn, out_tree


# --- the bodies -------------------------------------------------------------------

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


def has_chains(effects, mode: str) -> bool:
  """Whether a program with these JAX effects has something to thread (an
  effect of ours or an adopted one, or a counter)."""
  return bool(_effects.chain_keys(effects, mode))


def plain(traces: TraceCache, on_effects: Callable[[], None], args, kwargs):
  """The body of the plain ``jax.jit``: the user function as ``jax.jit``
  traces it, effects kept (``effect_p`` equations, JAX's callbacks).

  Its jaxpr is the same wherever it is traced (at the top level, under
  another trace, by ``.trace()``): ``jax.jit`` caches it for all of them.
  Inside an outer ``jax_effects.jit`` the pass threads its effects; under
  plain ``jax.jit``, at the top level or under an eager transformation,
  JAX lowers them with their plain-jit lowering. Finding effects it calls
  ``on_effects()`` (see the module docstring).
  """
  how = _called_with_values()
  if how == "eager":
    return traces.fun()(*args, **kwargs)
  if how == "replay":
    return replay(traces, None, (), (), args, kwargs)
  closed, dyn, out_tree = traces.trace(args, kwargs)
  _host_target.keep_sites_in(traces)   # (what jax.jit lowers next)
  mode = _effects.get_ordering()
  if has_chains(closed.effects, mode):
    if _discovery.traces is traces:
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


class _Discovery(threading.local):
  traces: TraceCache | None = None


_discovery = _Discovery()


def program_effects(traces: TraceCache, plain_jit, args, kwargs):
  """The JAX effects of the program that ``plain_jit`` (the plain
  ``jax.jit`` object of ``traces``) traces for ``(args, kwargs)``, from a
  ``.trace()`` of it that stops once it knows there are effects to
  thread: the threaded trace comes next, and re-emitting the program into
  the plain jaxpr first would be work thrown away (a first call's cost
  from a warm persistent cache). The user function's own trace is kept
  (``traces``) for the threaded trace."""
  saved = _discovery.traces
  _discovery.traces = traces
  try:
    return plain_jit.trace(*args, **kwargs).jaxpr.effects
  except FoundEffects as found:
    return found.effects
  finally:
    _discovery.traces = saved


def threaded(traces: TraceCache, mode: str, keys: tuple, args, kwargs):
  """The body of the threaded ``jax.jit`` for the runtime tokens of
  ``keys``: raises :class:`NeedsTokens` (to the call) for the chains its
  program uses that ``keys`` lacks."""
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
    raise NeedsTokens(missing)
  outs, token = _token_pass.thread_program(
      closed, dyn, dict(zip(keys, runtime)), mode)
  if token is None:
    token = jnp.zeros((), _token_value.TOKEN_DTYPE)
  return tree_util.tree_unflatten(out_tree, outs), token


def replay(traces: TraceCache, mode: str | None, keys: tuple,
           runtime: tuple, args, kwargs):
  """JAX's de-optimized re-run of a computation that produced a NaN/Inf.

  The function is traced on the call's values and its threaded program
  evaluated equation by equation under ``jax.disable_jit()`` (control flow
  in Python), so JAX's NaN/Inf checks of each operation raise
  ``FloatingPointError`` naming it. The effects ran in the computation
  already: here each returns its token and carrier unchanged and zeros.
  ``mode`` None: the plain body (returns the outputs only).
  """
  closed, dyn, out_tree = traces.trace(args, kwargs, keep=False)
  mode_ = _effects.get_ordering() if mode is None else mode
  if mode is None:
    keys = _effects.runtime_chain_keys(closed.effects, mode_)
  with jax.disable_jit(), _threaded_primitive.already_ran():
    if mode is None:
      runtime = [jnp.zeros((), _token_value.TOKEN_DTYPE) for _ in keys]
    outs, token = _token_pass.thread_program(
        closed, dyn, dict(zip(keys, runtime)), mode_)
  outs = tree_util.tree_unflatten(out_tree, outs)
  return outs if mode is None else (outs, token)
