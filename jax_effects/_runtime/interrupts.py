"""SIGINT (Ctrl-C) during a call: ``KeyboardInterrupt`` from the call, soon.

Python's own handler would raise into XLA as a callback's failure, or lose
the token of a call that is returning. While the main thread is inside a
call, :func:`_on_sigint` marks its slot interrupted (:data:`slots`: every
later host function of that slot's computations raises) and raises by the
innermost marked frame (``placement.innermost``): at once, but not in the
call path's frame that stores the token (``placement.DISPATCH``) or in
what the FFI entry calls around a host function (``placement.ENTRY``: it
would fail the computation in XLA; the host function raises it); the call
then raises it (:func:`take`). ``design/errors.md``, "KeyboardInterrupt".
"""
from __future__ import annotations

import contextlib
import signal
import threading

from jax_effects._runtime import placement as _placement
from jax_effects._runtime import threads as _threads

#: Slots whose call in progress was interrupted (read without a lock by
#: every host function: empty in the common case).
slots: set[int] = set()


def _on_sigint(signum, frame):
  state = getattr(_threads.local, "state", None)
  if state is None or not state.dispatching:
    signal.default_int_handler(signum, frame)
    return
  slots.add(state.slot)
  marked, kind, top = _placement.innermost(frame)
  if top and (kind == _placement.DISPATCH or kind == _placement.ENTRY):
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
  """Installs :func:`_on_sigint` (from the main thread) where Python's
  default SIGINT handler is installed."""
  if threading.current_thread() is not threading.main_thread():
    return
  # (ValueError, OSError: not the main interpreter, no signals)
  with contextlib.suppress(ValueError, OSError):
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
      signal.signal(signal.SIGINT, _on_sigint)


def entry_frame(function) -> None:
  """Marks Python the FFI entry calls around a host function
  (``placement.ENTRY``)."""
  _placement.mark(function.__code__, _placement.ENTRY)


def dispatching_frame(function) -> None:
  """Marks a function of the call path (``placement.DISPATCH``)."""
  _placement.mark(function.__code__, _placement.DISPATCH)


_threads.on_new_thread.append(_install_sigint_handler)
