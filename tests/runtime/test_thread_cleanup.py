"""Nothing is kept per thread after it ends (issue 31, case 8).

The contract (C8): once a thread has ended and its executions have ended,
the runtime keeps nothing of it: no registry entry
(``helpers.runtime_inventory``) after an all-threads barrier, and memory
stays flat however many threads come and go (a server that handles each
request on a new thread). Measured with ``tracemalloc`` (Python's own
allocations: deterministic, unlike the process's resident size), per
thread, over threads that come after a warm-up.

The scenario runs in a fresh process (``helpers.run_scenario``).
"""
import gc
import threading
import tracemalloc

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_effects as je

import helpers
from helpers import run_scenario

WARM_UP = 30
#: (200: what JAX keeps once, spread over them, is about 360 bytes per
#: thread on JAX 0.10, 250 on 0.12; a slot's meeting-place pieces left
#: behind show in the inventory at any count)
THREADS = helpers.scale(200, 3000)
#: Bytes of Python allocations allowed to stay per thread once it ended
#: (JAX and the interpreter keep a few dozen; the runtime before the fix
#: kept about 6,100: an entry per device in each summarized print's meeting
#: place).
BYTES_PER_THREAD = 1024


class _Count:
  """A ``sys.stdout`` that counts the lines written to it."""

  def __init__(self):
    self.lines = 0

  def write(self, text):
    self.lines += text.count("\n")

  def flush(self):
    pass


def scenario_threads_leave_nothing(threads: int) -> dict:
  import sys
  mesh = Mesh(np.array(jax.devices()), ("i",))
  x = jax.device_put(np.arange(64, dtype=np.int32).reshape(8, 8),
                     NamedSharding(mesh, P("i")))
  with np.printoptions(threshold=10, edgeitems=3):
    @je.jit
    def f(x):
      je.print("{}", x)     # summarized: every device's part, on the host
      return x

    f(x)
  je.effects_barrier()
  sys.stdout = out = _Count()

  def run(n):
    for _ in range(n):
      t = threading.Thread(target=f, args=(x,))
      t.start()
      t.join(30)
      assert not t.is_alive(), "a thread's call hangs"
    je.effects_barrier(all_threads=True)
    gc.collect()

  run(WARM_UP)
  tracemalloc.start()
  before = tracemalloc.get_traced_memory()[0]
  run(threads)
  after = tracemalloc.get_traced_memory()[0]
  snapshot = tracemalloc.take_snapshot()
  tracemalloc.stop()
  sys.stdout = sys.__stdout__
  top = [str(s) for s in snapshot.statistics("filename")[:5]]
  return dict(lines=out.lines, per_thread=(after - before) / threads,
              top=top, left=helpers.leftovers(helpers.runtime_inventory()))


def test_ended_threads_leave_nothing_behind():
  # Before the fix (400 threads): 2,800 entries left (an empty queue per
  # thread and device in the print's meeting place: 21,350 for the issue's
  # 3,000 threads) and 6,114 bytes per thread kept (+17.7 MiB for 3,000).
  got = run_scenario(__file__, "scenario_threads_leave_nothing", THREADS)
  r = got.result
  assert r["lines"] == 7 * (WARM_UP + THREADS)   # every thread printed
  assert r["left"] == {}, f"{THREADS} ended threads left {r['left']}"
  assert r["per_thread"] < BYTES_PER_THREAD, (
      f"{r['per_thread']:.0f} bytes kept per ended thread; largest "
      f"allocations by file: {r['top']}")
