"""Effects that wait on the host for an earlier effect of their thread.

An effect whose operands are assembled on the host from every device's part
(``_primitives.host_assembly``) can run only once every device's call has left its
part. The first device's call must not wait for them: XLA's CPU runtime
runs each device's program in its own, data-driven order, so another device
may reach one of the program's collectives before its part of the effect,
and wait there for the first device, which would wait for it: a deadlock
(seen with a few dozen big prints and a matrix product in one program;
``tests/frontends/test_summarized_printing.py``). So when a part is missing
the first device's call leaves the effect here, as a *job* of the dispatching
thread's slot, and returns; the call that brings the last part runs it.

While a slot has jobs, every later threaded effect of that thread becomes a
job behind them (``_primitives.host_functions`` checks :data:`queues`, empty in the common case:
one dict test per effect), so program order holds across the thread's
chains and executions: jobs run one at a time per slot, in order, on the
thread of the device call that made the first one ready. An effect with
results cannot be left for later (the program needs them): its call waits
here until the slot's jobs have run. ``effects_barrier`` (and a mode
switch, and interpreter exit) waits for the jobs too.

A job that fails defers its error as any callback does (reported by the
thread's next call or barrier); the jobs queued behind it in the same
stretch are skipped, as the later effects of a chain are after a failure.

Part in the token calling convention: none (the carrier passes through a
call whose effect is left here unchanged).
"""
from __future__ import annotations

import collections
import sys
import threading
import time
import weakref
from typing import Callable

from jax_effects._runtime import fork as _fork

__all__ = ["queues", "submit", "drain", "wait_idle", "Job"]

#: One lock for the jobs and the parts they wait for (``_primitives.host_assembly``).
lock = threading.Condition()

#: Slot -> its jobs, oldest first; a slot is present from its first job until
#: its last has finished running. Read without the lock by every threaded host
#: function (an empty dict: nothing is waiting anywhere).
queues: dict[int, collections.deque] = {}

# Slots whose jobs a thread is running now (one thread per slot), and slots
# whose current stretch of jobs had a failure (the rest are skipped).
_draining: set[int] = set()
_failed: set[int] = set()


class _Local(threading.local):
  slot = None   # the slot whose jobs this thread is running


local = _Local()


class Job:
  """``run()`` (returns True if the effect failed) once ``ready()``."""
  __slots__ = ("run", "ready")

  def __init__(self, run: Callable[[], bool],
               ready: Callable[[], bool] = lambda: True):
    self.run = run
    self.ready = ready


def waits(slot: int) -> bool:
  """Whether an effect of ``slot`` must go behind jobs (not when this thread
  is the one running them)."""
  return slot in queues and local.slot != slot


def submit(slot: int, job: Job) -> None:
  """Queues ``job`` behind ``slot``'s jobs and runs what is ready."""
  with lock:
    queues.setdefault(slot, collections.deque()).append(job)
  drain(slot)


def drain(slot: int) -> None:
  """Runs ``slot``'s ready jobs in order (unless another thread is at it)."""
  if slot not in queues:
    return
  while True:
    with lock:
      q = queues.get(slot)
      if q is None or slot in _draining:
        return
      if not q:
        del queues[slot]
        _failed.discard(slot)
        lock.notify_all()
        return
      job = q[0]
      if not job.ready():
        return
      q.popleft()
      _draining.add(slot)
      skip = slot in _failed
    prev, local.slot = local.slot, slot
    failed = False
    try:
      if not skip:
        failed = bool(job.run())
    finally:
      local.slot = prev
      with lock:
        _draining.discard(slot)
        if failed:
          _failed.add(slot)


#: Objects with ``forget(slot)`` (``host_assembly``'s meeting places),
#: told when a slot's waiting jobs are given up (:func:`wait_idle`).
holders: "weakref.WeakSet" = weakref.WeakSet()


def wait_idle(slots=None, patience: float | None = None) -> None:
  """Blocks until ``slots`` (every slot if None) have no jobs.

  ``patience`` (a barrier, once its computations have completed, so every
  device's call has been made): after that many seconds, jobs still waiting
  for a part are given up, with a message on stderr, and the parts of their
  slots forgotten; a part can then only be missing because a device's
  computation failed before making its call.
  """
  deadline = None if patience is None else time.monotonic() + patience
  with lock:
    while True:
      pending = [s for s in (list(queues) if slots is None else slots)
                 if s in queues]
      if not pending:
        return
      if deadline is None:
        lock.wait()
        continue
      left = deadline - time.monotonic()
      if left > 0:
        lock.wait(left)
        continue
      for s in pending:
        if s not in _draining:
          _give_up(s)
      deadline = time.monotonic() + 1.0   # (one being run: wait for it)


def _give_up(slot: int) -> None:
  # (under the lock)
  n = len(queues.pop(slot))
  _failed.discard(slot)
  for holder in list(holders):
    holder.forget(slot)
  lock.notify_all()
  print(f"jax_effects: {n} effect(s) of a thread waited for parts of their "
        f"operands that never came (a device's computation failed before "
        f"reaching them?); they were given up", file=sys.stderr)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child has none of the parent's jobs or parts (their
  computations ran in the parent), and no lock a parent's thread held."""
  global lock
  lock = threading.Condition()
  queues.clear()
  _draining.clear()
  _failed.clear()
  for holder in list(holders):
    holder.parts.clear()
