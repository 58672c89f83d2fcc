"""IPython and Jupyter: a cell's effects appear under that cell.

With asynchronous dispatch a cell can end before its computations reach
their ``print``s, whose lines would appear under the next cell. Under
IPython (imported and a shell active; never imported here) a
``post_run_cell`` callback waits for the effects the cell's thread
dispatched, at most :data:`CELL_WAIT_S` seconds, then warns. Errors stay
for the thread's next call or barrier. Registered once per shell, at
import and at a thread's first use of jax_effects.
"""
from __future__ import annotations

import sys
import warnings
import weakref

from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import threads as _threads

#: How long (seconds) the end of a cell waits for its effects.
CELL_WAIT_S = 10.0

_shells: "weakref.WeakSet" = weakref.WeakSet()
_plain_shells: list = []   # (a shell that cannot be weakly referenced)


def after_cell(*_result) -> None:
  """The ``post_run_cell`` callback (IPython passes the cell's result)."""
  if not _barrier.wait_for_thread_until(CELL_WAIT_S):
    warnings.warn(
        f"jax_effects: this cell's effects were still running after "
        f"{CELL_WAIT_S:g} s (jax_effects._runtime.notebook.CELL_WAIT_S); "
        "their output will appear later, under another cell. Call "
        "jax_effects.effects_barrier() in the cell to wait for them.",
        RuntimeWarning, stacklevel=1)


def install() -> bool:
  """Registers :func:`after_cell` with the active IPython shell, once;
  True if it registered now."""
  get = getattr(sys.modules.get("IPython"), "get_ipython", None)
  if get is None:
    return False
  try:
    shell = get()
  except Exception:  # noqa: BLE001 - not ours to break
    return False
  events = getattr(shell, "events", None)
  if events is None:
    return False
  try:
    if shell in _shells:
      return False
    _shells.add(shell)
  except TypeError:
    if any(s is shell for s in _plain_shells):
      return False
    _plain_shells.append(shell)
  events.register("post_run_cell", after_cell)
  return True


install()
_threads.on_new_thread.append(install)
