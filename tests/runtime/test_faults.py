"""Faults under load: callbacks that raise while many threads dispatch
(``design/errors.md``, "Who raises a callback's error, when, how often").

A host callback raises ``Boom`` on every 97th call (a global call counter, so
failures land on all threads at unpredictable points). Checked:

* each failure reaches the thread that dispatched it, as the very exception
  object the callback raised, exactly once (at the failing call, a later call
  or that thread's ``effects_barrier()``);
* no other thread sees it, and a final ``effects_barrier(all_threads=True)``
  has nothing left to report;
* every record whose callback did not raise is delivered, once, in each
  thread's dispatch order: the calls after a failure work.

The same runs inside ``shard_map`` over 8 devices (per-device effects), from
one dispatching thread (with and without a barrier after every call) and from
four: an error of a device's callback cannot fail the computation, so it is
raised by the dispatching thread's call (or a later one, or its barrier:
each raise reports one error).
"""
import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_effects as je
from jax_effects._runtime import errors as _errors
import helpers
from helpers import Boom, FailingRecorder, run_threads

N_THREADS = 8
N_DEFAULT = 1_000
N_SLOW = 10_000
N = helpers.scale(N_DEFAULT, N_SLOW)
FAIL_EVERY = 97


def _booms(exc):
  """The Boom errors of one report (an error itself, or a group of them)."""
  if isinstance(exc, BaseExceptionGroup):
    assert all(isinstance(e, Boom) for e in exc.exceptions), exc.exceptions
    return list(exc.exceptions)
  return [exc]


def worker(call, tid, n, caught, retry_deferred=False):
  """Dispatches ``n`` calls; collects every Boom this thread receives.

  ``retry_deferred``: a call that raises only earlier calls' errors raised
  them before dispatching anything (design/errors.md): it is retried, and
  its effects run once. (Keys are ``(tid, seq, ...)``.)
  """

  def run():
    got = caught[tid] = []
    for i in range(n):
      while True:
        try:
          call(i, np.int32(tid), np.int32(i))
        except (Boom, BaseExceptionGroup) as exc:
          errors = _booms(exc)
          got.extend(errors)
          if retry_deferred and all(e.args[0][1] != i for e in errors):
            continue   # only earlier calls' errors: this one never ran
        break
    while True:   # until a barrier has nothing left to report
      try:
        je.effects_barrier()
        break
      except (Boom, BaseExceptionGroup) as exc:
        got.extend(_booms(exc))
  return run


def check(rec: FailingRecorder, caught: dict, expected_keys, tid_of):
  """All checks of the module docstring.

  ``expected_keys``: every key a callback was asked to record.
  ``tid_of(key)``: the thread that dispatched ``key``.
  """
  je.effects_barrier(all_threads=True)   # nothing left to report
  assert rec.raised, "the load did not trigger any failure"
  # Each failure reached its own thread, as itself, once.
  for tid, excs in caught.items():
    ids = collections.Counter(id(e) for e in excs)
    assert all(c == 1 for c in ids.values()), f"thread {tid} got an error twice"
    for exc in excs:
      key = exc.args[0]
      assert tid_of(key) == tid, f"thread {tid} received {key}'s error"
      assert rec.raised[key] is exc, f"thread {tid} got a copy of {key}'s error"
  reported = {e.args[0] for excs in caught.values() for e in excs}
  assert reported == set(rec.raised), (
      f"failures never reported: {sorted(set(rec.raised) - reported)[:10]}")
  # Every other record delivered, once, in order.
  counts = collections.Counter(rec.records)
  assert all(c == 1 for c in counts.values()), "a record was delivered twice"
  assert set(rec.records) == set(expected_keys) - set(rec.raised)
  assert len(rec.records) + len(rec.raised) == len(expected_keys)
  per_stream = collections.defaultdict(list)
  for key in rec.records:
    per_stream[(key[0], *key[2:])].append(key[1])
  for stream, seqs in per_stream.items():
    assert seqs == sorted(seqs), f"stream {stream} out of dispatch order"
  # Nothing is left pending: every error was reported.
  leftover = [e for errs in list(_errors.deferred.values()) for e in errs
              if isinstance(e, Boom)]
  assert not leftover


def _faults_threads(n):
  rec = FailingRecorder(FAIL_EVERY)

  @je.jit
  def f(tid, seq):
    je.callback(rec, None, tid, seq)
    return seq + 1

  @je.jit
  def g(tid, seq):
    je.callback(rec, None, tid, seq)
    return seq - 1

  def call(i, tid, seq):
    return (f if i % 2 == 0 else g)(tid, seq)

  caught = {}
  run_threads([worker(call, t, n, caught) for t in range(N_THREADS)])
  keys = [(t, i) for t in range(N_THREADS) for i in range(n)]
  check(rec, caught, keys, tid_of=lambda key: key[0])
  return len(rec.raised)


def test_callback_errors_under_thread_load():
  assert _faults_threads(N) == N_THREADS * N // FAIL_EVERY


def test_error_is_raised_once_and_next_calls_work():
  # Single thread, exact positions: the failing call raises the original
  # exception (with the callback's frame in its traceback); later calls and a
  # barrier raise nothing; effects before and after are delivered in order.
  rec = FailingRecorder(3)

  @je.jit
  def f(seq):
    je.callback(rec, None, np.int32(0), seq)
    return seq

  caught = []
  for i in range(9):
    try:
      f(np.int32(i))
    except Boom as exc:
      caught.append(exc)
  try:
    je.effects_barrier()
  except Boom as exc:
    caught.append(exc)
  je.effects_barrier(all_threads=True)
  assert [e.args[0] for e in caught] == [(0, 2), (0, 5), (0, 8)]
  assert all(rec.raised[e.args[0]] is e for e in caught)
  assert any(fr.name == "__call__" and fr.filename == helpers.__file__
             for fr in _frames(caught[0].__traceback__))   # the recorder's
  assert rec.records == [(0, i) for i in (0, 1, 3, 4, 6, 7)]


def _frames(tb):
  import traceback
  return traceback.extract_tb(tb)


def test_error_does_not_leak_into_other_effect_streams():
  # A failure on one named effect leaves another named effect's stream and
  # another thread's stream untouched.
  rec = FailingRecorder(4)
  other = []

  @je.jit
  def f(seq):
    je.callback(rec, None, np.int32(0), seq, effect=je.Effect("faulty"))
    je.callback(lambda s: other.append(int(s)), None, seq,
                effect=je.Effect("healthy"))
    return seq

  caught = []
  for i in range(8):
    try:
      f(np.int32(i))
    except Boom as exc:
      caught.append(exc.args[0])
  je.effects_barrier()
  assert caught == [(0, 3), (0, 7)]
  assert rec.records == [(0, i) for i in (0, 1, 2, 4, 5, 6)]
  # The healthy callback of a failed computation may or may not have run
  # (same computation); every other one ran, in order.
  assert [s for s in other if s not in (3, 7)] == [0, 1, 2, 4, 5, 6]
  assert other == sorted(other)


# --- inside shard_map on 8 devices ----------------------------------------------

def _mesh():
  return jax.make_mesh((8,), ("x",))


def _faults_shard_map(n, *, barrier_each_call, n_threads=1):
  mesh = _mesh()
  rec = FailingRecorder(FAIL_EVERY)

  @je.jit
  def f(tid, seq, x):
    def body(tid, seq, xs):
      je.callback(rec, None, tid, seq, jax.lax.axis_index("x"))
      return xs + 1
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("x")),
                         out_specs=P("x"))(tid, seq, x)

  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))

  def call(i, tid, seq):
    out = f(tid, seq, x)   # raises only earlier calls' errors, undispatched
    if barrier_each_call:   # this call's errors: not a reason to retry it
      try:
        je.effects_barrier()
      except (Boom, BaseExceptionGroup) as exc:
        caught[int(tid)].extend(_booms(exc))
    return out

  caught = {}
  run_threads([worker(call, t, n, caught, retry_deferred=True)
                for t in range(n_threads)])
  keys = [(t, i, d) for t in range(n_threads) for i in range(n)
          for d in range(8)]
  check(rec, caught, keys, tid_of=lambda key: key[0])


def test_callback_errors_in_shard_map_barrier_each_call():
  # 8 devices, one failing device callback every 97 calls; a barrier after
  # every call: each error is raised once, the other devices' records and
  # the later calls are all delivered, in order per device.
  _faults_shard_map(N // 8, barrier_each_call=True)


def test_callback_errors_in_shard_map_under_load():
  _faults_shard_map(N_DEFAULT // 8, barrier_each_call=False)


def test_callback_errors_in_shard_map_under_thread_load():
  _faults_shard_map(N_DEFAULT // 8, barrier_each_call=False, n_threads=4)
