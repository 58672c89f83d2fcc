"""Errors of host callbacks: each reported once, to its dispatching thread.

The contract is ``design/errors.md``; this module owns its state (every
thread's deferred errors, and the inline ones of its call in progress) and
is its only writer. A host function *defers* a callback's error here
(:func:`defer`) under the dispatching thread's slot; that thread raises it
once: the call itself (:func:`raise_own`), else its next call
(:func:`raise_deferred`) or barrier. No frame a report passes through
keeps it in a local (a cycle only the garbage collector frees).

Its part in the token calling convention: the slot in a carrier names the
thread an error is filed for; the ``FAILED`` bit (``token_value``) is the
rule "nothing after a raise" inside one execution.
"""
from __future__ import annotations

import sys
import threading

import jax

from jax_effects._runtime import fork as _fork
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import token_value as _token_value

FAILED = _token_value.FAILED
#: At most this many deferred errors are kept per thread between two reports;
#: later ones are counted, and the count is reported with them.
MAX_KEPT_ERRORS = 64

_lock = threading.Lock()
# Slot of the dispatching thread (0: unknown) -> its unreported errors,
# oldest first; _dropped counts those past MAX_KEPT_ERRORS. Read without the
# lock on every dispatch (empty: no deferred error anywhere).
deferred: dict[int, list[BaseException]] = {}
_dropped: dict[int, int] = {}


class _Own(threading.local):
  """The calling thread's slot and the errors of callbacks that ran inline
  in its call in progress (:func:`raise_own`)."""

  def __init__(self):
    self.slot = -1
    self.errors: list[BaseException] = []


own = _Own()


@_fork.reset_in_child
def _reset_after_fork() -> None:
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
  ``inline``: the callback may run inline in the dispatching thread's
  jax_effects call, which then raises it (:func:`raise_own`)."""
  if inline and own.slot == slot and _dispatching():
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
  """Whether ``slot`` has errors not reported yet."""
  return slot in deferred


def pop_deferred(slots=None) -> BaseException | None:
  """Removes every deferred error of ``slots`` (all if None); returns the
  report: the one error, or all of them (:func:`group`); None if none."""
  if not deferred:
    return None
  with _lock:
    slots = list(deferred) if slots is None else slots
    errors = [exc for slot in slots for exc in deferred.pop(slot, ())]
    dropped = sum(_dropped.pop(slot, 0) for slot in slots)
  if not errors:
    return None
  return errors[0] if len(errors) == 1 and not dropped else group(errors, dropped)


def count(report: BaseException) -> int:
  """How many callback errors ``report`` stands for (dropped ones included)."""
  return len(flat_errors(report)) + getattr(report, "jax_effects_dropped", 0)


def group(errors: list[BaseException], dropped: int = 0) -> BaseException:
  """Several callback errors reported together: a ``BaseExceptionGroup``
  on Python >= 3.11, else the first error; either way all of them in its
  ``jax_effects_errors``. ``dropped``: errors only counted."""
  more = f" (and {dropped} more, not kept)" if dropped else ""
  message = (f"jax_effects: {len(errors)} host callbacks failed{more}; "
             "each is one of the exceptions below")
  try:
    if all(isinstance(e, jax.errors.JaxRuntimeError) for e in errors):
      # (JAX's own callbacks, adopted: a JaxRuntimeError, as jax.jit's)
      report = JaxRuntimeErrorGroup(  # noqa: F821 - Python >= 3.11
          errors[0].args[0] if errors[0].args else message, errors)
    else:
      report = BaseExceptionGroup(message, errors)  # noqa: F821 - 3.11
  except NameError:
    report = errors[0]
  report.jax_effects_errors = tuple(errors)
  report.jax_effects_dropped = dropped
  return report


if sys.version_info >= (3, 11):
  class JaxRuntimeErrorGroup(ExceptionGroup,  # noqa: F821
                             jax.errors.JaxRuntimeError):
    """Errors of JAX's own (adopted) callbacks: also a
    ``jax.errors.JaxRuntimeError``, as ``jax.jit``'s one error is."""


def flat_errors(report: BaseException) -> list[BaseException]:
  """The errors of a report (:func:`group`'s, or a single one)."""
  errors = getattr(report, "jax_effects_errors", None)
  return list(errors) if errors is not None else [report]


def reraise(err: BaseException) -> None:
  """Raises ``err`` holding no reference to it once it has left."""
  try:
    raise err
  finally:
    del err   # (no reference cycle through this frame)


# --- the thread's side: when a report is raised (``design/errors.md``) ------

def plain_jit_slot() -> int:
  """The dispatching thread's slot as seen by a callback under plain
  ``jax.jit`` (no carrier): the calling thread's (the computation ran
  inline), 0 (unknown) on one of XLA's threads (``design/errors.md``)."""
  if not _placement.python_thread():
    return 0
  if own.slot < 0:
    _thread_slot()   # (the thread's state is made: it sets own.slot)
  return own.slot if own.slot > 0 else 0


# Registered by ``threads`` (no import cycle): makes the calling thread's
# state, and whether that thread is inside one of its jax_effects calls.
_thread_slot = None
_dispatching = None


def set_thread_state_maker(make, dispatching) -> None:
  global _thread_slot, _dispatching
  _thread_slot = make
  _dispatching = dispatching


def raise_deferred(state) -> None:
  """Raises the errors deferred for ``state``'s thread (its next call),
  once its computations have ended: a failed execution's all together."""
  if state.slot not in deferred:
    return
  state.settle()
  report = pop_deferred((state.slot,))
  if report is not None:
    try:
      raise report
    finally:
      del report   # (no reference cycle through this frame)


def dispatch_failed(err: BaseException) -> None:
  """Raises ``err``, raised by the dispatch in progress on this thread;
  the errors of callbacks that ran inline before it go to the thread's
  next call or barrier (which raise them before dispatching)."""
  try:
    move_own_errors()
    reraise(err)
  finally:
    del err   # (no reference cycle through this frame)


def enter_call() -> list:
  """A call made from a host callback of this thread's call in progress:
  sets the outer call's inline errors aside, for :func:`leave_call`."""
  saved, own.errors = own.errors, []
  return saved


def leave_call(saved: list) -> None:
  own.errors = saved + own.errors


def move_own_errors() -> None:
  """Moves the inline errors of the call in progress to the thread's
  deferred errors."""
  errors, own.errors = own.errors, []
  if errors:
    with _lock:
      for exc in errors:
        _keep(exc, own.slot)


def raise_own(state, token) -> None:
  """Raises the inline errors of the call that just returned, with the
  thread's others pending once its computation ended: one report."""
  errors, own.errors = own.errors, []
  state.settle()
  rest = pop_deferred((state.slot,))
  errors = errors + (flat_errors(rest) if rest is not None else [])
  report = errors[0] if len(errors) == 1 else group(errors)
  del rest, errors
  try:
    raise report
  finally:
    del report   # (no reference cycle through this frame)
