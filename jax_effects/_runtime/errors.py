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
between reports, the rest counted.
"""
from __future__ import annotations

import threading
from typing import Callable

import jax
import numpy as np

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
# on one of XLA's threads). Read without the lock on every dispatch (empty:
# no deferred error anywhere).
deferred: dict[int, list[BaseException]] = {}
_dropped: dict[int, int] = {}


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
    report = BaseExceptionGroup(message, errors)  # noqa: F821 - Python >= 3.11
  except NameError:
    report = errors[0]
  report.jax_effects_errors = tuple(errors)
  report.jax_effects_dropped = dropped
  return report


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
  raise err
