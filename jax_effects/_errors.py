"""Errors of host callbacks: recorded once, raised once, to the right caller.

A user's exception raised in a host callback cannot travel through XLA as
itself. The host function records it here (:func:`record_error`, which
returns the :class:`CallbackFailed` marker it raises into XLA instead); when
the failed execution's error reaches the dispatching call (or
``effects_barrier``), :func:`reraise` finds the marker's id in XLA's message
and raises the original exception object, once, removing it from the
registry.

In a multi-device computation a callback must not fail its device's part of
the program (the other devices would wait forever in the next collective):
its error is *deferred* (:func:`defer_error`) under the slot of the thread
that dispatched the computation, read from the carrier the callback
received, which holds that thread's runtime-token value
(``_runtime_tokens``). That thread's call (or its next call or barrier)
raises it (:func:`raise_deferred`, :func:`pop_deferred`). See
``design/errors.md``.
"""
from __future__ import annotations

import itertools
import re
import threading
from typing import Callable

import jax

_error_ids = itertools.count(1)
_errors_lock = threading.Lock()
_errors: dict[int, BaseException] = {}
_MARK = "jax_effects callback error #"
_MARK_RE = re.compile(re.escape(_MARK) + r"(\d+)")


class CallbackFailed(Exception):
  """Raised into XLA in place of a user's exception; carries its id."""


def record_error(exc: BaseException) -> CallbackFailed:
  """Stores a user callback's exception; returns the marker to raise to XLA."""
  n = next(_error_ids)
  with _errors_lock:
    _errors[n] = exc
  return CallbackFailed(f"{_MARK}{n}: {type(exc).__name__}: {exc}")


def original_error(err: BaseException) -> BaseException | None:
  """The user exception behind an XLA error, removed so it is reported once."""
  ids = _MARK_RE.findall(str(err))
  if not ids:
    return None
  found = None
  with _errors_lock:
    for n in ids:   # one XLA error may mention several; report the first
      exc = _errors.pop(int(n), None)
      found = found or exc
  return found


# Errors of callbacks in multi-device computations. Raising into XLA there
# would leave the other devices waiting forever in the next collective (XLA's
# CPU runtime then aborts the process), so the host function returns normally
# and the error waits here, under the slot of the thread that dispatched the
# computation (read from the carrier the callback received; 0 if unknown, as
# for a chain that did not start from a runtime token). The dispatching
# thread raises it when its call returns (raise_deferred), or its next
# effects_barrier does. Read without the lock on every dispatch (empty: no
# deferred error anywhere).
deferred: dict[int, list[int]] = {}


def defer_error(failed: CallbackFailed, slot: int = 0) -> None:
  """Keeps the error behind ``failed`` for thread ``slot`` to raise."""
  with _errors_lock:
    deferred.setdefault(slot, []).extend(
        int(n) for n in _MARK_RE.findall(str(failed)))


def pop_deferred(slots=None) -> BaseException | None:
  """Removes and returns the oldest deferred error of ``slots`` (all if None).

  One error per call: each reaches the user once, as itself. If more are
  pending for those slots, a note on the returned one says so (the next call
  or barrier raises the next one).
  """
  if not deferred:
    return None
  exc = None
  with _errors_lock:
    slots = list(deferred) if slots is None else slots
    for slot in slots:
      ids = deferred.get(slot, [])
      while ids and exc is None:
        exc = _errors.pop(ids.pop(0), None)
      if not ids:
        deferred.pop(slot, None)
      if exc is not None:
        break
    left = sum(len(deferred.get(s, ())) for s in slots)
  if exc is not None and left and hasattr(exc, "add_note"):
    exc.add_note(
        f"jax_effects: {left} more callback error(s) of multi-device "
        "computations are pending; the next effects_barrier() (or call) "
        "raises the next one")
  return exc


def raise_deferred(slot: int) -> None:
  """Raises an error deferred by a computation thread ``slot`` dispatched."""
  exc = pop_deferred((slot,))
  if exc is not None:
    raise exc.with_traceback(exc.__traceback__)


def is_execution_error(err: BaseException) -> bool:
  """Whether ``err``, raised by running an executable, is an execution failure.

  An XLA runtime error, or a callback's error surfacing as another type: when
  the CPU client runs a computation inline, a failed host callback reaches the
  caller as ``ValueError("INTERNAL: CpuCallback error ...")``.
  """
  return isinstance(err, jax.errors.JaxRuntimeError) or _MARK in str(err)


def reraise(err: BaseException, reset: Callable[[], None] | None) -> None:
  """Raises the user's exception behind ``err`` (or ``err`` itself).

  ``reset`` (the dispatching thread's token reset) is called first: a failed
  computation's tokens carry its error and must not be handed to the next
  computation. An error that is not an execution failure
  (:func:`is_execution_error`: a tracing error, say) is raised unchanged and
  resets nothing.
  """
  if not is_execution_error(err):
    raise err
  orig = original_error(err)
  if reset is not None:
    reset()
  if orig is None:
    raise err
  raise orig.with_traceback(orig.__traceback__) from None
