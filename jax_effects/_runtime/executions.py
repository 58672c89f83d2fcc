"""When an execution fails: learnt from its own token, and what it held freed.

What the host kept for an execution that failed as a whole
(``host_jobs``' jobs and pieces, ``bars``' open bars) is freed by
:func:`failed`, called by whoever learns of the failure from its own token
or dispatch, never on a clock: its dispatch, the thread's next dispatch or
barrier, or the watcher (:func:`watch`), a daemon thread that follows
computations whose first device may wait inside them for a job.
``design/errors.md``, "Executions that fail as a whole".

Its part in the token calling convention: an execution is named by its
slot and, per chain, its sequence number (``token_value``).
"""
from __future__ import annotations

import threading

import jax

from jax_effects._runtime import bars as _bars
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import host_jobs as _host_jobs


def failed(slot: int, chains: dict, ended: bool = True) -> None:
  """The execution of ``slot`` on ``chains`` (chain -> sequence number)
  failed: free what the host kept for it (idempotent). ``ended``: on every
  device (else its later effects are skipped until ``host_jobs.retire``).
  """
  if not chains:
    return
  _host_jobs.cancel(slot, chains, ended)
  _bars.close_for(slot, tuple(chains))


def slot_freed(slot: int) -> None:
  """``slot`` is freed (``threads.sweep``): drop what is kept under it."""
  _host_jobs.forget(slot)
  _bars.close_for(slot)


# --- the watcher -----------------------------------------------------------

_lock = threading.Condition()
_watched: list = []   # [_Watch]
_thread: threading.Thread | None = None
#: Set by :func:`stop` while it ends the watcher thread.
_stopping = False
#: Seconds between two looks at the computations watched (a look is an
#: ``is_ready`` per device); the first looks come sooner.
_POLL_S = 0.01


class _Watch:
  __slots__ = ("shards", "on_end", "early")

  def __init__(self, shards, on_end, early):
    self.shards = shards
    self.on_end = on_end
    self.early = early


def watch(token, on_end, early: bool = False) -> None:
  """Calls ``on_end(failed, running)`` once the computation that returns
  ``token`` has ended on every device, from the watcher thread (or
  :func:`settle`); with ``early``, as soon as one device's part failed."""
  global _thread
  if not isinstance(token, jax.Array):   # (a NumPy initial token: ended)
    on_end(False, False)
    return
  shards = [s.data for s in token.addressable_shards]
  with _lock:
    _watched.append(_Watch(shards, on_end, early))
    if _thread is None and not _stopping:
      _thread = threading.Thread(target=_run, name="jax_effects-watcher",
                                 daemon=True)
      try:
        _thread.start()
      except RuntimeError:
        # Python 3.12+ starts no thread once the interpreter is shutting
        # down (a dispatch from an exit handler): what is watched stays for
        # a barrier's settle (``exit.report_late`` waits for everything).
        _thread = None
    _lock.notify()


def _state(item: _Watch):
  """``(failed, running)`` of ``item``'s devices; None while it runs (and
  did not fail, or fails but not ``early``)."""
  running = failed = False
  for shard in item.shards:
    try:
      if not shard.is_ready():
        running = True
        continue
      shard.block_until_ready()
    except Exception:  # noqa: BLE001 - that device's part failed
      failed = True
  return None if running and not (failed and item.early) else (failed, running)


def _look(items) -> bool:
  """Calls ``on_end`` of each of ``items`` that has ended, once (whoever
  takes it out of the watched list first); whether any had."""
  any_done = False
  for item in items:
    state = _state(item)
    if state is None:
      continue
    with _lock:
      try:
        _watched.remove(item)   # (identity: _Watch defines no __eq__)
      except ValueError:
        continue   # (taken by another look)
    any_done = True
    try:
      item.on_end(*state)
    except Exception:  # noqa: BLE001 - a bug of ours: keep watching
      import traceback
      traceback.print_exc()
  return any_done


def _run() -> None:
  delay = 0.0005
  while True:
    with _lock:
      while not _watched and not _stopping:
        delay = 0.0005
        _lock.wait()
      if _stopping:
        return
      items = list(_watched)
    if _look(items):
      delay = 0.0005
    with _lock:
      if _watched and not _stopping:
        _lock.wait(delay)
        delay = min(delay * 2, _POLL_S)


def stop() -> None:
  """Ends the watcher thread and joins it (interpreter exit): a daemon
  thread inside jaxlib when the interpreter finalizes aborts the process
  ("FATAL: exception not rethrown"). A later :func:`watch` starts one."""
  global _thread, _stopping
  with _lock:
    thread = _thread
    if thread is None or thread is threading.current_thread():
      return
    _stopping = True
    _lock.notify_all()
  try:
    thread.join()
  finally:
    with _lock:
      _stopping = False
      if _thread is thread:
        _thread = None


def settle() -> None:
  """Acts now on every watched computation that has ended (a barrier:
  what they kept is freed before it returns)."""
  with _lock:
    items = list(_watched)
  _look(items)


def watch_failure(slot: int, chains: dict, token) -> None:
  """Follows a computation over several devices of ``slot`` on ``chains``
  where a call site assembles operands on the host: :func:`failed` as soon
  as one device's part failed, ``host_jobs.retire`` once all ended."""
  def on_end(failed_: bool, running: bool) -> None:
    if failed_:
      # Never "ended" here: XLA may mark every device's results failed
      # while a device still runs its part (seen on JAX 0.8-0.10 under
      # load); its lanes stay as tombstones (host_jobs).
      failed(slot, chains, ended=False)
    else:   # (ended: a job of it that failed no longer needs its lane)
      _host_jobs.retire(slot, chains)

  watch(token, on_end, early=True)


def watched() -> int:
  """Computations followed now that have not ended (for tests)."""
  with _lock:
    items = list(_watched)
  return sum(1 for item in items if _state(item) is None)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  global _lock, _thread, _stopping
  _lock = threading.Condition()
  _watched.clear()
  _thread = None
  _stopping = False
