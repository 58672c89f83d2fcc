"""The call path: one threaded call, from runtime tokens in to the token stored.

Every call of a threaded ``jax.jit`` object (``function.PjitFunction``,
``function.Compiled``) goes through here. Its part of the token calling
convention: the executable is ``g(t_1, ..., t_k, *args, **kwargs) ->
(outputs, token)``; the call passes the calling thread's runtime token of
each chain (``threads.ThreadTokens.runtime``), and the returned token becomes
the new runtime token of every chain it took and the output token of its
devices, stored before anything else can happen on the thread. The steps,
in order:

1. raise the errors earlier computations of this thread deferred, before
   dispatching anything (``raising.raise_deferred``);
2. after a switch of the thread's ordering mode, wait for its earlier
   dispatches (``ThreadTokens.switch_mode``);
3. fetch the runtime tokens (``ThreadTokens.tokens_for``; a per-device token for
   another device set is combined, ``per_device``);
4. mark the thread dispatching (a SIGINT now waits until 6: ``interrupts``);
5. launch ``g``, under the launch lock when it spans several CPU devices
   (``launch_lock``); an execution error is raised as it is
   (``raising.dispatch_failed``); a kept per-device token refused because the
   arguments put the computation elsewhere is replaced by its first device's
   copy and the launch retried;
6. store the returned token (``ThreadTokens.update``), also when an interrupt
   lands right after the launch (``ThreadTokens.store_interrupted``);
7. raise the errors of callbacks that ran inline in this call
   (``raising.raise_own``); after jax_effects' own exit handler (a call from
   a later one), report every error at once and exit (``exit.report_late``).

:func:`dispatch` is the general path. :func:`fast_dispatch` builds the hot
path of one function in its common case, as a closure installed as the
function's ``__call__``; it runs the same steps, inlined, and skips what its
case cannot need:

=====================================  =====================================
step                                   fast path
=====================================  =====================================
1. raise deferred errors               falls back to :func:`dispatch` when
                                       any error is pending (one dict check)
2. mode switch                         falls back unless the thread's
                                       ``fast_mode`` is the function's mode
                                       (cleared by any mode change)
3. fetch tokens                        one chain, scalar tokens: one dict get
                                       (``fast_mode`` is None while a
                                       per-device token is held)
5. elsewhere-retry                     not needed: scalar tokens are
                                       uncommitted and follow the arguments
6. store the token                     replaces ``last_token`` without
                                       hashing a sharding; the general
                                       ``update`` when the device set changes
=====================================  =====================================

A first call, a call under a trace, a trace that finds another chain
(``NeedsTokens``) and a per-device token returned go back to the function's
general path.
"""
from __future__ import annotations

from jax_effects import _compat
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import exit as _exit
from jax_effects._runtime import interrupts as _interrupts
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import per_device as _per_device
from jax_effects._runtime import raising as _raising
from jax_effects._runtime import threads as _threads

#: Prefix of the token parameters' names (``__jax_effects_runtime_tokens___0``,
#: ...): reserved.
TOKENS_KW = "__jax_effects_runtime_tokens__"


class NeedsTokens(Exception):
  """A threaded trace found chains its call passed no runtime token for.

  Raised out of ``jax.jit``'s trace (``tracing.threaded``) to the call,
  which learns ``keys`` and calls again (``core.Core.call_threaded``,
  ``PjitFunction.trace``); :func:`dispatch` lets it through, nothing having
  run; the fast hook hands the call to its general path.
  """

  def __init__(self, keys):
    super().__init__(f"jax_effects: retrace with runtime tokens for {keys}")
    self.keys = keys


def _launch(site: _launch_lock.LaunchSite, call, tokens, args, kwargs):
  """``call(*tokens, *args, **kwargs)``, under the launch lock where
  ``site`` needs it. (SIGINT landing here, as the call returns, is deferred
  like in ``_dispatch``: registered below.)"""
  if _launch_lock.serialize_launch(site):
    with _launch_lock.launch_lock:
      return call(*tokens, *args, **kwargs)
  return call(*tokens, *args, **kwargs)


def _placed_elsewhere(err: ValueError, tokens) -> bool:
  """Whether ``err`` is JAX refusing a runtime token kept on other devices
  than those of the computation (it names the token's parameter)."""
  message = str(err)
  return ("incompatible devices" in message and TOKENS_KW in message
          and any(_per_device.kept_on_devices(t) for t in tokens))


def dispatch(state, mode: str, keys: tuple, per_device_sharding, call, args,
              kwargs, site: _launch_lock.LaunchSite):
  """One dispatch step (every threaded call: :class:`~jax_effects._dispatch.core.Core`, :class:`Compiled`).

  First raises the errors earlier computations of this thread deferred
  (before dispatching anything), and after a mode switch waits for the
  thread's earlier dispatches (``ThreadTokens.switch_mode``). Then passes
  the thread's runtime tokens of ``keys`` to ``call(*tokens, *args,
  **kwargs)`` and stores the returned token, also when an interrupt lands
  right after the dispatch; raises the errors of callbacks that ran inline
  in this call (``design/errors.md``). Returns ``(outputs, token)``.
  :class:`NeedsTokens` propagates unchanged. A computation over several CPU
  devices is launched under ``_launch_lock.launch_lock`` (``site``: what
  this call site launched last).
  """
  if _errors.deferred:   # an earlier call's callback failed
    _raising.raise_deferred(state)   # before dispatching anything
  if state.mode != mode:   # after a mode switch: follow earlier dispatches
    state.switch_mode(mode)
  tokens = state.tokens_for(keys, per_device_sharding)
  state.dispatching = True   # (SIGINT here waits for the token's storing)
  try:
    elsewhere = False
    try:
      out, token = _launch(site, call, tokens, args, kwargs)
    except ValueError as err:
      if not _placed_elsewhere(err, tokens):
        _raising.dispatch_failed(state, err)
      elsewhere = True
    except Exception as err:  # noqa: BLE001 - an execution error or not
      _raising.dispatch_failed(state, err)
    if elsewhere:
      # A token kept on the devices of this function's last computation
      # (_per_device.kept_on_devices), while this call's arguments put
      # the computation on others: JAX refused it before running anything.
      # Its first device's copy (or combination) goes instead.
      tokens = state.tokens_for(keys, None)
      try:
        out, token = _launch(site, call, tokens, args, kwargs)
      except Exception as err:  # noqa: BLE001 - an execution error or not
        _raising.dispatch_failed(state, err)
    try:
      _launch_lock.launched(site, token.sharding)
      state.update(keys, token)
    except BaseException:
      # KeyboardInterrupt (SIGINT) landing in update, after the computation
      # was dispatched: its token is still stored, so what follows waits.
      state.store_interrupted(keys, token)
      raise
  finally:
    state.dispatching = False
  if _threads.after_exit_handler:   # dispatched by a late exit handler
    _exit.report_late(state)
  if state.own_errors:   # a callback of this call failed (ran inline)
    _raising.raise_own(state, token)
  return out, token


_interrupts.interrupts_deferred_in(dispatch)
_interrupts.interrupts_deferred_in(_launch)


def fast_dispatch(mode: str, key, jitted, *, site: _launch_lock.LaunchSite,
                  general):
  """The dispatch hook of one function in its common case (``_dispatch.function``).

  Valid while the function threads one ordered chain ``key`` with scalar
  runtime tokens through ``jitted`` (``jitted(token, *args, **kwargs)
  -> (outputs, token)``) in ordering mode ``mode``. The returned
  ``call(*args, **kwargs)`` is what calling the function calls: it passes
  the thread's token of ``key``, stores the returned one (also when an
  interrupt lands right after the dispatch, see ``ThreadTokens.store_interrupted``)
  and raises the errors of callbacks that ran inline in the call, the steps
  of :func:`dispatch` without their loops, branches and frames.
  Every other case goes to ``general(*args, **kwargs)``, the function's
  general call (which learns what there is to learn): under a trace; in
  another mode, after a mode switch, with a per-device token or an error
  pending (``ThreadTokens.fast_mode``); after a trace that found another
  chain (:class:`NeedsTokens`: nothing ran). A per-device token returned (a
  new signature) is stored: it clears the thread's ``fast_mode``, so its
  next call takes the general path, which learns the token's shape. A
  computation over several CPU devices is launched under ``launch_lock``
  (``site``: what this hook launched last).
  """
  trace, axis_env, eval_trace, top_axis_env = _compat.TOP_LEVEL
  committed, uncommitted = _compat.committed, _compat.uncommitted
  errors = _errors.deferred   # (the registry dict itself: emptied, never replaced)
  local = _threads.local

  def call(*args, **kwargs):
    if trace.value is not eval_trace or axis_env.value is not top_axis_env:
      return general(*args, **kwargs)   # under a trace (a nested jit)
    try:
      state = local.state
    except AttributeError:   # the thread's first call
      return general(*args, **kwargs)
    if state.fast_mode != mode or errors:
      return general(*args, **kwargs)
    runtime = state.runtime
    token = runtime.get(key)
    if token is None:
      token = state.initial_token()
    state.dispatching = True   # (see _on_sigint)
    try:
      try:
        # (forwarding an empty **kwargs costs a dict: about 1% of a call)
        if site.serialize is not True or not _launch_lock.serialize_launch(site):
          out, token = (jitted(token, *args, **kwargs) if kwargs
                        else jitted(token, *args))
        else:
          with _launch_lock.launch_lock:
            out, token = (jitted(token, *args, **kwargs) if kwargs
                          else jitted(token, *args))
      except NeedsTokens:   # the trace found another chain
        token = None
      except Exception as err:  # noqa: BLE001 - an execution error or not
        _raising.dispatch_failed(state, err)
      if token is not None:
        try:
          sharding = token.sharding
          if sharding is not site.sharding:
            _launch_lock.launched(site, sharding)
          if sharding is not state.last_sharding or state.last_token is None:
            if _per_device.kept_on_devices(token):   # a per-device token (a new signature)
              state.update((key,), token)
              sharding = None
            else:   # another device set than the last dispatch's
              state.file_last()
              state.output.pop(sharding, None)
              state.last_sharding = sharding
          if sharding is not None:
            state.last_token = token
            runtime[key] = (uncommitted(token) if committed(token)
                            else token)
        except BaseException:
          state.store_interrupted((key,), token)   # see store_interrupted
          raise
    finally:
      state.dispatching = False
    if token is None:   # (outside the handler: no __context__)
      return general(*args, **kwargs)
    if state.own_errors:   # a callback of this call failed (ran inline)
      _raising.raise_own(state, token)
    return out
  _interrupts.interrupts_deferred_in(call)
  return call


