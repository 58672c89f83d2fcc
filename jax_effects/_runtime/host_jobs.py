"""Effects left to run on the host, in each chain's order, and the pieces they wait for.

An effect whose operands are assembled on the host from every device's part
(``_primitives.host_assembly``) can run only once every device's call has
left its part (a *piece*) at the call site (its :class:`Pieces`). The first
device's call must not wait for them: XLA's CPU runtime runs each device's
program in its own, data-driven order, so another device may reach one of
the program's collectives before its part of the effect, and wait there for
the first device, which would wait for it: a deadlock
(``tests/frontends/test_summarized_printing.py``). So when a piece is
missing the first device's call leaves the effect here, as a *job*, and
returns; the call that brings the last piece runs it.

The jobs of one thread's chain form *lanes*, one per execution (named by
its identity: the slot and sequence number its carriers hold,
``token_value``), ordered by sequence number. Only the first lane runs; its
jobs run in order, each once it is ready. While a chain has lanes, a later
effect of it waits too: one of an execution that has a lane (or comes
after every lane) queues in its own lane, and one with results, which the
program needs now, waits until its turn (:func:`wait_turn`); an effect of
an execution earlier than every lane runs at once. Pieces are matched by
execution identity too, never first in first out: a print shows its own
execution's values or nothing; pieces of an execution whose first device
has moved on are stale and dropped.

This module owns the lanes, jobs and pieces and is their only writer.
**Nothing waits on a clock**: a job ends when it runs or when its execution
is known to have failed (``executions.failed`` calls :func:`cancel`: learnt
from the execution's own token, by the dispatching thread, its barrier, or
the watcher of computations in flight), so barriers wait for slow devices as
long as they take and every wait inside a computation ends once a failure
is known. A job that fails defers its error as any callback does; the jobs
of the same execution queued behind it are skipped, as the later effects of
a chain are after a failure (never those of other chains or executions).
A failed execution over several devices leaves its lane as a *tombstone*
(``Lane.kept``): XLA may mark every device's results failed while one
device still runs its part, so "ended" is never learnt from a failed
token; an effect of it that still arrives is skipped, and its host function
returns its carrier ``FAILED``, so the execution's later effects on that
device are skipped by the carrier itself. A tombstone goes at the chain's
next execution's first job or at its slot's end; a barrier keeps it if it
is its chain's last (one per (slot, chain): the chain's memo of its last
failed execution, which a late effect of it on a device still running must
find; while it is kept, host functions take their slow path). A memo filed
after its slot was freed (the watcher learns of a failure on its own time)
stays until the slot's next owner runs that chain (its sequence numbers
come after every earlier owner's: ``token_store.TokenStore.base``): bounded
by the slots and chains.
What a thread kept here goes when its slot is freed.

Part in the token calling convention: none (the carrier passes through a
call whose effect is left here unchanged, or comes back ``FAILED`` when its
execution failed; its identity names the lane).
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable

from jax_effects._runtime import fork as _fork
from jax_effects._runtime import token_value as _token_value

__all__ = ["queues", "waits", "submit", "drain", "wait_turn", "wait_idle",
           "cancel", "Job", "Pieces"]

#: One lock for the lanes, the jobs and the pieces they wait for.
lock = threading.Condition()

#: (slot, chain) -> its lanes, in execution order; present while any is
#: queued. Read without the lock by every threaded host function (an empty
#: dict: nothing is waiting anywhere).
queues: dict[tuple, list] = {}

# (slot, chain) pairs whose jobs a thread is running now (one at a time).
_draining: set[tuple] = set()


class _Local(threading.local):
  lane = None   # the (slot, chain) whose jobs this thread is running


local = _Local()


class Job:
  """``run()`` (returns True if the effect failed) once ``ready()``;
  skipped once ``cancelled``."""
  __slots__ = ("run", "ready", "cancelled")

  def __init__(self, run: Callable[[], bool],
               ready: Callable[[], bool] = lambda: True):
    self.run = run
    self.ready = ready
    self.cancelled = False


class Lane:
  """The effects of one execution (``seq``) of a (slot, chain) left here.
  ``failed``: a job of it failed, or the execution failed as a whole
  (:func:`cancel`): the rest of its effects are skipped, also those that
  arrive later (a cancelled execution's empty lane stays, last, until a
  later execution's lane follows it or :func:`retire`)."""
  __slots__ = ("seq", "jobs", "failed", "kept")

  def __init__(self, seq: int):
    self.seq = seq
    self.jobs: collections.deque = collections.deque()
    self.failed = False
    self.kept = False   # (failed, and its execution may still be running)


def _lane(lanes: list, seq: int, create: bool):
  """``seq``'s lane in ``lanes`` (under the lock), created in order if
  asked and some lane precedes it; None for an execution earlier than
  every lane (it runs at once)."""
  for i, lane in enumerate(lanes):
    if lane.seq == seq:
      return lane
    if _token_value.seq_after(lane.seq, seq):
      if i == 0 or not create:
        return None
      lane = Lane(seq)
      lanes.insert(i, lane)
      return lane
  if not create or not lanes:
    return None
  lane = Lane(seq)
  lanes.append(lane)
  return lane


def waits(slot: int, chain, seq: int) -> bool:
  """Whether an effect of execution ``seq`` of (``slot``, ``chain``) must
  wait here (module docstring): not when this thread is running that
  chain's jobs, nor when it precedes every lane, nor when it follows the
  chain's memo of its last failed execution (which it ends)."""
  key = (slot, chain)
  lanes = queues.get(key)
  if lanes is None or local.lane == key:
    return False
  with lock:
    lanes = queues.get(key)
    if not lanes:
      return False
    if not _earlier_than_all(lanes, seq):
      if memo(lanes) and lanes[0].seq != seq:
        # (a later execution's effect: the failed one has ended here)
        del queues[key]
        lock.notify_all()
        return False
      return True
    lane = _lane(lanes, seq, create=False)
    return lane is not None and lane.failed


def _earlier_than_all(lanes, seq) -> bool:
  return _token_value.seq_after(lanes[0].seq, seq)


def submit(slot: int, chain, seq: int, job: Job) -> bool:
  """Queues ``job`` in the lane of execution ``seq`` and runs what can run.
  False: its execution has failed, the job is skipped (as after a raise;
  the caller marks its carrier ``FAILED``, so the execution's later
  effects on that device are skipped by the carrier itself)."""
  key = (slot, chain)
  with lock:
    lanes = queues.setdefault(key, [])
    lane = _lane(lanes, seq, create=True)
    if lane is None:   # (earlier than every lane: first)
      lane = Lane(seq)
      lanes.insert(0, lane)
    if lane.failed:
      return False
    lane.jobs.append(job)
  drain(slot, chain)
  return True


def drain(slot: int, chain) -> None:
  """Runs (``slot``, ``chain``)'s jobs that can run, in order (unless
  another thread is at it)."""
  key = (slot, chain)
  if key not in queues:
    return
  while True:
    with lock:
      lanes = queues.get(key)
      if lanes is None or key in _draining:
        return
      while lanes and not lanes[0].jobs:
        if lanes[0].kept and len(lanes) == 1:
          return   # (a cancelled execution's lane: kept, see Lane)
        lanes.pop(0)
        lock.notify_all()
      if not lanes:
        del queues[key]
        lock.notify_all()
        return
      lane = lanes[0]
      job = lane.jobs[0]
      if not job.cancelled and not lane.failed and not job.ready():
        return
      lane.jobs.popleft()
      if job.cancelled or lane.failed:
        lock.notify_all()
        continue
      _draining.add(key)
    prev, local.lane = local.lane, key
    failed = False
    try:
      failed = bool(job.run())
    finally:
      local.lane = prev
      with lock:
        _draining.discard(key)
        if failed:   # (its later effects, still to come, are skipped)
          lane.failed = lane.kept = True
        lock.notify_all()


def wait_turn(slot: int, chain, seq: int) -> bool:
  """Blocks until an effect of execution ``seq`` may run (an effect with
  results: the program needs them now): the jobs before it have run (or
  their executions are known to have failed). False: its own execution
  failed meanwhile (skip it)."""
  key = (slot, chain)
  own = None   # (kept across waits: a failed lane may leave the queue)
  with lock:
    while True:
      lanes = queues.get(key)
      if own is None and lanes:
        own = _lane(lanes, seq, create=False)
      if own is not None and own.failed:
        return False
      if not lanes:
        return True
      before = [lane for lane in lanes
                if _token_value.seq_after(seq, lane.seq)]
      if (key not in _draining and not _busy(before)
          and (own is None or not own.jobs)):
        return True
      lock.wait()


def _busy(lanes) -> bool:
  return any(lane.jobs for lane in lanes)


def wait_idle(slots=None) -> None:
  """Blocks until ``slots`` (every slot if None) have no jobs left: their
  jobs ran, or their executions are known to have failed (never on a
  clock, see the module docstring)."""
  with lock:
    while True:
      pending = [k for k, lanes in queues.items()
                 if (slots is None or k[0] in slots)
                 and (_busy(lanes) or k in _draining)]
      if not pending:
        return
      lock.wait()


def cancel(slot: int, chains: dict, ended: bool = True) -> None:
  """Executions of ``slot`` failed (``chains``: chain -> sequence number):
  their jobs waiting for pieces that will never come are skipped and their
  pieces dropped (``executions.failed``)."""
  with lock:
    for chain, seq in chains.items():
      lanes = queues.setdefault((slot, chain), [])
      lane = _lane(lanes, seq, create=True)
      if lane is None:   # (earlier than every lane, or the first)
        lane = Lane(seq)
        lanes.insert(0, lane)
      lane.failed = True
      if not ended:   # (else nothing of it can arrive any more; once kept,
        lane.kept = True   # kept: another learner's "ended" is no surer)
      for job in lane.jobs:
        job.cancelled = True
      if not lane.kept and not lane.jobs:
        lanes.remove(lane)
      if not lanes:
        del queues[(slot, chain)]
      for site in list(_sites):
        if site.chain == chain:
          site.drop(slot, seq)
    lock.notify_all()
  for chain in chains:
    drain(slot, chain)


def retire_slots(slots) -> None:
  """A barrier waited for the computations of ``slots`` (every slot if
  None) and their jobs: what is left of their lanes goes, except a chain's
  *last* lane if it is a tombstone (its execution failed; a device of it
  may still run its part, see the module docstring: a token cannot say
  that every device's part of a failed execution has ended, so neither can
  a barrier that waited for one). That one tombstone per (slot, chain) is
  the chain's memo of its last failed execution: it goes at the chain's
  next execution's first job or the slot's end."""
  with lock:
    for key in [k for k in queues if slots is None or k[0] in slots]:
      lanes = queues[key]
      last = lanes[-1] if lanes and lanes[-1].kept else None
      lanes[:] = [lane for lane in lanes if lane.jobs or lane is last]
      if not lanes:
        del queues[key]
    lock.notify_all()


def memo(lanes: list) -> bool:
  """Whether ``lanes`` (a chain's) are only the memo of its last failed
  execution (:func:`retire_slots`): no job, nothing waits behind it."""
  return len(lanes) == 1 and lanes[0].kept and not lanes[0].jobs


def retire(slot: int, chains: dict) -> None:
  """The failed executions of ``slot`` (``chains``: chain -> sequence
  number) have ended on every device: their kept lanes go."""
  with lock:
    for chain, seq in chains.items():
      key = (slot, chain)
      lanes = queues.get(key)
      if lanes:
        lanes[:] = [lane for lane in lanes
                    if not (lane.seq == seq and lane.kept and not lane.jobs)]
        if not lanes:
          del queues[key]
    lock.notify_all()


def forget(slot: int) -> None:
  """``slot`` is freed (``threads``: its thread ended, its computations
  completed): drop what is still kept under it."""
  with lock:
    for site in list(_sites):
      site.parts.pop(slot, None)
    for key in [k for k in queues if k[0] == slot]:
      del queues[key]
    lock.notify_all()


# --- where the pieces meet -------------------------------------------------------

_sites: "weakref.WeakSet[Pieces]" = weakref.WeakSet()


def sites_lowered() -> bool:
  """Whether any call site assembles operands on the host (then executions
  over several devices are watched: ``executions.watch``)."""
  return bool(_sites)


class _Pieces:
  """The pieces one execution (``seq``) of a slot left at a site so far."""
  __slots__ = ("seq", "by_device")

  def __init__(self, seq: int):
    self.seq = seq
    self.by_device: dict[int, tuple] = {}


class Pieces:
  """Where one lowered call site's devices leave their pieces for the first
  device's call, per dispatching thread's slot, matched by the execution's
  sequence number (module docstring). Guarded by :data:`lock`: the jobs that
  wait for pieces and the pieces are one state. ``chain``: the chain key of
  the site's effect."""

  def __init__(self, num_devices: int, chain):
    self.num_devices = num_devices
    self.chain = chain
    self.parts: dict[int, _Pieces] = {}
    with lock:
      _sites.add(self)

  def deposit(self, slot: int, seq: int, device: int, parts: tuple) -> None:
    """Device ``device``'s piece of execution ``seq`` (a later device call)."""
    with lock:
      entry = self.parts.get(slot)
      if entry is None or _token_value.seq_after(seq, entry.seq):
        entry = self.parts[slot] = _Pieces(seq)   # (an older one is stale)
      elif entry.seq != seq:
        return   # a piece of an execution the first device has left: stale
      entry.by_device[device] = parts
    drain(slot, self.chain)   # its job may wait for this piece

  def arrive(self, slot: int, seq: int) -> None:
    """The first device's call of execution ``seq`` (under the lock): the
    pieces of any earlier execution are stale."""
    entry = self.parts.get(slot)
    if entry is None or _token_value.seq_after(seq, entry.seq):
      self.parts[slot] = _Pieces(seq)

  def complete(self, slot: int, seq: int) -> bool:
    """Whether every other device has left its piece of ``seq`` (under the
    lock)."""
    entry = self.parts.get(slot)
    return (entry is not None and entry.seq == seq
            and len(entry.by_device) == self.num_devices - 1)

  def take(self, slot: int, seq: int) -> list:
    """One piece from each other device, in device order (under the lock,
    complete); the site keeps only the sequence number."""
    entry = self.parts[slot]
    pieces = [entry.by_device[d] for d in range(1, self.num_devices)]
    entry.by_device = {}
    return pieces

  def drop(self, slot: int, seq: int) -> None:
    """Drops the pieces of execution ``seq`` of ``slot`` (it failed; under
    the lock), keeping its sequence number, so a late piece of it is
    stale."""
    entry = self.parts.get(slot)
    if entry is not None and entry.seq == seq:
      entry.by_device = {}


def held(slot: int | None = None) -> int:
  """Jobs and pieces kept (``slot``'s, or every slot's), for tests."""
  with lock:
    jobs = sum(len(lane.jobs) for k, lanes in queues.items()
               if slot is None or k[0] == slot for lane in lanes)
    pieces = sum(len(e.by_device) for site in list(_sites)
                 for s, e in site.parts.items()
                 if slot is None or s == slot)
  return jobs + pieces


def slots_kept() -> int:
  """(slot, site) entries and lanes kept, pieces or not, for tests: bounded
  by the live threads' slots (an ended thread's go when its slot is freed)."""
  with lock:
    return (sum(len(site.parts) for site in list(_sites))
            + sum(len(lanes) for lanes in queues.values()))


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child has none of the parent's jobs or pieces (their
  computations ran in the parent), and no lock a parent's thread held."""
  global lock
  lock = threading.Condition()
  queues.clear()
  _draining.clear()
  for site in list(_sites):
    site.parts.clear()
