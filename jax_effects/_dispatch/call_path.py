"""The call path: one threaded call, from runtime tokens in to the token stored.

Every call of a threaded ``jax.jit`` object (``function.PjitFunction``,
``stages.Compiled``) goes through here. Its part of the token calling
convention: the executable is ``g(t_1, ..., t_k, *args, **kwargs) ->
(outputs, token)``; the call passes the calling thread's runtime token of
each chain (``threads.ThreadTokens.runtime``), and the returned token becomes
the new runtime token of every chain it took and the output token of its
devices, stored before anything else can happen on the thread. The steps,
in order:

1. raise the errors earlier computations of this thread deferred, before
   dispatching anything (``errors.raise_deferred``);
2. after a switch of the thread's ordering mode, wait for its earlier
   dispatches (``ThreadTokens.switch_mode``);
3. fetch the runtime tokens (``ThreadTokens.tokens_for``): the computations
   that returned them have ended without failing (a failed one's chain
   starts afresh: a failed token is never handed on); a token kept on other
   devices is combined (``device_tokens``);
4. mark the thread dispatching (``ThreadTokens.begin_dispatch``: a SIGINT is
   now handled by ``interrupts``);
5. launch ``g``, under the launch lock when it spans several CPU devices
   (``launch_lock``); an execution error is raised as it is, after what the
   host kept for the execution is freed (``executions.failed``), or as
   ``KeyboardInterrupt`` after a SIGINT (``interrupts``); a kept per-device
   token refused because the arguments put the computation elsewhere is
   replaced by its first device's copy and the launch retried;
6. store the returned token (``ThreadTokens.update``; a call made inside
   this one, from its host callback, took the next sequence number
   (``ThreadTokens.tokens_for``, nested): of its token and this one's the
   later is kept, the other joined), also when an interrupt
   lands right after the launch (``ThreadTokens.store_interrupted``); a
   computation over several devices that may leave effects to run on the
   host is watched until it ends (``executions.watch``);
7. raise ``KeyboardInterrupt`` after a SIGINT during the call; raise the
   errors of callbacks that ran inline in this call (``errors.raise_own``);
   after jax_effects' own exit handler (a call from a later one), report
   every error at once and exit (``exit.report_late``).

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
                                       and a wait on it (``fast_mode`` is None
                                       while a token kept on devices or a
                                       joined one is held); a failed one
                                       falls back (the general path learns it)
4. mark dispatching                    falls back inside a call of the same
                                       thread (a call from a host callback)
5. elsewhere-retry                     not needed: scalar tokens are
                                       uncommitted and follow the arguments
6. store the token                     an inlined copy of
                                       ``ThreadTokens.update`` for one scalar
                                       chain (no sharding hashed); the
                                       general ``update`` when the device set
                                       changes or a call made inside this
                                       one stored a token; no watch (one
                                       device)
=====================================  =====================================

A first call, a call under a trace, a trace that finds another chain
(``NeedsTokens``) and a per-device token returned go back to the function's
general path. A function whose token stays on its devices (a ``shard_map``
program, effects once over several devices) has its own hook,
:func:`fast_dispatch_devices`: the same steps for that token, passed back
whole, under the launch lock where needed, its computation watched where it
may leave effects to run on the host. Where the compiled hook is built (``_fast_call.c``, see
:data:`HOOK`), it runs this common case with no Python frame and hands
every other case, before anything happened, to the Python hook.
"""
from __future__ import annotations

import os

import jax

from jax_effects import _compat
from jax_effects._primitives import ffi_abi as _ffi_abi
from jax_effects._runtime import device_tokens as _device_tokens
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import exit as _exit
from jax_effects._runtime import host_jobs as _host_jobs
from jax_effects._runtime import interrupts as _interrupts
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import output as _output
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import token_value as _token_value

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
          and any(_device_tokens.kept_on_devices(t) for t in tokens))


def dispatch(state, mode: str, keys: tuple, device_sharding, call, args,
             kwargs, site: _launch_lock.LaunchSite, at_risk: bool = False):
  """One dispatch step (every threaded call: :class:`~jax_effects._dispatch.core.Core`, :class:`Compiled`).

  The steps of the module docstring, in order. Passes the thread's runtime
  tokens of ``keys`` to ``call(*tokens, *args, **kwargs)`` and stores the
  returned token. Returns ``(outputs, token)``. :class:`NeedsTokens`
  propagates unchanged. A computation over several CPU devices is launched
  under ``_launch_lock.launch_lock`` (``site``: what this call site launched
  last). ``at_risk``: the computation runs one of JAX's own callbacks and
  may fail as a whole (``ThreadTokens.tokens_for``).
  """
  if _errors.deferred:   # an earlier call's callback failed
    _errors.raise_deferred(state)   # before dispatching anything
  if state.mode != mode:   # after a mode switch: follow earlier dispatches
    state.switch_mode(mode)
  nested = state.dispatching   # (a call from a host callback of its call)
  tokens, read = state.tokens_for(keys, device_sharding, nested)
  # This execution's identity (token_value), read before the launch: a call
  # made inside it (from its host callback) moves the thread's copies.
  seqs, seq = state.execution(keys)
  outer = _errors.enter_call() if nested else None
  try:
    state.begin_dispatch()   # (SIGINT now: interrupts)
    try:
      elsewhere = False
      try:
        out, token = _launch(site, call, tokens, args, kwargs)
      except ValueError as err:
        if not _placed_elsewhere(err, tokens):
          _failed(state, seqs, err)
        elsewhere = True
      except BaseException as err:  # noqa: BLE001 - an execution error or not
        _failed(state, seqs, err)
      if elsewhere:
        # A token kept on the devices of this function's last computation
        # (device_tokens.kept_on_devices), while this call's arguments put
        # the computation on others: JAX refused it before running anything.
        # Its first device's copy (or combination) goes instead.
        tokens, read = state.tokens_for(keys, None, nested)
        seqs, seq = state.execution(keys)
        try:
          out, token = _launch(site, call, tokens, args, kwargs)
        except BaseException as err:  # noqa: BLE001 - an execution error or not
          _failed(state, seqs, err)
      try:
        _launch_lock.launched(site, token.sharding)
        state.update(keys, token, read, at_risk, seq)
      except BaseException:
        # KeyboardInterrupt (SIGINT) landing in update, after the computation
        # was dispatched: its token is still stored, so what follows waits.
        state.store_interrupted(keys, token, read, at_risk, seq)
        raise
      if (seqs and len(token.sharding.device_set) > 1
          and _host_jobs.sites_lowered()):
        _executions.watch_failure(state.slot, seqs, token)
    finally:
      state.end_dispatch()
    if _interrupts.slots and _interrupts.take(state):
      _errors.move_own_errors()   # (for the next call or barrier)
      raise KeyboardInterrupt   # the computation ran; its token is stored
    if _threads.after_exit_handler:   # dispatched by a late exit handler
      _exit.report_late(state)
    if _errors.own.errors:   # a callback of this call failed (ran inline)
      _errors.raise_own(state, token)
  finally:
    if outer is not None:
      _errors.leave_call(outer)
  return out, token


@_compat.api_boundary   # (its traceback shows no frame of ours: jax.jit's)
def _failed(state, seqs: dict, err: BaseException) -> None:
  """Raises the error of a dispatch that failed (step 5): an XLA failure
  frees what the host kept for the execution (``seqs``: its identity,
  ``executions.failed``); after a SIGINT during the call (``interrupts``)
  it is ``KeyboardInterrupt``."""
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
  """Step 7 of the fast hooks (:func:`fast_dispatch`, its compiled form,
  :func:`fast_dispatch_devices`), once their token is stored, when a SIGINT
  landed or a callback failed during the call: raises ``KeyboardInterrupt``
  (the computation ran; its token is stored), or the errors of callbacks
  that ran inline in the call."""
  if _interrupts.slots and _interrupts.take(state):
    _errors.move_own_errors()
    raise KeyboardInterrupt
  if _errors.own.errors:
    _errors.raise_own(state, token)


def fast_dispatch_devices(mode: str, key, jitted, *, sharding,
                          site: _launch_lock.LaunchSite, general):
  """The dispatch hook of a function whose token stays on its devices
  (``device_tokens.kept_on_devices``: a ``shard_map`` program, or effects
  run once over several devices), in its common case: :func:`fast_dispatch`'s
  steps for the one chain ``key`` whose token, kept on the devices of
  ``sharding`` (the callee's token's), is passed back whole.

  Valid while the thread's ``fast_mode`` is ``threads.devices_mode(mode)``
  and its token of ``key`` is one kept on exactly those devices; it waits
  for nothing (a token that ended is checked for failure, as the general
  path does), launches under ``launch_lock`` where the devices are several
  CPU devices (not inside a host callback), stores the returned token as
  it is (no copy), and has a computation that may leave effects to run on
  the host watched (``executions.watch_failure``), as :func:`dispatch`
  does. Every other case goes to ``general``: also a launch JAX refuses
  because the arguments put the computation on other devices than the
  token's (nothing ran; the general path passes the token combined); a
  returned token of another kind, or one in the deterministic view
  (``output.holding``: combined), goes to ``ThreadTokens.update``.
  """
  trace, axis_env, eval_trace, top_axis_env = _compat.TOP_LEVEL
  seq_mask = _token_value.SEQ_MASK
  errors = _errors.deferred
  own = _errors.own
  interrupted = _interrupts.slots
  local = _threads.local
  fast = _threads.devices_mode(mode)
  holding = _output.holding
  sites_lowered = _host_jobs.sites_lowered
  serialize_launch = _launch_lock.serialize_launch
  lock = _launch_lock.launch_lock
  keys = (key,)

  def call(*args, **kwargs):
    if trace.value is not eval_trace or axis_env.value is not top_axis_env:
      return general(*args, **kwargs)   # under a trace (a nested jit)
    try:
      state = local.state
    except AttributeError:   # the thread's first call
      return general(*args, **kwargs)
    if state.fast_mode is not fast or errors or state.dispatching:
      return general(*args, **kwargs)
    runtime = state.runtime
    passed = runtime.get(key)
    if passed is None or getattr(passed, "sharding", None) is not sharding:
      return general(*args, **kwargs)
    try:   # (ThreadTokens.tokens_for: a failed token goes to the general
      #       path, which learns it; one still running is handed on)
      if passed.is_ready():
        passed.block_until_ready()
    except Exception:  # noqa: BLE001 - see ThreadTokens.tokens_for
      return general(*args, **kwargs)
    seqs = state.seqs
    seq = (seqs[key] + 1) & seq_mask
    state.dispatching = 1
    try:
      try:
        if serialize_launch(site):
          with lock:
            out, token = jitted(passed, *args, **kwargs)
        else:
          out, token = jitted(passed, *args, **kwargs)
      except NeedsTokens:   # the trace found another chain: nothing ran
        token = None
      except ValueError as err:
        if not _placed_elsewhere(err, (passed,)):
          _failed(state, {key: seq}, err)
        token = None   # (the arguments put it elsewhere: nothing ran; the
        #                general path passes the token combined)
      except BaseException as err:  # noqa: BLE001 - an execution error or not
        _failed(state, {key: seq}, err)
      if token is not None:
        try:
          returned = token.sharding
          if returned is not site.sharding:
            _launch_lock.launched(site, returned)
          if (returned is sharding and runtime.get(key) is passed
              and not holding()):
            # (ThreadTokens.update for one chain kept on devices, inlined)
            if returned is state.last_sharding:
              state.last_token = token
            else:
              state.update((), token)   # (files it as the output token)
            runtime[key] = token
            seqs[key] = seq
          else:
            state.update(keys, token, (passed,), seq=seq)
          if len(returned.device_set) > 1 and sites_lowered():
            _executions.watch_failure(state.slot, {key: seq}, token)
        except BaseException:
          state.store_interrupted(keys, token, (passed,), seq=seq)
          raise
    finally:
      state.dispatching = 0
    if token is None:
      return general(*args, **kwargs)
    if interrupted or own.errors:   # (a SIGINT, a callback that failed)
      _fast_after(state, token)
    return out
  _interrupts.dispatching_frame(call)
  return call


def _compiled_hook():
  """The compiled hook's module (``_fast_call``, built by ``pip install .``
  where a C compiler exists), or None: not built, or
  ``JAX_EFFECTS_FAST_CALL`` is ``python`` (the Python hook, forced: tests
  run both). Read once, at import."""
  if os.environ.get("JAX_EFFECTS_FAST_CALL", "") == "python":
    return None
  try:
    from jax_effects._dispatch import _fast_call
  except ImportError:
    return None
  return _fast_call


_FAST_CALL = _compiled_hook()
#: How the fast hook's common case runs: "compiled" (``_fast_call.c``) or
#: "python" (:func:`fast_dispatch`'s closure alone).
HOOK = "compiled" if _FAST_CALL is not None else "python"
if _FAST_CALL is not None:   # (a SIGINT landing in it: as in the Python hook)
  _interrupts.compiled_hook_caller = _FAST_CALL.caller


@_compat.api_boundary
def _fast_failed(state, key, seq: int, err: BaseException) -> None:
  """The compiled hook's launch raised ``err`` (not ``NeedsTokens``): as
  the Python hook's ``except`` (:func:`_failed`); raises."""
  try:
    _failed(state, {key: seq}, err)
  finally:
    del err


def _fast_store_failed(state, key, token, passed, seq: int) -> None:
  """The compiled hook's store raised (a SIGINT handled in one of its
  Python calls): the token is stored anyway, as the Python hook's
  ``except`` does (``ThreadTokens.store_interrupted``), and the interrupt,
  being raised, is taken."""
  state.store_interrupted((key,), token, (passed,), seq=seq)
  _interrupts.take(state)


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
  seq_mask = _token_value.SEQ_MASK
  errors = _errors.deferred   # (the registry dict itself: emptied, never replaced)
  own = _errors.own
  interrupted = _interrupts.slots
  local = _threads.local
  keys = (key,)

  def call(*args, **kwargs):
    if trace.value is not eval_trace or axis_env.value is not top_axis_env:
      return general(*args, **kwargs)   # under a trace (a nested jit)
    try:
      state = local.state
    except AttributeError:   # the thread's first call
      return general(*args, **kwargs)
    if state.fast_mode != mode or errors or state.dispatching:
      return general(*args, **kwargs)
    runtime = state.runtime
    passed = runtime.get(key)
    if passed is None:   # (a chain starting: the general path)
      return general(*args, **kwargs)
    if passed is not state.verified and passed.is_ready():
      try:
        # (ThreadTokens.tokens_for, inlined: a failed token goes to the
        # general path, which learns it; one still running is handed on)
        passed.block_until_ready()
      except Exception:  # noqa: BLE001 - see ThreadTokens.tokens_for
        return general(*args, **kwargs)
    seqs = state.seqs
    seq = (seqs[key] + 1) & seq_mask   # (this execution's: token_value)
    state.dispatching = 1   # (ThreadTokens.begin_dispatch: SIGINT now
    try:                    # handled by interrupts)
      try:
        # (forwarding an empty **kwargs costs a dict: about 1% of a call)
        if site.serialize is not True or not _launch_lock.serialize_launch(site):
          out, token = (jitted(passed, *args, **kwargs) if kwargs
                        else jitted(passed, *args))
        else:
          with _launch_lock.launch_lock:
            out, token = (jitted(passed, *args, **kwargs) if kwargs
                          else jitted(passed, *args))
      except NeedsTokens:   # the trace found another chain: nothing ran
        token = None
      except BaseException as err:  # noqa: BLE001 - an execution error or not
        _failed(state, {key: seq}, err)
      if token is not None:
        try:
          sharding = token.sharding
          if sharding is not site.sharding:
            _launch_lock.launched(site, sharding)
          if sharding is state.last_sharding and runtime.get(key) is passed:
            # (ThreadTokens.update for this one scalar chain, inlined)
            state.last_token = token
            stored = runtime[key] = (uncommitted(token) if committed(token)
                                     else token)
            seqs[key] = seq
            if token.is_ready():   # (ThreadTokens.verified)
              state.verified = stored
          else:
            # (another device set than the last dispatch's, or a token
            # kept on devices: a new signature; update clears fast_mode
            # then, and the next call's general path learns its shape; or
            # a call made inside this one stored a token meanwhile)
            state.update(keys, token, (passed,), seq=seq)
        except BaseException:
          state.store_interrupted(keys, token, (passed,), seq=seq)
          raise
    finally:
      state.dispatching = 0   # (ThreadTokens.end_dispatch)
    if token is None:   # (outside the handler: no __context__)
      return general(*args, **kwargs)
    if interrupted or own.errors:   # (a SIGINT, a callback that failed)
      _fast_after(state, token)
    return out
  _interrupts.dispatching_frame(call)
  if _FAST_CALL is None:
    return call
  return _FAST_CALL.FastCall(
      call, general, jitted, key, mode, local, trace, eval_trace, axis_env,
      top_axis_env, errors, site, interrupted, own, _fast_failed,
      _launch_lock.launched, uncommitted, _fast_after, NeedsTokens,
      _fast_store_failed, seq_mask, _ffi_abi.entries_counter())


