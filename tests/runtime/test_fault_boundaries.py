"""Faults at the process boundaries and in ``deterministic()``.

One test (or a few) per case of ``design/errors.md`` ("Fork", "The
deterministic view: failing streams, leaving on an exception", "Interpreter
exit", "Plain ``jax.jit``: what it can and cannot promise"):
fork, a failing output stream in the deterministic view, leaving the view on
an exception, effects dispatched by late exit handlers, plain ``jax.jit``
callbacks that run on XLA's threads, and reported errors being freed. Where
fork or the exit status is at stake the program runs in a subprocess
(``helpers.run_script``), bounded in time. The launcher's listeners: in
``tests/tools/test_multiprocess_port.py``.
"""
import gc
import json
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_effects as je
from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import errors as _errors

from helpers import (PRELUDE_8_DEVICES, flat, in_thread, reports,
                     run_script, sharded)

N = 8


class UserError(Exception):
  pass


class SinkError(Exception):
  pass



# --- 1. fork ----------------------------------------------------------------------

FORK_AFTER_FAILURES = PRELUDE_8_DEVICES + """
import atexit, json, os, signal, sys
from jax_effects._runtime import barrier

def boom(v):
  raise ValueError(f"device {int(v[0])}")

f = je.jit(jax.shard_map(lambda v: (je.callback(boom, None, v), v)[1],
                         mesh=mesh, in_specs=P("i"), out_specs=P("i")))
g = je.jit(lambda v: (je.print("g {}", v), v + 1)[1])
g(np.int32(0))          # compiled and dispatched in the parent (fast path)
f(x)
barrier.wait_for_thread()   # the 8 errors are deferred, none reported yet
sys.stdout.flush()
pid = os.fork()
if pid == 0:
  signal.alarm(60)   # JAX's computations hang after a fork: never wait forever
  seen = {}
  try:
    je.effects_barrier(all_threads=True)
    seen["barrier"] = "nothing"
  except BaseException as e:
    seen["barrier"] = repr(e)[:300]
  for name, fn in (("known", g), ("new", je.jit(lambda v: (je.print("n {}", v), v)[1]))):
    try:
      fn(np.int32(1))
      seen[name] = "ran"
    except RuntimeError as e:
      seen[name] = str(e)
  print("CHILD " + json.dumps(seen), flush=True)
  # The exit handlers as at exit; then os._exit: a forked JAX child's own
  # interpreter teardown crashes or hangs inside XLA, jax_effects or not.
  atexit._run_exitfuncs()
  os._exit(0)
_, status = os.waitpid(pid, 0)
print("CHILD STATUS", os.waitstatus_to_exitcode(status), flush=True)
try:
  je.effects_barrier()
  print("PARENT nothing", flush=True)
except ExceptionGroup as e:
  print("PARENT", json.dumps(sorted(str(x) for x in e.exceptions)), flush=True)
je.effects_barrier()
print("PARENT clean", flush=True)
"""


def test_forked_child_inherits_no_errors_and_refuses_computations_clearly():
  proc = run_script(FORK_AFTER_FAILURES, timeout=240)
  lines = proc.stdout.splitlines()
  child = json.loads(next(l for l in lines if l.startswith("CHILD {"))[6:])
  # The child starts clean: nothing of the parent's is reported there ...
  assert child["barrier"] == "nothing", child
  # ... and a computation is refused with an error naming the fork (JAX's
  # runtime does not survive it), for a function the parent compiled and a
  # new one alike, instead of hanging.
  for name in ("known", "new"):
    assert "fork" in child[name] and "spawn" in child[name], child
  assert "CHILD STATUS 0" in lines, proc.stdout + proc.stderr[-3000:]
  assert "ValueError" not in proc.stderr.split("CHILD")[0], proc.stderr[-3000:]
  # The parent reports its 8 errors once.
  parent = json.loads(next(l for l in lines if l.startswith("PARENT ["))[7:])
  assert parent == [f"device {i}" for i in range(N)]
  assert lines[-1] == "PARENT clean"
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "host callback" not in proc.stderr


FORK_BEFORE_THE_BACKEND = """
import jax
import numpy as np
import os, signal, sys
import jax_effects as je

f = je.jit(lambda v: (je.print("{} {}", v, v * 2), v + 1)[1])
sys.stdout.flush()
pid = os.fork()   # no computation yet: JAX's backend starts in each process
who = "child" if pid == 0 else "parent"
if pid == 0:
  signal.alarm(60)
f(np.int32(1 if pid == 0 else 2))
je.effects_barrier()
if pid == 0:
  sys.stdout.write("child done\\n")   # (one write: the two processes share
  sys.stdout.flush()                  # the pipe)
  os._exit(0)
_, status = os.waitpid(pid, 0)
print("parent done", flush=True)
print("child status", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_child_forked_before_any_computation_uses_jax_effects_normally():
  proc = run_script(FORK_BEFORE_THE_BACKEND, timeout=240)
  lines = proc.stdout.splitlines()
  assert "1 2" in lines and "child done" in lines, proc.stderr[-3000:]
  assert "2 4" in lines and "parent done" in lines, proc.stderr[-3000:]
  assert "child status 0" in lines
  assert proc.returncode == 0, proc.stderr[-3000:]


# --- 2. deterministic() with a failing output stream -------------------------------

class FailingStream:
  """A ``sys.stdout`` whose ``write`` raises for lines containing ``bad``."""

  def __init__(self, bad):
    self.bad = bad
    self.lines = []
    self.raised = []

  def write(self, s):
    if self.bad in s:
      self.raised.append(SinkError(s))
      raise self.raised[-1]
    self.lines.extend(s.splitlines())

  def flush(self):
    pass


@pytest.mark.parametrize("released_by", ["combine", "once_effect"])
def test_deterministic_failing_stream_loses_no_other_line(mesh, monkeypatch,
                                                          released_by):
  # 8 devices x 3 lines, held; the stream raises for device 3's second line.
  # Every other line is delivered in the view's order, and the caller gets
  # the stream's exception once, as itself.
  def body(v):
    for k in range(3):
      je.print("v={} k={}", v[0], k)
    return v

  step = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  if released_by == "combine":   # released by the combination of the token
    f = je.jit(step)
  else:   # released inside the host callback of the once effect after it
    f = je.jit(lambda v: (lambda y: (je.print("after"), y)[1])(step(v)))
  x = sharded(mesh, jnp.arange(N, dtype=jnp.int32))
  stream = FailingStream("v=3 k=1")
  monkeypatch.setattr("sys.stdout", stream)

  def run():
    with je.deterministic():
      f(x)

  got = reports(run)
  monkeypatch.undo()
  expected = [f"[device {d} shard {d} process 0] v={d} k={k}"
              for k in range(3) for d in range(N) if (d, k) != (3, 1)]
  if released_by == "once_effect":
    expected.append("after")
  assert stream.lines == expected
  assert len(stream.raised) == 1
  assert len(got) == 1 and got[0] is stream.raised[0], got
  assert not _errors.deferred


# --- 3. leaving deterministic() on an exception ----------------------------------

def test_exception_leaving_deterministic_propagates_unchanged(mesh):
  def boom(v):
    raise UserError(f"callback {int(v[0])}")

  f = je.jit(jax.shard_map(lambda v: (je.callback(boom, None, v), v)[1],
                           mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  x = sharded(mesh, jnp.arange(N, dtype=jnp.int32))
  mine = KeyError("the block's own")
  with pytest.raises(KeyError) as info:
    with je.deterministic():
      f(x)
      _barrier.wait_for_thread()   # the callbacks' errors are pending now
      raise mine
  assert info.value is mine
  assert info.value.__context__ is None and info.value.__cause__ is None
  # The pending callback errors: raised by the thread's next barrier, once.
  got = reports(lambda: None)
  assert len(got) == 1
  assert sorted(str(e) for e in flat(got[0])) == [
      f"callback {i}" for i in range(N)]


def test_exception_leaving_ordering_propagates_unchanged_too(mesh):
  # The same rule as ordering(), which the contract compares it with.
  def boom(v):
    raise UserError("callback")

  f = je.jit(jax.shard_map(lambda v: (je.callback(boom, None, v), v)[1],
                           mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  x = sharded(mesh, jnp.arange(N, dtype=jnp.int32))
  mine = KeyError("own")
  with pytest.raises(KeyError) as info:
    with je.ordering("global"):
      f(x)
      _barrier.wait_for_thread()
      raise mine
  assert info.value is mine and info.value.__context__ is None
  got = reports(lambda: None)
  assert [len(flat(r)) for r in got] == [N]


# --- 4. errors of effects dispatched by late exit handlers ----------------------

LATE_EXIT_HANDLER = """
import atexit
def late():   # registered before jax_effects is imported: runs after its handler
  f(x)
  print("late handler done", flush=True)
atexit.register(late)
""" + PRELUDE_8_DEVICES + """
def boom(v):
  if int(v[0]) % 2:
    raise ValueError(f"late {int(v[0])}")
f = je.jit(jax.shard_map(lambda v: (je.callback(boom, None, v), v)[1],
                         mesh=mesh, in_specs=P("i"), out_specs=P("i")))
print("main done", flush=True)
"""


def test_errors_of_effects_dispatched_by_late_exit_handlers_fail_the_exit():
  proc = run_script(LATE_EXIT_HANDLER)
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  # (the late call reports and ends the process: nothing runs after it)
  assert proc.stdout.splitlines() == ["main done"]
  assert "4 host callbacks failed" in proc.stderr, proc.stderr[-3000:]
  assert "Traceback" in proc.stderr
  for i in (1, 3, 5, 7):
    assert f"ValueError: late {i}" in proc.stderr


def test_exit_report_counts_what_failed():
  proc = run_script(PRELUDE_8_DEVICES + """
def boom(v):
  if int(v[0]) < 4:
    raise ValueError(f"pending {int(v[0])}")
f = je.jit(jax.shard_map(lambda v: (je.callback(boom, None, v), v)[1],
                         mesh=mesh, in_specs=P("i"), out_specs=P("i")))
f(x)
""")
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  assert "jax_effects: 4 host callbacks failed" in proc.stderr, proc.stderr
  assert "a host callback failed" not in proc.stderr
  for i in range(4):
    assert f"ValueError: pending {i}" in proc.stderr


# --- 5. plain jax.jit: a callback on one of XLA's threads -------------------------

def test_plain_jit_error_of_an_xla_thread_never_reaches_another_threads_barrier():
  # A worker dispatches a plain jax.jit computation whose input is not ready
  # (it waits for a callback of JAX's own that the main thread releases), so
  # its callback runs on one of XLA's threads, not the worker's: nothing
  # there says which thread dispatched it (design/errors.md, "Plain
  # jax.jit"). The error must not be raised by another thread's barrier or
  # call (before: the main thread's barrier raised it); it is reported once,
  # by the all-threads barrier.
  release = threading.Event()
  dispatched = threading.Event()
  failed = threading.Event()
  main_done = threading.Event()
  ran_on = []

  def wait(v):
    assert release.wait(120)
    return v

  def boom(v):
    ran_on.append(threading.current_thread())
    failed.set()
    raise UserError(f"async {int(v)}")

  slow = jax.jit(lambda y: lax.fori_loop(0, 100, lambda k, z: jnp.tanh(z @ z),
                                         y)[0, 0])
  gate = jax.jit(lambda s: jax.pure_callback(
      wait, jax.ShapeDtypeStruct((), jnp.int32),
      (s * 0).astype(jnp.int32) + 7))
  g = jax.jit(lambda v: (je.callback(boom, None, v), v + 1)[1])
  big = jnp.ones((256, 256)) * 0.01
  release.set()
  gate(slow(big)).block_until_ready()   # compiled before the race
  release.clear()
  worker_saw = []

  def worker():
    g(gate(slow(big)))   # the callback waits for `gate`, released by main
    dispatched.set()
    assert main_done.wait(180)
    worker_saw.extend(reports(lambda: None))

  t = threading.Thread(target=worker)
  t.start()
  assert dispatched.wait(180)
  release.set()
  assert failed.wait(180)
  main_saw = reports(lambda: je.jit(lambda v: v + 1)(jnp.int32(1)))
  main_done.set()
  t.join(180)
  assert ran_on and ran_on[0] is not t   # (on one of XLA's threads)
  assert ran_on[0] is not threading.current_thread()
  assert main_saw == [] and worker_saw == []
  with pytest.raises(UserError, match="async 7"):
    je.effects_barrier(all_threads=True)
  je.effects_barrier(all_threads=True)   # once


def test_plain_jit_inline_error_reaches_a_thread_new_to_jax_effects():
  # A thread whose first use of jax_effects is a plain jax.jit call with
  # ready inputs: the callback runs on it (inline), so the error is that
  # thread's, raised by its barrier, not left for the all-threads one.
  def boom(v):
    raise UserError(f"inline {int(v)}")

  g = jax.jit(lambda v: (je.callback(boom, None, v), v + 1)[1])
  g(jnp.int32(0))   # compiled; reported below
  with pytest.raises(UserError):
    je.effects_barrier(all_threads=True)
  got = in_thread(lambda: [str(e) for e in reports(lambda: g(jnp.int32(5)))])
  assert got == ["inline 5"]
  je.effects_barrier(all_threads=True)   # nothing left


# --- 6. reported errors are freed ------------------------------------------------

class Payload(Exception):
  """A callback error holding 1 MiB."""

  def __init__(self, i):
    super().__init__(i)
    self.data = bytearray(1 << 20)


def test_reported_errors_are_freed_without_the_garbage_collector(mesh):
  # 50 reported errors through each way a report is raised: the call itself
  # (inline), the next barrier (deferred, several at once: a group), an eager
  # effect, plain jax.jit. Once the caller drops them nothing may keep them
  # alive: with the collector off, a reference cycle through a raising frame
  # would keep every one (50 MiB).
  refs = []

  def made(exc):
    refs.append(weakref.ref(exc))
    return exc

  def host(v):   # (holds no reference itself: no cycle of the test's own)
    raise made(Payload(int(np.asarray(v).ravel()[0])))

  inline = je.jit(lambda v: (je.callback(host, None, v), v)[1])
  per_device = je.jit(jax.shard_map(
      lambda v: (je.callback(host, None, v), v)[1], mesh=mesh,
      in_specs=P("i"), out_specs=P("i")))
  plain = jax.jit(lambda v: (je.callback(host, None, v), v)[1])
  x = sharded(mesh, jnp.arange(N, dtype=jnp.int32))
  calls = [lambda i: inline(jnp.int32(i)),
           lambda i: per_device(x + i),
           lambda i: je.callback(host, None, jnp.int32(i)),
           lambda i: plain(jnp.int32(i))]
  def reported(call):
    """How many reports ``call()`` and the barriers after it raised (caught
    unbound: this test's frames keep no reference either)."""
    n = 0
    try:
      call()
    except BaseException:  # noqa: BLE001
      n += 1
    for _ in range(10):
      try:
        je.effects_barrier()
        return n
      except BaseException:  # noqa: BLE001
        n += 1
    raise AssertionError("barriers keep raising")

  for call in calls:   # compiled and reported once before counting
    reported(lambda: call(0))
  refs.clear()
  gc.collect()
  gc.disable()
  try:
    for i in range(50):
      assert reported(lambda: calls[i % 4](i)) == 1, i
    alive = sum(r() is not None for r in refs)
  finally:
    gc.enable()
  assert len(refs) == 13 * 1 + 13 * N + 12 + 12
  assert alive == 0, f"{alive} of {len(refs)} reported errors are still alive"
