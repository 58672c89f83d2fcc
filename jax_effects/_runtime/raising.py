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

import threading

import jax

from jax_effects._runtime import errors as _errors
from jax_effects._runtime import threads as _threads


def defer_error(exc: BaseException, slot: int = 0, inline: bool = False) -> None:
  """Keeps ``exc`` (a user's exception) for thread ``slot`` to raise.

  ``inline``: the callback may be running on the dispatching thread itself,
  inside its jax_effects call (the CPU client runs a computation it finds
  cheap inline when its inputs are ready): then that call raises it when it
  returns (:func:`raise_own`), as a failing Python call would. Only inside
  such a call: a computation the thread dispatched otherwise (an exported
  jax_effects function called outside ``jax_effects.jit``) leaves it for
  the thread's next call or barrier.
  """
  if inline:
    state = getattr(_threads.local, "state", None)
    if state is not None and state.slot == slot and state.dispatching:
      state.own_errors.append(exc)
      return
  _errors.defer(exc, slot)


def plain_jit_slot() -> int:
  """The dispatching thread's slot as seen by a callback under plain
  ``jax.jit`` (no carrier): the calling thread's when it is one Python
  started (the CPU client ran the computation inline, on the thread that
  dispatched it; its state is created if it has none yet), 0 (unknown) on
  one of XLA's threads (a foreign thread, which ``threading`` sees as a
  dummy): nothing there says who dispatched (``design/errors.md``)."""
  if isinstance(threading.current_thread(), threading._DummyThread):
    return 0
  return _threads.thread_state().slot


def raise_deferred(state: _threads.ThreadTokens) -> None:
  """Raises the errors deferred by computations this thread dispatched.

  Waits first for the thread's dispatched computations (only when an error is
  pending), so the errors of a failed execution are all reported together.
  """
  if state.slot not in _errors.deferred:
    return
  _threads.wait_quietly(state.pending())
  _errors.raise_pending((state.slot,))


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
  try:
    if state.own_errors:
      interrupts = _defer_own_errors(state)
      if interrupts:
        if isinstance(err, jax.errors.JaxRuntimeError):
          state.reset()
        interrupt = interrupts[0]
        del interrupts
        try:
          raise interrupt from err
        finally:
          del interrupt
    _errors.reraise(err, state.reset)
  finally:
    del err   # (no reference cycle through this frame: errors.reraise)


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


def move_own_errors(state: _threads.ThreadTokens) -> None:
  """Moves the errors of callbacks that ran inline in the call in progress
  to the thread's deferred errors (interrupts included): reported with
  every other pending error by whoever reports next (interpreter exit)."""
  own, state.own_errors = state.own_errors, []
  for exc in own:
    _errors.defer(exc, state.slot)


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
  report = errors[0] if len(errors) == 1 else _errors.group(errors)
  del own, rest, errors
  try:
    raise report
  finally:
    del report   # (no reference cycle through this frame: errors.raise_pending)


