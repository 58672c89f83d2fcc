"""SIGINT (Ctrl-C) during a call: ``KeyboardInterrupt`` from the call, soon.

Python runs a signal handler in the main thread between two bytecodes. A
call that runs a compiled loop with host callbacks on the CPU client sits
in XLA, which calls the callbacks inline: a ``KeyboardInterrupt`` raised by
Python's handler in a callback would reach XLA as that callback's failure
(``ValueError``/``JaxRuntimeError`` "CpuCallback error ...
KeyboardInterrupt", so a user's ``except KeyboardInterrupt`` never runs),
and one landing as the call returns, before its token is stored, would lose
the token. jax_effects' handler (:func:`_on_sigint`, installed where
Python's default one is; a user's own handler is left alone) decides by the
innermost of jax_effects' marked frames (``frames``) while the main thread
is inside a call (``TokenStore.dispatching``):

* in a host function of the call's computation (``frames.HOST``): the
  thread's slot is marked interrupted (:data:`slots`) and
  ``KeyboardInterrupt`` raised there; host functions raise it into XLA
  instead of deferring it (``_primitives.host_functions.FailedBit``), and
  every later host function of that slot's computations raises at once, on
  any device, so the computation ends at its next callback;
* in the call path between the launch and the storing of the returned token
  (``frames.DISPATCH``, the frame itself): marked, nothing raised there;
  the token is stored first;
* in the entry of the C callback XLA calls (``frames.ENTRY``, the frame
  itself, e.g. at its first bytecode, before its ``try``): marked, nothing
  raised there (ctypes would drop it and take the callback as done, its
  work not done); the host functions it calls raise it;
* anywhere else (tracing, compiling, a callback of JAX's own running
  inline): marked, and raised at once, as Python's default handler does.

The call then raises ``KeyboardInterrupt`` (:func:`take`), whether its
computation ended early (XLA's error is dropped: the interrupt is what the
user did) or completed (its token stored). The computation's progress bars
close (``executions.failed``). Outside a call the default handler raises.
"""
from __future__ import annotations

import signal
import threading

from jax_effects._runtime import frames as _frames
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import thread_slots as _thread_slots

#: Slots whose call in progress was interrupted: their computations' host
#: functions end them (read without a lock by every host function: empty in
#: the common case).
slots: set[int] = set()


def _on_sigint(signum, frame):
  state = getattr(_threads.local, "state", None)
  if state is None or not state.dispatching:
    signal.default_int_handler(signum, frame)
    return
  slots.add(state.slot)
  marked, kind, top = _frames.innermost(frame)
  if top and (kind == _frames.DISPATCH or kind == _frames.ENTRY):
    return   # the call raises it once its token is stored (take); in an
    #          entry, its host function raises it
  signal.default_int_handler(signum, frame)


def take(state) -> bool:
  """Whether ``state``'s call was interrupted (then it raises
  ``KeyboardInterrupt``); clears the mark at the outermost call."""
  if state.slot not in slots:
    return False
  if state.dispatching <= 1:
    slots.discard(state.slot)
  return True


def _install_sigint_handler() -> None:
  """Installs :func:`_on_sigint` (from the main thread, once) where Python's
  default SIGINT handler is installed; a user's own handler is left alone."""
  if threading.current_thread() is not threading.main_thread():
    return
  try:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
      signal.signal(signal.SIGINT, _on_sigint)
  except (ValueError, OSError):  # not the main interpreter, no signals
    pass


def entry_frame(function) -> None:
  """Marks the entry of a C callback that XLA calls (``frames.ENTRY``)."""
  _frames.mark(function.__code__, _frames.ENTRY)


def dispatching_frame(function) -> None:
  """Marks a function of the call path whose frame runs from the launch to
  the storing of the returned token (``frames.DISPATCH``)."""
  _frames.mark(function.__code__, _frames.DISPATCH)


_thread_slots.on_new_thread.append(_install_sigint_handler)
