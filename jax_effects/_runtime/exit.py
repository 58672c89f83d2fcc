"""Interpreter exit: every thread's effects are waited for, errors reported.

At exit (``atexit``) the library waits for the effects of every thread,
exited ones included (``barrier.effects_barrier(all_threads=True)``); an
error not reported yet is printed to stderr with its traceback and the exit
status becomes 1, as for an uncaught exception (``design/errors.md``).
"""
from __future__ import annotations

import atexit
import os
import sys
import traceback

from jax_effects._runtime import barrier as _barrier


@atexit.register
def _wait_at_exit() -> None:
  """Interpreter exit: waits for every thread's effects; an error not reported
  yet is printed to stderr with its traceback and the exit status becomes 1,
  as for an uncaught exception."""
  try:
    _barrier.effects_barrier(all_threads=True)
  except BaseException as exc:  # noqa: BLE001 - reported here, as uncaught
    try:
      sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a broken stdout
      pass
    try:
      sys.stderr.write("jax_effects: a host callback failed and its error was "
                       "not reported before interpreter exit:\n")
      traceback.print_exception(exc, file=sys.stderr)
      sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a broken stderr, or a hostile __str__
      pass
    os._exit(1)
