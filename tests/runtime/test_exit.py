"""Interpreter exit with effects still pending on several threads
(``design/errors.md``, "Interpreter exit").

A subprocess runs threads that dispatch jitted, ordered prints and then the
script ends without any ``effects_barrier``. Every line must reach stdout
before the process ends: complete, once, and in each thread's order.
"""
import collections
import textwrap

import pytest

from helpers import run_script

SCRIPT = textwrap.dedent("""
    import sys, threading
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp
    import numpy as np
    import jax_effects as je

    N_THREADS, N, JOIN = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

    @je.jit
    def f(tid, i, x):
      je.print("line {} {}", tid, i)
      y = jnp.sin(x) @ jnp.cos(x)          # some work after the effect
      je.print("line {} {}", tid, i + 1, effect=je.Effect("second"))
      return y

    @je.jit
    def g(tid, i):
      je.print("line {} {}", tid, i, effect=je.Effect("second"))

    def work(t):
      dev = jax.devices()[t % len(jax.devices())]
      x = jax.device_put(jnp.ones((64, 64)), dev)
      i = 0
      while i < N:
        f(np.int32(t), np.int32(i), x)
        g(np.int32(t), np.int32(i + 2))
        i += 3
      # exits with its effects possibly pending: no barrier

    threads = [threading.Thread(target=work, args=(t,)) for t in range(N_THREADS)]
    for t in threads:
      t.start()
    if JOIN == "join":
      for t in threads:
        t.join()
    # "nojoin": the main thread ends at once; the interpreter waits for the
    # (non-daemon) threads, then jax_effects' exit hook for their effects.
""")


@pytest.mark.parametrize("join", ["join", "nojoin"])
def test_pending_effects_of_several_threads_complete_at_exit(join):
  n_threads, n = 4, 300
  proc = run_script(SCRIPT, str(n_threads), str(n), join, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  per_thread = collections.defaultdict(list)
  for line in proc.stdout.splitlines():
    parts = line.split()
    assert len(parts) == 3 and parts[0] == "line", (
        f"unexpected stdout line {line!r}; stderr: {proc.stderr[-2000:]}")
    _, tid, i = parts
    per_thread[int(tid)].append(int(i))
  # Lines of the two effects interleave freely; each effect's lines are in
  # order, and together they are every line exactly once.
  for t in range(n_threads):
    assert sorted(per_thread[t]) == list(range(n)), f"thread {t} lost lines"
    first = [i for i in per_thread[t] if i % 3 == 0]
    second = [i for i in per_thread[t] if i % 3 != 0]
    assert first == sorted(first) and second == sorted(second)


LATE_HANDLER_SCRIPT = textwrap.dedent("""
    import atexit, threading

    def ours_alive():
      return sorted(t.name for t in threading.enumerate()
                    if t.name.startswith("jax_effects"))

    def late():   # registered first: runs after jax_effects' exit handler
      print("after the exit handler:", ours_alive())
      f(put(2))   # a late dispatch (reported by itself)
      print("after a late dispatch:", ours_alive())

    atexit.register(late)

    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_effects as je

    mesh = Mesh(np.array(jax.devices()), ("i",))
    put = lambda c: jax.device_put(np.arange(64.0) + c,
                                   NamedSharding(mesh, P("i")))

    @je.jit
    def f(x):
      je.print("{}", x)   # summarized, on the host, from 8 devices: watched
      return x

    np.set_printoptions(threshold=8, edgeitems=2)
    f(put(0))
    f(put(1))
    je.effects_barrier()
    print("before exit:", ours_alive())
""")


def test_no_thread_of_ours_is_left_running_into_finalization():
  # A daemon thread of ours inside a jaxlib call that releases the GIL
  # when the interpreter finalizes is ended by CPython from inside jaxlib's
  # C++: the process aborts ("FATAL: exception not rethrown", status -6;
  # seen in CI, rarely, with the watcher in ``block_until_ready``). So the
  # exit handler ends the watcher, and a late dispatch ends the one it
  # started before it returns.
  proc = run_script(LATE_HANDLER_SCRIPT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines == ["[ 0.  1. ... 62. 63.]", "[ 1.  2. ... 63. 64.]",
                   "before exit: ['jax_effects-watcher']",
                   "after the exit handler: []", "[ 2.  3. ... 64. 65.]",
                   "after a late dispatch: []"], proc.stdout
