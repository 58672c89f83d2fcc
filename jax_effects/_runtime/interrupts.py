"""SIGINT during a dispatch: the interrupt waits until the token is stored.

Python raises ``KeyboardInterrupt`` at the next instruction boundary of the
main thread: when SIGINT arrives while a dispatch is blocked in JAX's C++
code (the CPU client runs a computation with host callbacks inline), that is
right after the call returns, in the dispatching frame, before its result
is stored: the computation runs, but its token would be lost, so the next
call's effects could run before its effects and a barrier would not wait
for them. While a registered dispatching frame (its code object, marked by
:func:`interrupts_deferred_in`) stores its token
(``ThreadTokens.dispatching``), the interrupt is deferred to the end of that
call (``raising.raise_own``): the token is stored first. Anywhere else
(tracing, compiling, a host callback, user code) it is raised at once, as
Python's default handler does. A user's own SIGINT handler is left alone.
"""
from __future__ import annotations

import signal
import threading

from jax_effects._runtime import threads as _threads

_deferring_codes: set = set()


def interrupts_deferred_in(function) -> None:
  """Registers a dispatching function (its frame stores a dispatched
  computation's token while ``ThreadTokens.dispatching``)."""
  _deferring_codes.add(function.__code__)


def _on_sigint(signum, frame):
  state = getattr(_threads.local, "state", None)
  if (state is not None and state.dispatching and frame is not None
      and frame.f_code in _deferring_codes):
    exc = KeyboardInterrupt()
    exc.jax_effects_signal = True
    state.own_errors.append(exc)   # raised by this call once its token is stored
    return
  signal.default_int_handler(signum, frame)


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




_threads.on_new_thread.append(_install_sigint_handler)
