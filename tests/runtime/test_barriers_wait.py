"""Barriers wait for running work, however slow; they never destroy it.

Issue 31, case 3 (the contract, ``design/errors.md``): ``effects_barrier
(all_threads=True)``, ``set_ordering`` and interpreter exit wait for work
that is still running (a device that is slow before its part of a
summarized print); they never give up on it on a clock, never say a
device failed, never lose the print, and a late part never ends up in a
later print. Waiting for work another thread dispatches *while* the
barrier waits is the barrier's choice; destroying it is not.

Each scenario runs in a fresh process (``helpers.run_scenario``).
"""
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_effects as je

import helpers
from helpers import call_values, per_device_stage, run_scenario

SLOW_DEVICE = 3


def scenario_barrier_waits_for_slow_work(kind: str) -> dict:
  """Main's call 1 fails on device 3 before its part of a summarized print
  (the print never runs); a barrier of ``kind`` starts; meanwhile thread T
  dispatches call 2, whose device 3 is slow (held by ``t_gate`` for a few
  seconds) before its part of the print.

  (XLA's CPU client starts an execution over several devices only once the
  one before it has ended, whatever its devices: so the barrier cannot be
  kept busy by other running work while T's print waits for its slow
  device. Before the fix, the failed print of call 1 kept it in the wait
  that gave up, after its clock, on *every* print still waiting: T's
  too.)"""
  helpers.shorten_todays_give_up()
  mesh = Mesh(np.array(jax.devices()), ("i",))
  t_gate = threading.Event()
  arrived = set()

  def host(block):
    call, rest = divmod(int(block.flat[0]), 1000)
    device = rest // 10
    arrived.add((call, device))
    if (call, device) == (1, SLOW_DEVICE):
      raise helpers.Injected("call 1 fails on device 3")
    if (call, device) == (2, SLOW_DEVICE) and not t_gate.wait(30):
      raise TimeoutError("call 2's gate was never opened")
    return block

  stage = per_device_stage(mesh, host)
  put = lambda c: jax.device_put(call_values(c),
                                 NamedSharding(mesh, P("i")))
  with np.printoptions(**helpers.SUMMARIZED):
    expected = {c: str(call_values(c)) for c in range(5)}

    @je.jit
    def f(x):
      je.print("{}", stage(x))
      return x

    f(put(0))
    je.effects_barrier()
    out1 = f(put(1))
  try:
    jax.block_until_ready(out1)
    seen = {"call 1": "returned"}
  except jax.errors.JaxRuntimeError:
    seen = {"call 1": "failed"}
  t_dispatched, t_go_on = threading.Event(), threading.Event()

  def thread_t(then_more: bool):
    with np.printoptions(**helpers.SUMMARIZED):
      f(put(2))                 # its print waits for device 3's part
      helpers.wait_until(lambda: {(2, d) for d in range(8)} <= arrived,
                         "call 2 never reached its devices")
      time.sleep(0.3)           # (device 0 has left the print for later)
      t_dispatched.set()
      if then_more:
        t_go_on.wait(30)
        f(put(4))               # T's next print: its own values only
        try:
          je.effects_barrier()
          seen["T"] = None
        except BaseException as exc:  # noqa: BLE001 - the observation
          seen["T"] = repr(exc)[:300]

  if kind == "exit":
    # T dispatches call 2 and ends; exit waits for it (device 3 is released
    # 3 s later, after the clock of the code before the fix ran out)
    t = threading.Thread(target=thread_t, args=(False,))
    t.start()
    t.join(30)
    assert t_dispatched.is_set(), "T's call 2 was never dispatched"
    threading.Thread(target=lambda: (time.sleep(3), t_gate.set()),
                     daemon=True).start()
    return dict(expected=expected, seen=seen)

  def barrier():
    try:
      if kind == "all-threads-barrier":
        je.effects_barrier(all_threads=True)
      else:
        je.set_ordering("global")
      seen["B"] = None
    except BaseException as exc:  # noqa: BLE001 - the observation
      seen["B"] = repr(exc)[:300]

  b = threading.Thread(target=barrier)
  b.start()
  time.sleep(0.3)   # (B waits: on the code before the fix, for call 1's print)
  t = threading.Thread(target=thread_t, args=(True,))
  t.start()
  assert t_dispatched.wait(30), "T's call 2 was never dispatched"
  b.join(3)   # B may return now, or wait for T's call 2 too (its choice)
  t_gate.set()
  t_go_on.set()
  for thread in (b, t):
    thread.join(30)
    assert not thread.is_alive(), f"{thread} hangs"
  with np.printoptions(**helpers.SUMMARIZED):
    f(put(3))
  for name, call in [("set_ordering", lambda: je.set_ordering("per_effect")),
                     ("final", lambda: je.effects_barrier(all_threads=True))]:
    try:
      call()
      seen[name] = None
    except BaseException as exc:  # noqa: BLE001 - the observation
      seen[name] = repr(exc)[:300]
  return dict(expected=expected, seen=seen,
              left=helpers.leftovers(helpers.runtime_inventory()))


def _records(stdout: str) -> list[str]:
  """The summarized prints in ``stdout`` (each ``[[...]]``, several lines)."""
  records, current = [], []
  for line in stdout.splitlines():
    if line.startswith("[["):
      current = [line]
    elif current:
      current.append(line)
    if current and line.endswith("]]"):
      records.append("\n".join(current))
      current = []
  return records


@pytest.mark.parametrize("kind", ["all-threads-barrier", "set_ordering",
                                  "exit"])
def test_barriers_never_destroy_running_work(kind):
  # Before the fix (its 60 s clock shortened to 1 s by
  # helpers.shorten_todays_give_up): B's barrier (or exit) gave T's print
  # up with call 1's: "jax_effects: 2 effect(s) of a thread waited for parts
  # of their operands that never came (a device's computation failed
  # before reaching them?); they were given up" on stderr, call 2's print
  # was lost, B raised call 1's XLA error again, and T's next print took
  # call 2's late part (a mix).
  got = run_scenario(__file__, "scenario_barrier_waits_for_slow_work", kind)
  r = got.result
  expected = {int(c): text for c, text in r["expected"].items()}
  records = _records(got.stdout)
  # every print is whole and its own: one of the calls' texts, each once
  assert all(t in expected.values() for t in records), got.stdout
  assert len(set(records)) == len(records), got.stdout
  # call 1 failed (its result says so); its print never ran (absent); every
  # other call printed, each thread in its own order
  assert r["seen"]["call 1"] == "failed"
  calls = [0, 2] if kind == "exit" else [0, 2, 3, 4]
  assert sorted(records) == sorted(expected[c] for c in calls), got.stdout
  assert "jax_effects:" not in got.stderr, got.stderr[-3000:]
  assert got.returncode == 0, got.stderr[-3000:]
  if kind == "exit":
    return
  order = {text: i for i, text in enumerate(records)}
  assert order[expected[0]] < order[expected[3]]
  assert order[expected[2]] < order[expected[4]]
  assert r["seen"] == {"call 1": "failed", "B": None, "T": None,
                       "set_ordering": None, "final": None}
  assert r["left"] == {}
