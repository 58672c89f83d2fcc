"""Mode switches under load, and the soak: threads x calls x faults x mode
switches (``design/errors.md``, "Mode switches").

Per-device (``shard_map`` over 8 devices) calls are asynchronous on CPU, so
a call can still be running when the same thread's next call is dispatched:
that is where a mode switch (a different runtime-token stream) could let the
next call's effects overtake it.
"""
import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_effects as je
from jax_effects._runtime import errors as _errors
import helpers
from helpers import Boom, FailingRecorder, run_threads

N = 8


def Recorder(fail_every=0):
  """Records ``(tid, seq, device)``; raises ``Boom`` on every
  ``fail_every``-th call; calls stay in flight a little."""
  return FailingRecorder(fail_every, delay=0.0005)


def make_functions(rec, mesh, effect=None):
  """A per-device function (8 records per call) and a single one (one
  record, device -1: on one device, or once over several), each
  ``f(tid, seq, x)``."""
  def body(tid, seq, v):
    je.callback(rec, None, tid, seq, jax.lax.axis_index("i"), effect=effect)
    return v
  per_device = je.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(), P(), P("i")), out_specs=P("i")))

  @je.jit
  def single(tid, seq, v):
    je.callback(rec, None, tid, seq, np.int32(-1), effect=effect)
    return v
  return per_device, single


def booms(exc):
  if isinstance(exc, BaseExceptionGroup):
    assert all(isinstance(e, Boom) for e in exc.exceptions), exc
    return list(exc.exceptions)
  assert isinstance(exc, Boom), exc
  return [exc]


def run_load(mesh, *, n_threads, n_calls, n_switches, fail_every, effects):
  """Threads dispatch per-device calls (retrying a call that reported only
  earlier calls' errors: it dispatched nothing) while a switcher flips
  ``set_ordering``; returns (recorder, errors each thread received)."""
  rec = Recorder(fail_every)
  fns = [f for e in effects for f in make_functions(rec, mesh, e)]
  x = jax.device_put(jnp.zeros(N), NamedSharding(mesh, P("i")))
  # each thread's single-device calls run on its own device
  xs = [jax.device_put(jnp.zeros(N), jax.devices()[t % N])
        for t in range(n_threads)]
  caught = {}
  done = threading.Event()
  progress = [0]

  def worker(tid):
    def run():
      got = caught[tid] = []
      for i in range(n_calls):
        while True:
          try:
            fn = fns[i % len(fns)]
            # per-device calls on the 8 devices; single-device ones on the
            # thread's device or, every other time, once over the 8 devices
            fn(np.int32(tid), np.int32(i),
               x if i % 2 == 0 or (i // 2) % 2 else xs[tid])
            progress[0] += 1
            break
          except (Boom, BaseExceptionGroup) as exc:
            errors = booms(exc)
            got.extend(errors)
            if any(e.args[0][1] == i for e in errors):
              break   # its own error: the call ran (up to the failure)
            # else it reported earlier calls' errors and dispatched nothing
      while True:
        try:
          je.effects_barrier()
          break
        except (Boom, BaseExceptionGroup) as exc:
          got.extend(booms(exc))
    return run

  def switcher():
    modes = ["global", "per_effect"]
    for k in range(n_switches):
      seen = progress[0]
      while progress[0] == seen and not done.is_set():
        time.sleep(0.001)    # a switch lands between calls of the load
      je.set_ordering(modes[k % 2])
    je.set_ordering("per_effect")

  sw = threading.Thread(target=switcher)
  sw.start()
  try:
    run_threads([worker(t) for t in range(n_threads)])
  finally:
    done.set()
    sw.join(120)
  je.set_ordering("per_effect")
  je.effects_barrier(all_threads=True)
  return rec, caught


def check(rec, caught, n_threads, n_calls):
  # Every failure reached its own thread, as itself, once.
  for tid, excs in caught.items():
    assert len({id(e) for e in excs}) == len(excs), f"thread {tid}: twice"
    for exc in excs:
      assert exc.args[0][0] == tid, f"thread {tid} got {exc.args[0]}'s error"
      assert rec.raised[exc.args[0]] is exc
  reported = {e.args[0] for excs in caught.values() for e in excs}
  assert reported == set(rec.raised)
  # Nothing lost or duplicated: every (call, device) ran once, or failed once.
  keys = collections.Counter(rec.records)
  assert all(c == 1 for c in keys.values()), "a record was delivered twice"
  expected = {(t, i, d) for t in range(n_threads) for i in range(n_calls)
              for d in (range(N) if i % 2 == 0 else [-1])}
  assert set(rec.records) | set(rec.raised) == expected
  assert not set(rec.records) & set(rec.raised)
  # Order: each thread's calls in dispatch order (one stream per thread:
  # DEFAULT in per-effect mode, GLOBAL in global mode, across the switches);
  # a call's per-device records may interleave among themselves only.
  per = collections.defaultdict(list)
  for t, i, d in rec.records:
    per[t].append(i)
  inversions = {t: [(a, b) for a, b in zip(v, v[1:]) if a > b]
                for t, v in per.items() if v != sorted(v)}
  assert not inversions, f"out of order across mode switches: {inversions}"
  assert not _errors.deferred


def test_set_ordering_under_load_keeps_every_threads_order(mesh):
  rec, caught = run_load(mesh, n_threads=4, n_calls=60, n_switches=20,
                         fail_every=0, effects=[None])
  check(rec, caught, 4, 60)
  assert not rec.raised


def test_faults_and_mode_switches_under_load(mesh):
  # The soak: threads x calls x faults x mode switches (--run-slow: larger).
  n_threads, n_calls = helpers.scale(4, 8), helpers.scale(60, 600)
  rec, caught = run_load(mesh, n_threads=n_threads, n_calls=n_calls,
                         n_switches=helpers.scale(10, 200),
                         fail_every=helpers.scale(37, 97), effects=[None])
  assert rec.raised
  check(rec, caught, n_threads, n_calls)
