"""Stress: many Python threads dispatching ordered effects at once, each in its
own order (``design/tokens.md``, "Between computations").

Every worker thread calls two ``jax_effects.jit`` functions alternately; each
call runs one ordered effect recording ``(thread id, sequence number)``. The
sequence numbers are fresh host values, never outputs of the previous call, so
nothing but the runtime token orders two consecutive calls. No thread waits
for its own effects: the only barrier is ``effects_barrier(all_threads=True)``
at the end. Then every record must be present exactly once and each thread's
records must be in its dispatch order.

Default sizes are for CI on 2 cores; the ``slow`` variants (``--run-slow``)
use the full 8 threads x 10,000 effects.
"""
import collections
import threading

import jax
import numpy as np
import pytest

import jax_effects as je
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import threads as _thread_slots
import helpers
from helpers import run_threads

N_THREADS = 8
N_DEFAULT = 1_000
N_SLOW = 10_000
N = helpers.scale(N_DEFAULT, N_SLOW)
JOIN_TIMEOUT_S = 900


class Recorder:
  """Thread-safe list of ``(thread id, seq)`` records from host callbacks."""

  def __init__(self):
    self.lock = threading.Lock()
    self.records = []

  def __call__(self, tid, seq):
    with self.lock:
      self.records.append((int(tid), int(seq)))

  def check(self, expected: dict[int, int]):
    """``expected``: thread id -> number of effects it dispatched."""
    counts = collections.Counter(self.records)
    dup = [r for r, c in counts.items() if c > 1]
    assert not dup, f"records delivered more than once: {dup[:10]}"
    per_thread = collections.defaultdict(list)
    for tid, seq in self.records:
      per_thread[tid].append(seq)
    assert set(per_thread) == set(expected), (
        f"threads seen {sorted(per_thread)}, expected {sorted(expected)}")
    for tid, n in expected.items():
      seqs = per_thread[tid]
      missing = sorted(set(range(n)) - set(seqs))
      assert not missing, f"thread {tid}: {len(missing)} records missing, e.g. {missing[:10]}"
      assert seqs == list(range(n)), (
          f"thread {tid}: records out of dispatch order near "
          f"{next(i for i, s in enumerate(seqs) if s != i)}")
    assert len(self.records) == sum(expected.values())


def make_functions(recorder, effect_f=None, effect_g=None):
  """Two distinct jitted functions, each with one ordered effect."""

  @je.jit
  def f(tid, seq):
    je.callback(recorder, None, tid, seq, effect=effect_f)
    return seq + 1

  @je.jit
  def g(tid, seq):
    je.callback(recorder, None, tid, seq, effect=effect_g)
    return seq * 2

  return f, g


def dispatcher(f, g, tid, n, devices=None, mode=None):
  """A worker: ``n`` calls alternating ``f`` and ``g``, no barrier."""

  def run():
    def arg(x, i):
      x = np.int32(x)
      if devices is None:
        return x
      return jax.device_put(x, devices[i % 2])

    def body():
      for i in range(n):
        (f if i % 2 == 0 else g)(arg(tid, i), arg(i, i))

    if mode is None:
      body()
    else:
      with je.ordering(mode):
        body()
  return run


def _threads_two_functions(n, *, two_devices=False, global_mode=False):
  rec = Recorder()
  if global_mode:  # different effects, one total order per thread
    f, g = make_functions(rec, je.Effect("stress-f"), je.Effect("stress-g"))
  else:
    f, g = make_functions(rec)
  devs = jax.devices()
  targets = []
  for t in range(N_THREADS):
    devices = None
    if two_devices:  # f runs on one device, g on another, per thread
      devices = (devs[(2 * t) % len(devs)], devs[(2 * t + 1) % len(devs)])
    targets.append(dispatcher(f, g, t, n, devices,
                              "global" if global_mode else None))
  # No warm-up: the first calls trace and compile concurrently.
  run_threads(targets)
  je.effects_barrier(all_threads=True)
  rec.check({t: n for t in range(N_THREADS)})


@pytest.mark.parametrize("variant", ["one_device", "two_devices", "global"])
def test_threads_two_functions(variant):
  _threads_two_functions(N, two_devices=variant == "two_devices",
                         global_mode=variant == "global")


def test_threads_two_devices_tokens_follow_the_computation():
  # The two-device variant really runs f and g on different devices: each
  # thread's latest output tokens sit on both of its devices.
  rec = Recorder()
  f, g = make_functions(rec)
  d0, d1 = jax.devices()[2], jax.devices()[5]
  seen = {}

  def run():
    dispatcher(f, g, 0, 4, (d0, d1))()
    seen["devices"] = set(je.runtime_tokens().devices)

  run_threads([run])
  je.effects_barrier(all_threads=True)
  assert seen["devices"] == {d0, d1}
  rec.check({0: 4})


def test_threads_print_lines(effects_capture):
  # The same through jax_effects.print, observed with the capture listener.
  n = N_DEFAULT // 4

  @je.jit
  def f(tid, seq):
    je.print("f {} {}", tid, seq)

  @je.jit
  def g(tid, seq):
    je.print("g {} {}", tid, seq)

  run_threads([dispatcher(f, g, t, n) for t in range(N_THREADS)])
  je.effects_barrier(all_threads=True)
  per_thread = collections.defaultdict(list)
  for line in effects_capture.printed:
    name, tid, seq = line.split()
    assert name == ("f" if int(seq) % 2 == 0 else "g"), line
    per_thread[int(tid)].append(int(seq))
  assert dict(per_thread) == {t: list(range(n)) for t in range(N_THREADS)}


def _churn(n_long, n_short_waves, short_per_wave, n_long_effects,
           n_short_effects):
  """Long-running threads, plus waves of short-lived threads that start and
  exit (with their effects pending, no barrier) while the long ones run, plus
  a thread calling effects_barrier(all_threads=True) all along."""
  rec = Recorder()
  f, g = make_functions(rec)
  expected = {}
  long_threads = []
  for t in range(n_long):
    expected[t] = n_long_effects
    long_threads.append(dispatcher(f, g, t, n_long_effects))

  stop = threading.Event()
  barrier_calls = [0]

  def barrier_loop():
    while not stop.is_set():
      je.effects_barrier(all_threads=True)
      barrier_calls[0] += 1

  def spawner():
    tid = 1000
    for _ in range(n_short_waves):
      wave = []
      for _ in range(short_per_wave):
        expected[tid] = n_short_effects
        wave.append(dispatcher(f, g, tid, n_short_effects))
        tid += 1
      run_threads(wave, start_together=False)

  bl = threading.Thread(target=barrier_loop)
  bl.start()
  try:
    run_threads([*long_threads, spawner])
  finally:
    stop.set()
    bl.join(JOIN_TIMEOUT_S)
  je.effects_barrier(all_threads=True)
  rec.check(expected)
  assert barrier_calls[0] > 0
  # Exited threads are forgotten once a barrier has waited for them.
  je.effects_barrier(all_threads=True)
  with _thread_slots._all_lock:
    states = list(_thread_slots._all_states)
  assert all(s.alive() for s in states)


def test_threads_start_and_exit_while_others_run():
  _churn(n_long=helpers.scale(4, 8), n_short_waves=helpers.scale(4, 10),
         short_per_wave=helpers.scale(4, 8), n_long_effects=N,
         n_short_effects=helpers.scale(N // 10, N // 20))


def test_exited_thread_effects_complete_at_barrier():
  # A thread that exits right after dispatching (nothing waited for) loses
  # nothing: the all-threads barrier of another thread waits for it.
  rec = Recorder()
  f, g = make_functions(rec)
  run_threads([dispatcher(f, g, t, 50) for t in range(N_THREADS)])
  je.effects_barrier(all_threads=True)
  rec.check({t: 50 for t in range(N_THREADS)})
