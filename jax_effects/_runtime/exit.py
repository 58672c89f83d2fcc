"""Interpreter exit: every thread's effects are waited for, errors reported.

At exit (``atexit``) the library waits for the effects of every thread,
exited ones included (``barrier.effects_barrier(all_threads=True)``); the
errors not reported yet are printed to stderr with their traceback, after a
line that counts them, and the exit status becomes 1, as for an uncaught
exception (``design/errors.md``).

``atexit`` runs handlers in the reverse order of registration, so handlers
registered before jax_effects was imported run after this one, and nothing
of Python runs after them while XLA's threads can still run callbacks. A
computation such a late handler dispatches therefore reports its errors
itself: once this handler has run (``token_store.after_exit_handler``), every
``jax_effects`` dispatch takes the general call path, which, once the
computation is launched, waits for everything dispatched and reports like
this handler (:func:`report_late`): printed, exit status 1.

Once everything is awaited, the watcher thread is ended and joined
(``executions.stop``), here and after each late dispatch: a daemon thread
inside jaxlib when the interpreter finalizes aborts the process.
"""
from __future__ import annotations

import atexit
import os
import sys
import traceback

from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import token_store as _token_store

#: Reports collected before giving up on a barrier that keeps raising.
_MAX_REPORTS = 16


def _unreported() -> list[BaseException]:
  """Waits for every thread's effects; returns every report of callback
  errors not raised yet (an XLA failure is its call's: not reported here,
  as ``jax.jit`` exits 0 after one, ``design/errors.md``)."""
  reports = []
  while len(reports) < _MAX_REPORTS:
    try:
      _barrier.effects_barrier(all_threads=True)
      break
    except BaseException as exc:  # noqa: BLE001 - reported here, as uncaught
      reports.append(exc)
  return reports


def _report_and_exit(reports: list[BaseException]) -> None:
  """Prints ``reports`` to stderr, as uncaught exceptions, after a line that
  counts the failures; ends the process with status 1 (``os._exit``: at exit
  nothing else can change the status), stdout and stderr flushed."""
  try:
    sys.stdout.flush()
  except Exception:  # noqa: BLE001 - a broken stdout
    pass
  try:
    n = sum(_errors.count(r) for r in reports)
    what = ("a host callback failed and its error was" if n == 1 else
            f"{n} host callbacks failed and their errors were")
    sys.stderr.write(f"jax_effects: {what} not reported before interpreter "
                     "exit:\n")
    for report in reports:
      traceback.print_exception(report, file=sys.stderr)
    sys.stderr.flush()
  except Exception:  # noqa: BLE001 - a broken stderr, or a hostile __str__
    pass
  os._exit(1)


@atexit.register
def _wait_at_exit() -> None:
  """Interpreter exit: waits for every thread's effects; the errors not
  reported yet are printed to stderr and the exit status becomes 1, as for
  an uncaught exception. Later dispatches report their own
  (:func:`report_late`). In a child forked after JAX's backend started
  nothing of the parent's is waited for or reported (``fork``)."""
  if _fork.forked_after_backend:
    return
  reports = _unreported()
  if reports:
    _report_and_exit(reports)
  _executions.stop()   # (none of ours may be inside jaxlib at finalization)
  _token_store.after_exit_handler = True
  _threads.mode_changed(all_threads=True)   # (later dispatches: general path)


def report_late(state: _threads.ThreadTokens) -> None:
  """After this module's exit handler, called by every dispatch once its
  computation is launched: waits for everything dispatched and, if a
  callback failed (this call's included), reports like the exit handler and
  ends the process with status 1. No later point exists where the errors
  could be raised, and an exception escaping an exit handler would leave
  the status 0."""
  del state
  _errors.move_own_errors()
  reports = _unreported()
  if reports:
    _report_and_exit(reports)
  _executions.stop()   # (the one this dispatch may have started)
