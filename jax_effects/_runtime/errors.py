"""Errors of host callbacks: each reported once, to the thread that dispatched it.

The contract is ``design/errors.md``; this module owns its state (the
deferred errors of every thread, and the errors of callbacks that ran inline
in the thread's call in progress) and is its only writer. A callback error
never fails an XLA computation (in a multi-device one the other devices
would wait forever in the next collective; under plain ``jax.jit`` no hook
of ours could catch XLA's error). Instead the host function
(``_primitives.host_functions``) *defers* the user's exception here
(:func:`defer`), under the slot of the thread that dispatched the
computation (its carrier's, ``token_value``), and returns zeros with the
carrier's ``FAILED`` bit set, so the later effects of its chain in that
execution are skipped, as nothing runs after a ``raise`` in Python.

That thread raises what is deferred for it, once: the call itself when the
callback ran inline in it (:func:`raise_own`), else its next call before it
dispatches anything (:func:`raise_deferred`), or its barrier. Several errors
pending at once are one report (:func:`group`); at most
:data:`MAX_KEPT_ERRORS` are kept per thread between reports, the rest
counted. A report is raised so that nothing of the library keeps it alive
once the caller drops it (:func:`raise_pending`, :func:`reraise`): no frame
it passes through holds it in a local, which would make a reference cycle
(exception -> traceback -> frame -> exception) that only the garbage
collector frees.

Its part in the token calling convention: the slot in a carrier names the
thread an error is filed for; the ``FAILED`` bit (``token_value``) is the
rule "nothing after a raise" inside one execution.
"""
from __future__ import annotations

import sys
import threading

import jax

from jax_effects._runtime import fork as _fork
from jax_effects._runtime import token_value as _token_value

FAILED = _token_value.FAILED
#: At most this many deferred errors are kept per thread between two reports;
#: later ones are counted, and the count is reported with them.
MAX_KEPT_ERRORS = 64

_lock = threading.Lock()
# Deferred errors: slot of the dispatching thread -> its unreported errors,
# oldest first (at most MAX_KEPT_ERRORS; _dropped counts the others). Slot 0:
# the dispatching thread is unknown (a callback under plain jax.jit that ran
# on one of XLA's threads), reported only by an all-threads barrier or at
# exit. Read without the lock on every dispatch (empty: no deferred error
# anywhere).
deferred: dict[int, list[BaseException]] = {}
_dropped: dict[int, int] = {}




class _Own(threading.local):
  """The calling thread's slot (set when its token state is made,
  :func:`set_thread_slot`) and the errors of callbacks that ran inline in
  its call in progress: that call raises them when it returns
  (:func:`raise_own`)."""

  def __init__(self):
    self.slot = -1
    self.errors: list[BaseException] = []


own = _Own()


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child reports none of the parent's errors (``fork``)."""
  global _lock
  _lock = threading.Lock()
  deferred.clear()   # (emptied, never replaced: the fast hook holds it)
  _dropped.clear()
  own.slot = -1
  own.errors = []


def set_thread_slot(slot: int) -> None:
  """The calling thread's slot (``threads.thread_state``)."""
  own.slot = slot
  own.errors = []


def defer(exc: BaseException, slot: int = 0, inline: bool = False) -> None:
  """Keeps ``exc`` (a user's exception) for thread ``slot`` to raise.

  ``inline``: the callback may be running on the dispatching thread itself,
  inside its jax_effects call (the CPU client runs a computation it finds
  cheap inline when its inputs are ready): then that call raises it when it
  returns (:func:`raise_own`), as a failing Python call would. Only inside
  such a call: a computation the thread dispatched otherwise (an exported
  jax_effects function called outside ``jax_effects.jit``) leaves it for
  the thread's next call or barrier.
  """
  if inline and own.slot == slot and _dispatching is not None and (
      _dispatching()):
    own.errors.append(exc)
    return
  with _lock:
    _keep(exc, slot)


def _keep(exc: BaseException, slot: int) -> None:
  # (under the lock)
  kept = deferred.setdefault(slot, [])
  if len(kept) < MAX_KEPT_ERRORS:
    kept.append(exc)
  else:
    _dropped[slot] = _dropped.get(slot, 0) + 1


def has_deferred(slot: int) -> bool:
  return slot in deferred


def pop_deferred(slots=None) -> BaseException | None:
  """Removes every deferred error of ``slots`` (all if None); returns the
  report: the one error itself, or all of them together (:func:`group`).
  Each error is reported once: a later call finds nothing.
  """
  if not deferred:
    return None
  with _lock:
    slots = list(deferred) if slots is None else slots
    errors: list[BaseException] = []
    dropped = 0
    for slot in slots:
      errors.extend(deferred.pop(slot, ()))
      dropped += _dropped.pop(slot, 0)
  if not errors:
    return None
  if len(errors) == 1 and not dropped:
    return errors[0]
  return group(errors, dropped)


def raise_pending(slots=None) -> None:
  """Raises the report of ``slots`` (:func:`pop_deferred`), if any, holding
  no reference to it once it has left (see the module docstring)."""
  report = pop_deferred(slots)
  if report is not None:
    try:
      raise report
    finally:
      del report


def count(report: BaseException) -> int:
  """How many callback errors ``report`` stands for (dropped ones included)."""
  return (len(flat_errors(report))
          + getattr(report, "jax_effects_dropped", 0))


def group(errors: list[BaseException], dropped: int = 0) -> BaseException:
  """Several callback errors reported together.

  A ``BaseExceptionGroup`` (an ``ExceptionGroup`` when all are ``Exception`` s)
  on Python >= 3.11; before, the first error, with the others in its
  ``jax_effects_errors`` attribute (all of them, the first included).
  ``dropped``: errors beyond :data:`MAX_KEPT_ERRORS` that were only counted.
  """
  more = f" (and {dropped} more, not kept)" if dropped else ""
  message = (f"jax_effects: {len(errors)} host callbacks failed{more}; "
             "each is one of the exceptions below")
  try:
    if all(isinstance(e, jax.errors.JaxRuntimeError) for e in errors):
      # Errors of JAX's own callbacks (adopted): one JaxRuntimeError with
      # the first one's message, as jax.jit raises for a failed execution,
      # and a group of them all.
      report = JaxRuntimeErrorGroup(  # noqa: F821 - Python >= 3.11
          errors[0].args[0] if errors[0].args else message, errors)
    else:
      report = BaseExceptionGroup(message, errors)  # noqa: F821 - Python >= 3.11
  except NameError:
    report = errors[0]
  report.jax_effects_errors = tuple(errors)
  report.jax_effects_dropped = dropped
  return report


if sys.version_info >= (3, 11):
  class JaxRuntimeErrorGroup(ExceptionGroup,  # noqa: F821
                             jax.errors.JaxRuntimeError):
    """Several errors of JAX's own (adopted) callbacks reported together:
    an ``ExceptionGroup`` that is also a ``jax.errors.JaxRuntimeError``, so
    ``except RuntimeError`` catches it as it catches ``jax.jit``'s one
    error of a failed execution."""


def flat_errors(report: BaseException) -> list[BaseException]:
  """The errors of a report (:func:`group`'s, or a single one)."""
  errors = getattr(report, "jax_effects_errors", None)
  return list(errors) if errors is not None else [report]


def reraise(err: BaseException) -> None:
  """Raises ``err`` holding no reference to it once it has left (see the
  module docstring)."""
  try:
    raise err
  finally:
    del err   # (no cycle through this frame, see the module docstring)


def slot_busy(slot: int) -> bool:
  """Whether ``slot`` has errors not reported yet (``threads`` keeps it)."""
  return slot in deferred


# --- the thread's side: when a report is raised (``design/errors.md``) ------

def plain_jit_slot() -> int:
  """The dispatching thread's slot as seen by a callback under plain
  ``jax.jit`` (no carrier): the calling thread's when it is one Python
  started (the CPU client ran the computation inline, on the thread that
  dispatched it), 0 (unknown) on one of XLA's threads (a foreign thread,
  which ``threading`` sees as a dummy): nothing there says who dispatched
  (``design/errors.md``)."""
  if isinstance(threading.current_thread(), threading._DummyThread):
    return 0
  if own.slot < 0 and _thread_slot is not None:
    _thread_slot()   # (the thread's state is made: it sets own.slot)
  return own.slot if own.slot > 0 else 0


#: Makes the calling thread's token state (``threads.thread_state``, which
#: registers itself here): a plain ``jax.jit`` callback running inline on a
#: thread new to jax_effects files its error under that thread's slot.
_thread_slot = None
#: Whether the calling thread is inside one of its jax_effects calls
#: (``token_store.TokenStore.dispatching``, registered here).
_dispatching = None


def set_thread_state_maker(make, dispatching) -> None:
  global _thread_slot, _dispatching
  _thread_slot = make
  _dispatching = dispatching


def raise_deferred(state) -> None:
  """Raises the errors deferred by computations ``state``'s thread
  dispatched (its next call, before it dispatches anything).

  Waits first for the thread's dispatched computations (only when an error is
  pending), so the errors of a failed execution are all reported together.
  """
  if state.slot not in deferred:
    return
  state.settle()
  raise_pending((state.slot,))


def dispatch_failed(err: BaseException) -> None:
  """Raises ``err``, raised by the dispatch in progress on this thread.

  Errors of callbacks that ran inline before it (in :data:`own`) are
  deferred to the thread's next call or barrier, which raise them before
  dispatching anything: left for :func:`raise_own`, the next call would
  raise them after running (its result discarded for an earlier call's
  error).
  """
  try:
    move_own_errors()
    reraise(err)
  finally:
    del err   # (no reference cycle through this frame: reraise)


def enter_call() -> list:
  """A call made inside this thread's call in progress (from one of its
  host callbacks): its own inline errors are its own; returns the outer
  call's, for :func:`leave_call`."""
  saved, own.errors = own.errors, []
  return saved


def leave_call(saved: list) -> None:
  own.errors = saved + own.errors


def move_own_errors() -> None:
  """Moves the errors of callbacks that ran inline in the call in progress
  to the thread's deferred errors: reported by whoever reports next."""
  errors, own.errors = own.errors, []
  if errors:
    with _lock:
      for exc in errors:
        _keep(exc, own.slot)


def raise_own(state, token) -> None:
  """Raises the errors of the call that just returned (callbacks that ran
  inline), with every other error of the thread pending once that call's
  computation has completed: one report."""
  errors, own.errors = own.errors, []
  state.settle()
  rest = pop_deferred((state.slot,))
  errors = errors + (flat_errors(rest) if rest is not None else [])
  report = errors[0] if len(errors) == 1 else group(errors)
  del rest, errors
  try:
    raise report
  finally:
    del report   # (no reference cycle through this frame: raise_pending)
