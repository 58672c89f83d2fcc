"""Effects left to run on the host, in each chain's order, and their pieces.

An effect whose operands are assembled on the host from every device's part
(``_primitives.host_assembly``) runs once every device's call has left its
*piece* at the call site (:class:`Pieces`). The first device's call must
not wait for them (another device may be waiting for it in one of the
program's collectives: a deadlock,
``tests/frontends/test_summarized_printing.py``), so it leaves the effect
here as a *job* and returns; the call that brings the last piece runs it.

A (slot, chain)'s jobs form *lanes*, one per execution (its identity,
``token_value``, which also matches pieces), in sequence order; only the
first lane runs, and a later effect of the chain queues or waits its turn
(:func:`wait_turn`). This module owns the lanes, jobs and pieces and is
their only writer. Nothing waits on a clock: a job ends when it runs or
when its execution is known to have failed (:func:`cancel`). A failed
execution over several devices leaves its lane as a *tombstone*
(``Lane.kept``), a chain's last one as its *memo*: ``design/errors.md``,
"Executions that fail as a whole".

Part in the token calling convention: none (the carrier passes through, or
comes back ``FAILED`` when its execution failed; its identity names the
lane).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Callable

from jax_effects._runtime import fork as _fork
from jax_effects._runtime import token_value as _token_value

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


@dataclasses.dataclass(slots=True, eq=False)
class Job:
  """``run()`` (returns True if the effect failed) once ``ready()``;
  skipped once ``cancelled``."""
  run: Callable[[], bool]
  ready: Callable[[], bool] = lambda: True
  cancelled: bool = False


@dataclasses.dataclass(slots=True, eq=False)
class Lane:
  """The effects of one execution (``seq``) of a (slot, chain) left here.
  ``failed``: a job of it failed, or it failed as a whole (:func:`cancel`):
  the rest of its effects, also later arrivals, are skipped."""
  seq: int
  jobs: collections.deque = dataclasses.field(default_factory=collections.deque)
  failed: bool = False
  kept: bool = False   # (failed, and its execution may still be running)


def _lane(lanes: list, seq: int, create: bool):
  """``seq``'s lane in ``lanes`` (under the lock), created in order if
  asked; else None for an execution earlier than every lane, or none."""
  for i, lane in enumerate(lanes):
    if lane.seq == seq:
      return lane
    if _token_value.seq_after(lane.seq, seq):
      break
  else:
    i = len(lanes)
  if not create:
    return None
  lanes.insert(i, Lane(seq))
  return lanes[i]


def waits(slot: int, chain, seq: int) -> bool:
  """Whether an effect of execution ``seq`` of (``slot``, ``chain``) must
  wait here: not on the thread running that chain's jobs, nor before every
  lane, nor after the chain's memo (which it ends)."""
  key = (slot, chain)
  if key not in queues or local.lane == key:
    return False
  with lock:
    lanes = queues.get(key)
    if not lanes:
      return False
    if _token_value.seq_after(lanes[0].seq, seq):
      return False   # (earlier than every lane)
    if memo(lanes) and lanes[0].seq != seq:
      # (a later execution's effect: the failed one has ended here)
      del queues[key]
      lock.notify_all()
      return False
    return True


def submit(slot: int, chain, seq: int, job: Job) -> bool:
  """Queues ``job`` in the lane of execution ``seq`` and runs what can run.
  False: its execution has failed, the job is skipped (the caller returns
  its carrier ``FAILED``)."""
  key = (slot, chain)
  with lock:
    lane = _lane(queues.setdefault(key, []), seq, create=True)
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
  """Blocks until an effect with results of execution ``seq`` may run (the
  jobs before it ran or failed). False: its own execution failed (skip)."""
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
      before = [lane for lane in lanes if _token_value.seq_after(seq, lane.seq)]
      if (key not in _draining and not _busy(before)
          and (own is None or not own.jobs)):
        return True
      lock.wait()


def _busy(lanes) -> bool:
  return any(lane.jobs for lane in lanes)


def wait_idle(slots=None) -> None:
  """Blocks until ``slots`` (every slot if None) have no jobs left (run,
  or their executions known to have failed)."""
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
  their jobs are skipped and their pieces dropped (``executions.failed``).
  """
  with lock:
    for chain, seq in chains.items():
      lanes = queues.setdefault((slot, chain), [])
      lane = _lane(lanes, seq, create=True)
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
  """A barrier waited for ``slots``' computations (every slot's if None)
  and jobs: their lanes go, but a chain's last tombstone (its *memo*: no
  token says every device's part has ended, ``design/errors.md``)."""
  with lock:
    for key in [k for k in queues if slots is None or k[0] in slots]:
      lanes = queues[key]
      last = lanes[-1] if lanes and lanes[-1].kept else None
      lanes[:] = [lane for lane in lanes if lane.jobs or lane is last]
      if not lanes:
        del queues[key]
    lock.notify_all()


def memo(lanes: list) -> bool:
  """Whether a chain's ``lanes`` are only its memo (:func:`retire_slots`)."""
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
  """``slot`` is freed (``threads.sweep``): drop what is kept under it."""
  with lock:
    for site in list(_sites):
      site.parts.pop(slot, None)
    for key in [k for k in queues if k[0] == slot]:
      del queues[key]
    lock.notify_all()


# --- where the pieces meet -------------------------------------------------

_sites: "weakref.WeakSet[Pieces]" = weakref.WeakSet()


def sites_lowered() -> bool:
  """Whether any call site assembles operands on the host (then executions
  over several devices are watched)."""
  return bool(_sites)


#: The pieces one execution (``seq``) of a slot left at a site so far
#: (``by_device``: device -> its pieces not yet taken, oldest first: a site
#: in a loop runs once an iteration, and a device may run iterations ahead
#: of the first device's jobs).
_Pieces = collections.namedtuple("_Pieces", ("seq", "by_device"))


class Pieces:
  """Where one lowered call site's devices leave their pieces for the first
  device's call, per slot, matched by sequence number and, within one
  execution, by order (the first device's k-th call takes each device's
  k-th piece); guarded by :data:`lock`. ``chain``: the chain key of the
  site's effect."""

  def __init__(self, num_devices: int, chain):
    self.num_devices = num_devices
    self.chain = chain
    self.parts: dict[int, _Pieces] = {}
    with lock:
      _sites.add(self)

  def deposit(self, slot: int, seq: int, device: int, parts: tuple) -> None:
    """Device ``device``'s piece of execution ``seq`` (a later device call)."""
    with lock:
      entry = self.arrive(slot, seq)
      if entry.seq != seq:
        return   # a piece of an execution the first device has left: stale
      entry.by_device.setdefault(device, collections.deque()).append(parts)
    drain(slot, self.chain)   # its job may wait for this piece

  def arrive(self, slot: int, seq: int) -> _Pieces:
    """The first device's call of execution ``seq`` (under the lock): the
    pieces of an earlier one are stale; returns the slot's entry."""
    entry = self.parts.get(slot)
    if entry is None or _token_value.seq_after(seq, entry.seq):
      entry = self.parts[slot] = _Pieces(seq, {})
    return entry

  def complete(self, slot: int, seq: int) -> bool:
    """Whether every other device left its piece of ``seq`` (locked)."""
    entry = self.parts.get(slot)
    return (entry is not None and entry.seq == seq
            and len(entry.by_device) == self.num_devices - 1
            and all(entry.by_device.values()))

  def take(self, slot: int, seq: int) -> list:
    """Each other device's oldest piece, in device order (locked)."""
    entry = self.parts[slot]
    return [entry.by_device[d].popleft() for d in range(1, self.num_devices)]

  def drop(self, slot: int, seq: int) -> None:
    """Drops the pieces of failed execution ``seq`` (locked), keeping its
    number: a late piece of it is stale."""
    entry = self.parts.get(slot)
    if entry is not None and entry.seq == seq:
      entry.by_device.clear()


def held(slot: int | None = None) -> int:
  """Jobs and pieces kept (``slot``'s, or every slot's), for tests."""
  with lock:
    jobs = sum(len(lane.jobs) for k, lanes in queues.items()
               if slot is None or k[0] == slot for lane in lanes)
    pieces = sum(len(q) for site in list(_sites)
                 for s, e in site.parts.items()
                 if slot is None or s == slot for q in e.by_device.values())
  return jobs + pieces


@_fork.reset_in_child
def _reset_after_fork() -> None:
  global lock
  lock = threading.Condition()
  queues.clear()
  _draining.clear()
  for site in list(_sites):
    site.parts.clear()
