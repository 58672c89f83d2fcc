"""Raising callback errors to the thread that dispatched them.

``errors`` is the registry (slot -> deferred exceptions); this module is the
thread's side of the contract (``design/errors.md``): an error of a
callback that ran inline in the thread's own call is raised by that call
when it returns (:func:`raise_own`); any other by the thread's next call,
before it dispatches anything (:func:`raise_deferred`), or its barrier. An
interrupt (SIGINT) deferred during a dispatch (``interrupts``) is raised
once the dispatched token is stored.
"""
from __future__ import annotations

import jax

from jax_effects._runtime import errors as _errors
from jax_effects._runtime import threads as _threads


def defer_error(exc: BaseException, slot: int = 0, inline: bool = False) -> None:
  """Keeps ``exc`` (a user's exception) for thread ``slot`` to raise.

  ``inline``: the callback may be running on the dispatching thread itself,
  inside its jax_effects call (the CPU client runs a computation inline when
  its inputs are ready): then that call raises it when it returns
  (:func:`raise_own`), as a failing Python call would.
  """
  if inline:
    state = getattr(_threads.local, "state", None)
    if state is not None and state.slot == slot:
      state.own_errors.append(exc)
      return
  _errors.defer(exc, slot)


def current_slot() -> int:
  """The slot of the calling thread (0 if it never used jax_effects)."""
  state = getattr(_threads.local, "state", None)
  return 0 if state is None else state.slot


def raise_deferred(state: _threads.ThreadTokens) -> None:
  """Raises the errors deferred by computations this thread dispatched.

  Waits first for the thread's dispatched computations (only when an error is
  pending), so the errors of a failed execution are all reported together.
  """
  if state.slot not in _errors.deferred:
    return
  _threads.wait_quietly(state.pending())
  exc = _errors.pop_deferred((state.slot,))
  if exc is not None:
    raise exc.with_traceback(exc.__traceback__)


def dispatch_failed(state: _threads.ThreadTokens, err: Exception) -> None:
  """Raises ``err``, raised by the dispatch in progress (see
  ``_runtime.errors.reraise``).

  Errors of callbacks that ran inline before the computation failed (in
  ``own_errors``) are deferred to the thread's next call or barrier, which
  raise them before dispatching anything: left in ``own_errors``, the next
  call would raise them after running (its result discarded for an earlier
  call's error). An interrupt deferred during the dispatch (``_on_sigint``)
  is raised instead of ``err`` (with ``err`` as its cause).
  """
  if state.own_errors:
    interrupts = _defer_own_errors(state)
    if interrupts:
      if isinstance(err, jax.errors.JaxRuntimeError):
        state.reset()
      raise interrupts[0] from err
  _errors.reraise(err, state.reset)


def is_interrupt(exc: BaseException) -> bool:
  """An interrupt deferred during a dispatch (:func:`_on_sigint`)."""
  return getattr(exc, "jax_effects_signal", False)


def _defer_own_errors(state: _threads.ThreadTokens) -> list:
  """Moves the callbacks' errors in ``state.own_errors`` to the thread's
  deferred errors (its next call or barrier raises them before dispatching);
  returns the interrupts that were there."""
  own, state.own_errors = state.own_errors, []
  for exc in own:
    if not is_interrupt(exc):
      _errors.defer(exc, state.slot)
  return [exc for exc in own if is_interrupt(exc)]


def raise_own(state: _threads.ThreadTokens, token) -> None:
  """Raises the errors of the call that just returned (callbacks that ran
  inline), with every other error of the thread pending once that call's
  computation has completed: one report."""
  if any(is_interrupt(exc) for exc in state.own_errors):
    # Ctrl-C during the dispatch (_on_sigint): raised now, without waiting
    # for the computation (its token is stored); the callbacks' errors stay
    # for the thread's next call or barrier.
    raise _defer_own_errors(state)[0]
  own, state.own_errors = state.own_errors, []
  _threads.wait_quietly((token,))
  if state.slot in _errors.deferred:
    _threads.wait_quietly(state.pending())
  rest = _errors.pop_deferred((state.slot,))
  errors = own + (_errors.flat_errors(rest) if rest is not None else [])
  exc = errors[0] if len(errors) == 1 else _errors.group(errors)
  raise exc.with_traceback(exc.__traceback__)


