"""Errors of host callbacks: each reported once, to the thread that dispatched it.

The contract is ``design/errors.md``. A callback error never fails an XLA
computation (in a multi-device one the other devices would wait forever in
the next collective; a failed computation's token would fail every later
computation given it; under plain ``jax.jit`` no hook of ours could catch
XLA's error). Instead the host function (``_primitives.host_functions``) *defers* the user's
exception here, under the slot of the thread that dispatched the computation
(the value of the carrier it received, :data:`SLOT_MASK`), and returns zeros
with the carrier's :data:`FAILED` bit set, so the later effects of its chain
in that execution are skipped, as nothing runs after a ``raise`` in Python.
The pass masks the bit off the returned token (``_pass.token_pass``).

That thread raises what is deferred for it, once (``raising``): the
call itself when the callback ran inline in it, else its next call before it
dispatches anything, or its barrier. Several errors pending at once are one
report (:func:`group`); at most :data:`MAX_KEPT_ERRORS` are kept per thread
between reports, the rest counted. A report is raised so that nothing of
the library keeps it alive once the caller drops it (:func:`raise_pending`,
:func:`reraise`): no frame it passes through holds it in a local, which
would make a reference cycle (exception -> traceback -> frame -> exception)
that only the garbage collector frees.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable

import jax
import numpy as np

from jax_effects._runtime import fork as _fork

#: The dtype of runtime tokens and carriers: a token's value is the slot of
#: the thread that dispatched it (``threads.ThreadTokens.slot``), with
#: :data:`FAILED` set inside a computation after a callback failed.
TOKEN_DTYPE = np.int32
#: Carrier bit: an earlier effect of this chain in this execution failed, so
#: the later ones are skipped (set by the host function that failed; masked
#: off before the computation returns its token, see ``_pass.token_pass``).
FAILED = np.int32(1 << 30)
SLOT_MASK = np.int32((1 << 30) - 1)
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


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child reports none of the parent's errors (``fork``)."""
  global _lock
  _lock = threading.Lock()
  deferred.clear()   # (emptied, never replaced: the fast hook holds it)
  _dropped.clear()


def defer(exc: BaseException, slot: int = 0) -> None:
  """Keeps ``exc`` (a user's exception) for thread ``slot`` to raise."""
  with _lock:
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


def reraise(err: BaseException, reset: Callable[[], None] | None) -> None:
  """Raises ``err``, an error raised by dispatching a computation.

  ``reset`` (the dispatching thread's token reset) is called first for an
  XLA execution failure: a failed computation's tokens carry its error and
  must not be handed to the next computation. (A callback's error never
  fails a computation, see the module docstring.) Any other error (a tracing
  error, say) resets nothing.
  """
  if reset is not None and isinstance(err, jax.errors.JaxRuntimeError):
    reset()
  try:
    raise err
  finally:
    del err   # (no cycle through this frame, see the module docstring)
