"""Interpreter exit: every thread's effects are waited for, errors reported.

At exit (``atexit``) every thread's effects are waited for; the errors not
reported yet are printed to stderr and the exit status becomes 1, as for an
uncaught exception. A dispatch from an exit handler that runs after this
one reports its own (:func:`report_late`). The watcher thread is then
ended (``executions.stop``). ``design/errors.md``, "Interpreter exit".
"""
from __future__ import annotations

import atexit
import contextlib
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


def _wait_and_report() -> None:
  """Waits for every thread's effects; if callback errors were not raised
  yet, reports them (:func:`_report_and_exit`). Then ends the watcher
  thread (none of ours may be inside jaxlib at finalization; after the
  exit handler, the one a dispatch may have started)."""
  reports = []
  while len(reports) < _MAX_REPORTS:
    try:
      _barrier.effects_barrier(all_threads=True)
      break
    except BaseException as exc:  # noqa: BLE001 - reported here, as uncaught
      reports.append(exc)
  if reports:
    _report_and_exit(reports)
  _executions.stop()


def _report_and_exit(reports: list[BaseException]) -> None:
  """Prints ``reports`` to stderr after a line that counts the failures;
  ends the process with status 1 (``os._exit``: nothing else can, at exit).
  """
  with contextlib.suppress(Exception):  # (a broken stdout)
    sys.stdout.flush()
  # (a broken stderr, or a hostile __str__: nothing more to do)
  with contextlib.suppress(Exception):
    n = sum(_errors.count(r) for r in reports)
    what = ("a host callback failed and its error was" if n == 1 else
            f"{n} host callbacks failed and their errors were")
    sys.stderr.write(f"jax_effects: {what} not reported before interpreter "
                     "exit:\n")
    for report in reports:
      traceback.print_exception(report, file=sys.stderr)
    sys.stderr.flush()
  os._exit(1)


@atexit.register
def _wait_at_exit() -> None:
  """The exit handler (module docstring); nothing in a child forked after
  JAX's backend started."""
  if _fork.forked_after_backend:
    return
  _wait_and_report()
  _token_store.after_exit_handler = True
  _threads.mode_changed(all_threads=True)   # (later dispatches: general path)


def report_late(state: _threads.ThreadTokens) -> None:
  """After the exit handler, called by every dispatch once its computation
  is launched: waits for everything and, if a callback failed, reports like
  the exit handler (no later point exists to raise the errors)."""
  del state
  _errors.move_own_errors()
  _wait_and_report()
