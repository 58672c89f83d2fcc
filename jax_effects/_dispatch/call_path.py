"""The call path: one threaded call, from runtime tokens in to the token stored.

Every call of a threaded ``jax.jit`` object (``function.PjitFunction``,
``stages.Compiled``) goes through here. Its part of the token calling
convention (``design/tokens.md``): the executable is ``g(t_1, ..., t_k,
*args, **kwargs) -> (outputs, token)``; the call passes the thread's runtime
token of each chain (``token_store.TokenStore.runtime``), and the returned
token becomes the new runtime token of every chain it took and the output
token of its devices, stored before anything else can happen on the thread.

The steps, told here only (``design/architecture.md``, "One call, through
the tree", places them among the modules):

1. raise the errors earlier computations of this thread deferred
   (``errors.raise_deferred``);
2. after a switch of the thread's ordering mode, wait for its earlier
   dispatches (``ThreadTokens.switch_mode``);
3. fetch the runtime tokens (``ThreadTokens.tokens_for``: a failed token is
   never handed on, its chain starts afresh; one kept on other devices is
   combined, ``token_store.combine``); a function's first call places its
   scalar tokens as its token will return (:func:`_as_returned`);
4. mark the thread dispatching (``TokenStore.dispatching``: a SIGINT
   is now handled by ``interrupts``);
5. launch ``g``, under ``launch_lock`` when it spans several CPU devices; a
   failure frees what the host kept for the execution
   (``executions.failed``) and is raised as it is, or as
   ``KeyboardInterrupt`` after a SIGINT; a kept per-device token refused
   because the arguments put the computation elsewhere is replaced by its
   first device's copy and the launch retried;
6. store the returned token (``TokenStore.update``: of a nested call's
   token and this one's the later is kept, the other joined;
   ``TokenStore.store_interrupted`` when a SIGINT lands right after the
   launch); watch a computation over several devices that may leave
   effects to run on the host (``executions.watch_failure``);
7. raise ``KeyboardInterrupt`` after a SIGINT during the call, else the
   errors of callbacks that ran inline in it (``errors.raise_own``); after
   jax_effects' own exit handler, report every error and exit
   (``exit.report_late``).

:func:`dispatch` runs them all. :func:`fast_dispatch` builds the hook of one
function in its common case (one ordered chain, its token a scalar or kept
on the function's devices), the same steps inlined; what it cannot take it
hands to the function's general call, nothing having run (so do a first
call, a call under a trace and a ``NeedsTokens``):

====  ====================================================================
step  the fast hook
====  ====================================================================
1     falls back when any error is pending (one dict check)
2     falls back unless the thread's ``fast_mode`` is the function's mode
      (cleared by a mode change, and while a joined token or one at risk
      is held)
3     one chain: one dict get and a check of its token (a scalar, or kept
      on the function's devices); a chain starting, a token of another
      kind or a failed one falls back
4     falls back inside a call of the same thread (from a host callback)
5     falls back when JAX refuses the token's placement
6     ``TokenStore.store``: one chain, no sharding hashed in its common case
====  ====================================================================
"""
from __future__ import annotations

import jax

from jax_effects import _compat
from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import host_jobs as _host_jobs
from jax_effects._runtime import interrupts as _interrupts
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import token_store as _token_store
from jax_effects._runtime import token_value as _token_value

#: Prefix of the token parameters' names (``__jax_effects_runtime_tokens___0``,
#: ...): reserved.
TOKENS_KW = "__jax_effects_runtime_tokens__"


class NeedsTokens(Exception):
  """A threaded trace (``tracing.threaded``) found chains ``keys`` its call
  passed no runtime token for: raised to the call, which learns them."""

  def __init__(self, keys):
    super().__init__(f"jax_effects: retrace with runtime tokens for {keys}")
    self.keys = keys


def _launch(site: _launch_lock.LaunchSite, outside_callback: bool, call,
            tokens, args, kwargs):
  """``call(*tokens, *args, **kwargs)``, under the launch lock where
  ``site`` needs it (``launch_lock.serialize_launch``)."""
  if _launch_lock.serialize_launch(site, outside_callback):
    with _launch_lock.launch_lock:
      return call(*tokens, *args, **kwargs)
  return call(*tokens, *args, **kwargs)


def _compiles_first(call) -> bool:
  """Whether calling ``call``, a ``jax.jit`` object (not an AOT-compiled
  executable), compiles its first executable: only then is the runtime
  tokens' placement worth a walk of the arguments (:func:`_as_returned`)."""
  cache_size = getattr(call, "_cache_size", None)
  return cache_size is not None and not cache_size()


def _as_returned(tokens, args, kwargs) -> tuple:
  """``tokens``, their scalars replicated over the mesh of the first
  argument sharded by name over several devices, where there is one: JAX
  returns the computation's token so placed (its outputs' shardings follow
  the arguments'), and the next call, passing that token back, finds this
  call's executable. An uncommitted token is placed as an equivalent
  ``GSPMDSharding``, which ``jax.jit`` caches apart: a second compile."""
  for leaf in jax.tree_util.tree_leaves((args, kwargs)):
    sharding = getattr(leaf, "sharding", None)
    if (isinstance(sharding, jax.sharding.NamedSharding)
        and len(sharding.device_set) > 1):
      target = jax.sharding.NamedSharding(
          sharding.mesh, jax.sharding.PartitionSpec(),
          memory_kind=sharding.memory_kind)
      return tuple(
          t if jax.numpy.ndim(t) or getattr(t, "sharding", None) == target
          else jax.device_put(t, target) for t in tokens)
  return tokens


def _placed_elsewhere(err: ValueError, tokens) -> bool:
  """Whether ``err`` is JAX refusing a runtime token kept on other devices
  than the computation's (step 5)."""
  message = str(err)
  return ("incompatible devices" in message and TOKENS_KW in message
          and any(_token_store.kept_on_devices(t) for t in tokens))


def dispatch(state, mode: str, keys: tuple, device_sharding, call, args,
             kwargs, site: _launch_lock.LaunchSite, at_risk: bool = False):
  """The general path: the steps of the module docstring for the chains
  ``keys``; returns ``(outputs, token)``. ``site``: what this call site
  launched last (``launch_lock``); ``at_risk``: the computation may fail as
  a whole (``ThreadTokens.tokens_for``). :class:`NeedsTokens` propagates."""
  if _errors.deferred:
    _errors.raise_deferred(state)
  if state.mode != mode:
    state.switch_mode(mode)
  nested = state.dispatching   # (a call from a host callback of its call)
  tokens, read = state.tokens_for(keys, device_sharding, nested)
  if device_sharding is None and _compiles_first(call):
    tokens = _as_returned(tokens, args, kwargs)
  # Read before the launch: a call made inside it moves the thread's copies.
  seqs, seq = state.execution(keys)
  outer = _errors.enter_call() if nested else None
  outside_callback = state.python_thread and not nested   # (launch_lock)
  try:
    state.dispatching += 1
    try:
      elsewhere = False
      try:
        out, token = _launch(site, outside_callback, call, tokens, args,
                             kwargs)
      except ValueError as err:
        if not _placed_elsewhere(err, tokens):
          _failed(state, seqs, err)
        elsewhere = True
      except BaseException as err:  # noqa: BLE001 - an execution error or not
        _failed(state, seqs, err)
      if elsewhere:   # (JAX refused it before running anything)
        tokens, read = state.tokens_for(keys, None, nested)
        seqs, seq = state.execution(keys)
        try:
          out, token = _launch(site, outside_callback, call, tokens,
                               args, kwargs)
        except BaseException as err:  # noqa: BLE001 - an execution error or not
          _failed(state, seqs, err)
      try:
        _launch_lock.launched(site, token.sharding)
        state.update(keys, token, read, at_risk, seq)
      except BaseException:
        # (a SIGINT: the token is still stored, so what follows waits)
        state.store_interrupted(keys, token, read, at_risk, seq)
        raise
      if (seqs and len(token.sharding.device_set) > 1
          and _host_jobs.sites_lowered()):
        _executions.watch_failure(state.slot, seqs, token)
    finally:
      state.dispatching -= 1
    if site.finish is not None and not nested:   # (runs the user's code:
      site.finish(token, outside_callback)       #  launch_lock.finish)
    if _interrupts.slots and _interrupts.take(state):
      _errors.move_own_errors()   # (for the next call or barrier)
      raise KeyboardInterrupt   # the computation ran; its token is stored
    if _token_store.after_exit_handler:
      _barrier.report_late(state)
    if _errors.own.errors:   # (callbacks that ran inline)
      _errors.raise_own(state, token)
  finally:
    if outer is not None:
      _errors.leave_call(outer)
  return out, token


@_compat.api_boundary   # (its traceback shows no frame of ours: jax.jit's)
def _failed(state, seqs: dict, err: BaseException) -> None:
  """Raises the error of a failed launch (step 5; ``seqs``: the
  execution's identity)."""
  try:
    if _interrupts.slots and _interrupts.take(state):
      _executions.failed(state.slot, seqs)
      _errors.move_own_errors()   # (for the next call or barrier)
      raise KeyboardInterrupt from None
    if isinstance(err, jax.errors.JaxRuntimeError):
      _executions.failed(state.slot, seqs)
    _errors.dispatch_failed(err)
  finally:
    del err   # (no reference cycle through this frame: errors.reraise)


_interrupts.dispatching_frame(dispatch)
_interrupts.dispatching_frame(_launch)


def _fast_after(state, token) -> None:
  """Step 7 of :func:`fast_dispatch`, when a SIGINT landed or a callback
  failed during the call."""
  if _interrupts.slots and _interrupts.take(state):
    _errors.move_own_errors()
    raise KeyboardInterrupt
  if _errors.own.errors:
    _errors.raise_own(state, token)


def fast_dispatch(mode: str, key, jitted, *, site: _launch_lock.LaunchSite,
                  general, sharding=None):
  """The hook ``call(*args, **kwargs)`` of a function threading the one
  chain ``key`` through ``jitted(token, *args, **kwargs) -> (outputs,
  token)`` in ``mode`` (the module docstring); ``sharding``: its kept
  per-device token's (None: a scalar); ``general``: its general call. A
  token of another kind returned is stored, and changes ``fast_mode``."""
  trace, axis_env, eval_trace, top_axis_env = _compat.TOP_LEVEL
  seq_mask = _token_value.SEQ_MASK
  errors = _errors.deferred   # (the registry dict itself: emptied, never replaced)
  own = _errors.own
  interrupted = _interrupts.slots
  local = _threads.local
  kept = sharding is not None
  fast = _token_store.devices_mode(mode) if kept else mode
  sites_lowered = _host_jobs.sites_lowered
  keys = (key,)

  def call(*args, **kwargs):
    if trace.value is not eval_trace or axis_env.value is not top_axis_env:
      return general(*args, **kwargs)   # under a trace (a nested jit)
    try:
      state = local.state
    except AttributeError:   # the thread's first call
      return general(*args, **kwargs)
    if state.fast_mode != fast or errors or state.dispatching:
      return general(*args, **kwargs)
    passed = state.runtime.get(key)
    if passed is None or (kept and getattr(passed, "sharding", None)
                          is not sharding):
      return general(*args, **kwargs)   # (a chain starting; another kind)
    if passed is not state.verified and passed.is_ready():
      try:   # (ThreadTokens.tokens_for: a failed token goes to the general
        #       path, which learns it; one still running is handed on)
        passed.block_until_ready()
      except Exception:  # noqa: BLE001 - see ThreadTokens.tokens_for
        return general(*args, **kwargs)
    seq = (state.seqs[key] + 1) & seq_mask   # (this execution's: token_value)
    state.dispatching = 1   # (as the general path's += 1: SIGINT now
    try:                    # handled by interrupts)
      try:
        # (forwarding an empty **kwargs costs a dict: about 1% of a call)
        # (dispatching was 0: not inside a call of its own)
        if site.serialize is True and _launch_lock.serialize_launch(
            site, state.python_thread):
          with _launch_lock.launch_lock:
            out, token = jitted(passed, *args, **kwargs)
        else:
          out, token = (jitted(passed, *args, **kwargs) if kwargs
                        else jitted(passed, *args))
      except NeedsTokens:   # the trace found another chain: nothing ran
        token = None
      except ValueError as err:
        if not _placed_elsewhere(err, (passed,)):
          _failed(state, {key: seq}, err)
        token = None   # (the arguments put it elsewhere: nothing ran)
      except BaseException as err:  # noqa: BLE001 - an execution error or not
        _failed(state, {key: seq}, err)
      if token is not None:
        try:
          # (first: the bookkeeping below then runs once its callbacks are
          # done, not beside them for the GIL; a scalar token ready now:
          # a failure was raised by the call, as TokenStore.verified says)
          finish = site.finish
          if kept:
            ended = finish is not None and finish(token, state.python_thread)
          else:
            ended = token.is_ready() or (
                finish is not None and finish(token, state.python_thread))
          returned = token.sharding
          if returned is not site.sharding:
            _launch_lock.launched(site, returned)
          state.store(key, token, returned, passed, seq, kept, ended)
          if kept and len(returned.device_set) > 1 and sites_lowered():
            _executions.watch_failure(state.slot, {key: seq}, token)
        except BaseException:
          state.store_interrupted(keys, token, (passed,), seq=seq)
          raise
    finally:
      state.dispatching = 0   # (as the general path's -= 1)
    if token is None:   # (outside the handler: no __context__)
      return general(*args, **kwargs)
    if interrupted or own.errors:   # (a SIGINT, a callback that failed)
      _fast_after(state, token)
    return out
  _interrupts.dispatching_frame(call)
  return call
