"""What a ``jax_effects.jit`` function's ``jax.jit`` objects run when they trace.

Its part of the token calling convention: :func:`threaded` is the body of
``g(t_1, ..., t_k, *args, **kwargs) -> (outputs, token)`` (``convention``):
it traces the user function once per signature (``trace_cache``) and runs
the token-threading pass on its jaxpr (``_pass.token_pass``), re-tracing
the result into ``jax.jit``'s trace: the pass leaves no JAX effect behind,
so ``jax.jit`` keeps its C++ fast path. :func:`plain` is the body of
``g(*args, **kwargs) -> outputs``, the user function as ``jax.jit`` traces
it, effects kept: the call of a pure function, and the nested jit a call
under another trace binds.

Neither learns: a threaded trace that finds a chain the call passed no
runtime token for raises :class:`NeedsTokens` out of ``jax.jit``'s trace,
to the call, which learns the chain (``Core.learn``) and calls again
through a ``jax.jit`` object for the new number of tokens; a first call
learns from the traced plain program. The one thing a trace tells the
core is that a plain program had effects (``Core.effects_found``): a call
of a function known to be pure goes straight into ``jax.jit``'s C++ path,
where no frame of ours runs.

``jax.jit`` also calls the bodies with values instead of tracers:

* under ``jax.disable_jit()``: the user function runs eagerly, its effects
  through the eager impl, after the thread's dispatched effects (every
  function, with effects or not; ``.trace()``/``.lower()`` still trace);
* under ``jax_debug_nans``/``jax_debug_infs``, after a computation returned
  a NaN or Inf, JAX calls the function again, "de-optimized", to find the
  operation that made it (``replay``): the program the computation ran is
  evaluated equation by equation at the top level under
  ``jax.disable_jit()``, so JAX's checks name the operation, and its
  effects, which already ran in the computation, are not run again
  (``threaded.already_ran``). Their results there are zeros.
"""
from __future__ import annotations

import threading

import jax
from jax import tree_util
from jax.extend import core as jex_core
import jax.numpy as jnp

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import threaded as _threaded_primitive
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import threads as _threads

#: ``.on`` while ``.trace()``/``.lower()`` trace: they trace under
#: ``jax.disable_jit()`` too, as ``jax.jit``'s do.
explicit = threading.local()


class NeedsTokens(Exception):
  """Raised from inside a trace: the call did not pass these chains' tokens."""

  def __init__(self, keys):
    super().__init__(f"jax_effects: retrace with runtime tokens for {keys}")
    self.keys = keys


def _called_with_values() -> str | None:
  """Why ``jax.jit`` calls a body with values rather than tracing it:
  "eager" (``jax.disable_jit()``), "replay" (JAX's de-optimized re-run
  after a NaN/Inf), or None (a trace)."""
  if _compat.disable_jit_flag.value:
    return None if getattr(explicit, "on", False) else "eager"
  if _compat.at_top_level():   # (a trace is active whenever jax.jit traces)
    if jax.config.jax_debug_nans or jax.config.jax_debug_infs:
      return "replay"
    return "eager"
  return None


def plain(core, args, kwargs):
  """The body of the plain ``jax.jit``: the user function as ``jax.jit``
  traces it, effects kept (``effect_p`` equations, JAX's callbacks).

  Its jaxpr is the same wherever it is traced (at the top level, under
  another trace, by ``.trace()``): ``jax.jit`` caches it for all of them.
  Inside an outer ``jax_effects.jit`` the pass threads its effects; under
  plain ``jax.jit``, at the top level or under an eager transformation,
  JAX lowers them with their plain-jit lowering. Finding effects it tells
  the core (``Core.effects_found``): in PURE this may be a call made
  straight into ``jax.jit``'s C++ path.
  """
  how = _called_with_values()
  if how == "eager":
    return core.fun()(*args, **kwargs)
  if how == "replay":
    return replay(core, None, (), args, kwargs)
  closed, dyn, out_tree = core.traces.trace(args, kwargs)
  mode = _effects.get_ordering()
  if _token_pass.chain_keys(closed.effects, mode):
    core.effects_found()
    outs = jex_core.jaxpr_as_fun(closed)(*dyn)
  else:   # (the pass re-binds it unchanged, or refuses an effect that a
          # reduction's combiner hides from the equations' effects)
    outs, _ = _token_pass.thread_program(closed, dyn, {}, mode)
  return tree_util.tree_unflatten(out_tree, outs)


def threaded(core, mode: str, k: int, args, kwargs):
  """The body of the threaded ``jax.jit`` for ``k`` runtime tokens."""
  runtime, args = args[:k], args[k:]
  how = _called_with_values()
  if how == "eager":
    # After the thread's dispatched effects (the tokens are ready), the user
    # function runs eagerly; any of the tokens, all ready, is the new one.
    jax.block_until_ready(runtime)
    out = core.fun()(*args, **kwargs)
    # (the hook stores a jax.Array: it reads its sharding)
    return out, _threads.as_array(
        runtime[0] if runtime else
        _threads.thread_state().initial_token())
  if how == "replay":
    return replay(core, mode, runtime, args, kwargs)
  closed, dyn, out_tree = core.traces.trace(args, kwargs)
  known = core.threaded(mode).keys
  missing = tuple(
      key for key in _token_pass.runtime_chain_keys(closed.effects, mode)
      if key not in known)
  if missing or len(runtime) != len(known):
    raise NeedsTokens(missing)
  outs, token = _token_pass.thread_program(
      closed, dyn, dict(zip(known, runtime)), mode)
  if token is None:
    token = jnp.zeros((), _errors.TOKEN_DTYPE)
  return tree_util.tree_unflatten(out_tree, outs), token


def replay(core, mode: str | None, runtime: tuple, args, kwargs):
  """JAX's de-optimized re-run of a computation that produced a NaN/Inf.

  The function is traced on the call's values and its threaded program
  evaluated equation by equation under ``jax.disable_jit()`` (control flow
  in Python), so JAX's NaN/Inf checks of each operation raise
  ``FloatingPointError`` naming it. The effects ran in the computation
  already: here each returns its token and carrier unchanged and zeros.
  ``mode`` None: the pure body (returns the outputs only).
  """
  closed, dyn, out_tree = core.traces.trace(args, kwargs, keep=False)
  mode_ = _effects.get_ordering() if mode is None else mode
  keys = (core.threaded(mode).keys if mode is not None
          else _token_pass.runtime_chain_keys(closed.effects, mode_))
  with jax.disable_jit(), _threaded_primitive.already_ran():
    if mode is None:
      runtime = [jnp.zeros((), _errors.TOKEN_DTYPE) for _ in keys]
    outs, token = _token_pass.thread_program(
        closed, dyn, dict(zip(keys, runtime)), mode_)
  outs = tree_util.tree_unflatten(out_tree, outs)
  return outs if mode is None else (outs, token)
