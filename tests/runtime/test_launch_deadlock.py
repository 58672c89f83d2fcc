"""Several threads dispatching computations over 8 CPU devices (no hang;
``design/errors.md``, "Several threads launching computations over several
CPU devices").

XLA's CPU client deadlocks when executables spanning several devices are
launched from several threads at once (see ``_launch_lock.launch_lock``):
8 threads calling a ``shard_map`` over the 8 devices hung every time, with
every dispatching thread inside the launch and the client's thread pool
blocked on the devices' in-flight limits; so did plain ``jax.jit`` (no
callback needed). ``jax_effects`` launches such computations one at a time.
A callback that runs once in such a computation adds no collective in which
the other devices wait for it (``threaded.on_first_device``): with one,
the rendezvous stalled under this load and XLA aborted the process.

Run in a subprocess, bounded: a hang dumps every thread's stack and fails.
"""
import textwrap

from helpers import run_script


SCRIPT = textwrap.dedent("""
    import faulthandler, sys, threading
    faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_effects as je

    N_THREADS, N = int(sys.argv[1]), int(sys.argv[2])
    mesh = jax.make_mesh((8,), ("x",))
    lock = threading.Lock()
    records = []

    def rec(tid, seq, dev):
      with lock:
        records.append((int(tid), int(seq), int(dev)))

    @je.jit
    def f(tid, seq, x):
      def body(tid, seq, xs):
        je.callback(rec, None, tid, seq, jax.lax.axis_index("x"))
        return xs + 1
      return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("x")),
                           out_specs=P("x"))(tid, seq, x)

    @je.jit
    def g(tid, seq, x):
      # Runs once (automatic partitioning), on the first device: nothing of
      # ours makes the other devices wait for it (no collective).
      je.callback(rec, None, tid, seq, -1)
      return x * 2

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))

    def work(t):
      for i in range(N):
        f(np.int32(t), np.int32(i), x)
        g(np.int32(t), np.int32(i), x)
      je.effects_barrier()

    threads = [threading.Thread(target=work, args=(t,))
               for t in range(N_THREADS)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    je.effects_barrier(all_threads=True)
    expected = (8 + 1) * N * N_THREADS
    assert len(records) == expected, (len(records), expected)
    for t in range(N_THREADS):   # each thread's calls in its program order
      mine = [(seq, dev) for tid, seq, dev in records if tid == t]
      for i in range(N):
        call = mine[9 * i:9 * (i + 1)]
        assert sorted(call[:8]) == [(i, d) for d in range(8)], (t, i, call)
        assert call[8] == (i, -1), (t, i, call)
    print("OK", len(records))
""")


def test_threads_dispatching_over_8_devices_do_not_hang():
  n_threads, n, limit_s = 8, 400, 240
  proc = run_script(SCRIPT, str(n_threads), str(n), str(limit_s),
                    timeout=limit_s + 60)
  assert proc.returncode == 0 and proc.stdout.startswith("OK"), (
      f"rc={proc.returncode} (a hang dumps the stacks):\n"
      f"{proc.stderr[-6000:]}")


FIRST_CALLS = textwrap.dedent("""
    import sys, threading
    import jax
    import jax.numpy as jnp
    import jax_effects as je

    # Two threads' first calls of two fresh single-device functions, whose
    # callbacks (run inline, inside each call) wait for each other: neither
    # call may hold anything the other's dispatch needs.
    a_ran, b_ran, gave_up = threading.Event(), threading.Event(), []

    def in_a(v):
      a_ran.set()
      if not b_ran.wait(20):
        gave_up.append("a")

    def in_b(v):
      b_ran.set()
      if not a_ran.wait(20):
        gave_up.append("b")

    fa = je.jit(lambda x: (je.callback(in_a, None, x), x + 1)[1])
    fb = je.jit(lambda x: (je.callback(in_b, None, x), x + 2)[1])
    ta = threading.Thread(target=lambda: fa(jnp.zeros(3)))
    tb = threading.Thread(target=lambda: fb(jnp.zeros(3)))
    ta.start(); tb.start(); ta.join(); tb.join()
    je.effects_barrier(all_threads=True)
    print("gave up " + " ".join(gave_up) if gave_up else "OK")
""")


def test_first_calls_whose_callbacks_wait_for_each_other_do_not_stall():
  # A first launch (its devices not known yet) must not be serialized: the
  # computation runs inline, and its callback may wait for another thread.
  proc = run_script(FIRST_CALLS, timeout=120)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.split() == ["OK"], proc.stdout


IN_CALLBACK = textwrap.dedent("""
    import sys, threading
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_effects as je
    from jax_effects._runtime import launch_lock

    mesh = jax.make_mesh((8,), ("x",))
    z = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    inner_ran, hosts = [], []

    def inner_body(s):
      je.callback(inner_ran.append, None, s.sum())
      return s + 1

    # Over the 8 devices: its launches take the lock, except in a callback.
    inner = je.jit(jax.shard_map(inner_body, mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x")))

    def host(v):
      hosts.append(threading.current_thread().name)
      inner(z)

    @je.jit
    def outer(v):
      je.callback(host, None, v.sum())
      return v + 1

    slow = jax.jit(lambda a: (a @ a) @ a)
    a = jnp.ones((600, 600)) / 600
    # outer's input is still computed when it is launched: XLA runs it, and
    # host, on one of its threads; 30 calls warm up each such thread's hook.
    for _ in range(30):
      outer(slow(a)[0, :4])
    je.effects_barrier(all_threads=True)
    # Another thread holds the lock until outer's calls have ended.
    release, held, in_time = threading.Event(), threading.Event(), []
    def holder():
      with launch_lock.launch_lock:
        held.set()
        in_time.append(release.wait(float(sys.argv[1])))
    t = threading.Thread(target=holder)
    t.start()
    held.wait()
    for _ in range(10):
      out = outer(slow(a)[0, :4])
    jax.block_until_ready(out)
    release.set()
    t.join()
    je.effects_barrier(all_threads=True)
    on_xla = sum(not name.startswith(("MainThread", "Thread-")) for name in hosts)
    print("in time" if in_time[0] else "the lock was waited for", len(hosts),
          len(inner_ran), on_xla > 0)
""")


def test_a_callback_on_an_xla_thread_never_waits_for_the_launch_lock():
  """A host callback's own call over several devices takes no launch lock
  (its holder may be waiting for the callback's computation), also through
  the fast hook of one of XLA's threads (``ThreadTokens.python_thread``)."""
  limit_s = 20
  proc = run_script(IN_CALLBACK, str(limit_s), timeout=limit_s + 120)
  assert proc.returncode == 0, proc.stderr[-6000:]
  # 40 outer calls, each launching inner once over 8 devices.
  assert proc.stdout.split() == ["in", "time", "40", "320", "True"], proc.stdout
