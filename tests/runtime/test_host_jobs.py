"""Effects left to run on the host (``_runtime/host_jobs``;
``design/formatting.md``, "Summarized arrays"; ``design/errors.md``,
"Executions that fail as a whole"): lanes per execution in sequence order,
pieces matched by execution identity, never first in first out, nothing
given up on a clock, a failure stops only its own execution's lane, and
nothing is kept for a slot once it is freed. Driven directly, as the host
functions drive it.
"""
import threading

import pytest

from jax_effects._runtime import host_jobs

CHAIN = object()
OTHER = object()
SLOT = 9001   # (a slot no thread of the test process uses)


@pytest.fixture(autouse=True)
def _clean():
  yield
  host_jobs.forget(SLOT)


def _job(log, name, ready=lambda: True, fails=False):
  def run():
    log.append(name)
    return fails
  return host_jobs.Job(run, ready)


def test_lanes_run_in_execution_order_not_arrival_order():
  log = []
  gate = []
  # execution 5 leaves a job waiting (a piece missing); execution 6's
  # effect arrives later and must wait behind it; execution 4's effect
  # (earlier than every lane) runs at once.
  host_jobs.submit(SLOT, CHAIN, 5, _job(log, "5a", ready=lambda: bool(gate)))
  assert host_jobs.waits(SLOT, CHAIN, 6)
  host_jobs.submit(SLOT, CHAIN, 6, _job(log, "6a"))
  assert not host_jobs.waits(SLOT, CHAIN, 4)
  assert not host_jobs.waits(SLOT, OTHER, 6)   # another chain: not held
  host_jobs.submit(SLOT, CHAIN, 5, _job(log, "5b"))
  assert log == []
  gate.append(True)
  host_jobs.drain(SLOT, CHAIN)
  assert log == ["5a", "5b", "6a"]
  assert not host_jobs.waits(SLOT, CHAIN, 6)
  assert host_jobs.held(SLOT) == 0


def test_a_failed_job_skips_only_its_own_executions_later_jobs():
  log = []
  host_jobs.submit(SLOT, CHAIN, 5, _job(log, "5a", ready=lambda: False))
  host_jobs.submit(SLOT, CHAIN, 5, _job(log, "5b"))
  host_jobs.submit(SLOT, CHAIN, 6, _job(log, "6a"))
  lanes = host_jobs.queues[(SLOT, CHAIN)]
  lanes[0].jobs[0].ready = lambda: True
  lanes[0].jobs[0].run = lambda: (log.append("5a fails"), True)[1]
  host_jobs.drain(SLOT, CHAIN)
  assert log == ["5a fails", "6a"]   # 5b skipped; 6 (another execution) ran


def test_cancel_ends_a_failed_executions_waiting_jobs_and_frees_waiters():
  log = []
  host_jobs.submit(SLOT, CHAIN, 5, _job(log, "never", ready=lambda: False))
  done = threading.Event()

  def effect_with_results():   # (an effect with results of execution 6)
    host_jobs.wait_turn(SLOT, CHAIN, 6)
    done.set()

  t = threading.Thread(target=effect_with_results)
  t.start()
  assert not done.wait(0.2)   # waits for execution 5's job
  host_jobs.cancel(SLOT, {CHAIN: 5})   # execution 5 failed
  assert done.wait(60), "the wait did not end once the failure was known"
  t.join(60)
  assert log == []
  host_jobs.wait_idle((SLOT,))


def test_pieces_are_matched_by_execution_never_first_in_first_out():
  site = host_jobs.Pieces(3, CHAIN)
  # execution 5: device 1 and 2 leave pieces; the first device never
  # arrives (it failed before the print)
  site.deposit(SLOT, 5, 1, ("5 from 1",))
  site.deposit(SLOT, 5, 2, ("5 from 2",))
  # execution 6's first device arrives: execution 5's pieces are stale
  with host_jobs.lock:
    site.arrive(SLOT, 6)
    assert not site.complete(SLOT, 6)
  site.deposit(SLOT, 6, 2, ("6 from 2",))
  site.deposit(SLOT, 5, 1, ("late 5",))   # a late piece of 5: stale
  site.deposit(SLOT, 6, 1, ("6 from 1",))
  with host_jobs.lock:
    assert site.complete(SLOT, 6)
    assert site.take(SLOT, 6) == [("6 from 1",), ("6 from 2",)]
  assert host_jobs.held(SLOT) == 0


def test_a_failed_executions_pieces_are_dropped_and_late_ones_stale():
  site = host_jobs.Pieces(3, CHAIN)
  site.deposit(SLOT, 7, 1, ("7 from 1",))
  host_jobs.cancel(SLOT, {CHAIN: 7})
  assert host_jobs.held(SLOT) == 0
  site.deposit(SLOT, 7, 2, ("late 7",))
  assert host_jobs.held(SLOT) == 1   # (kept until a later execution comes)
  with host_jobs.lock:
    site.arrive(SLOT, 8)
    assert not site.complete(SLOT, 8)
  assert host_jobs.held(SLOT) == 0


def test_nothing_is_kept_for_a_freed_slot():
  site = host_jobs.Pieces(2, CHAIN)
  site.deposit(SLOT, 3, 1, ("x",))
  host_jobs.submit(SLOT, CHAIN, 4, _job([], "j", ready=lambda: False))
  assert host_jobs.held(SLOT) == 2
  host_jobs.forget(SLOT)
  assert host_jobs.held(SLOT) == 0
  assert SLOT not in site.parts
  assert (SLOT, CHAIN) not in host_jobs.queues


@pytest.mark.parametrize("slots", [(SLOT,), None], ids=["own", "all-threads"])
def test_a_barrier_keeps_the_memo_of_a_chains_last_failed_execution(slots):
  # Execution 5 failed on one device while another still runs its part
  # (learnt early, by the watcher: not ended). A barrier that waited for
  # the slot's computations (XLA may have marked all of 5's results failed
  # already) retires what is left of its lanes, but not this one: the
  # effects that 5's running device still delivers must be skipped, never
  # run after a print of 5 that never ran (fault model seed 2065).
  log = []
  host_jobs.submit(SLOT, CHAIN, 5, _job(log, "S5", ready=lambda: False))
  host_jobs.cancel(SLOT, {CHAIN: 5}, ended=False)
  host_jobs.wait_idle(slots)
  host_jobs.retire_slots(slots)
  assert host_jobs.held(SLOT) == 0
  assert host_jobs.waits(SLOT, CHAIN, 5)
  assert not host_jobs.submit(SLOT, CHAIN, 5, _job(log, "late s5.1"))
  assert not host_jobs.wait_turn(SLOT, CHAIN, 5)   # (an effect with results)
  assert not host_jobs.waits(SLOT, OTHER, 5)
  assert log == []
  # execution 6's first effect: 5 has ended; the memo goes, 6 runs at once
  assert not host_jobs.waits(SLOT, CHAIN, 6)
  assert (SLOT, CHAIN) not in host_jobs.queues
  assert host_jobs.submit(SLOT, CHAIN, 6, _job(log, "s6.1"))
  assert log == ["s6.1"]
  assert (SLOT, CHAIN) not in host_jobs.queues

