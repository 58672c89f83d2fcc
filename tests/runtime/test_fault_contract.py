"""The error and lifecycle contract (``design/errors.md``).

One test (or a few) per case it states; where a hang, an abort or the exit
status is at stake, the program runs in a subprocess with a time limit.
"""
import functools
import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_effects as je
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import output as _output
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import token_store as _token_store
from jax_effects._runtime import threads as _thread_slots

import helpers
from helpers import flat, reports, sharded

N = 8


class UserError(Exception):
  pass


class Hostile(Exception):
  """An exception whose ``__str__`` and ``__repr__`` raise."""

  def __str__(self):
    raise RuntimeError("Hostile.__str__ raised")

  def __repr__(self):
    raise RuntimeError("Hostile.__repr__ raised")



def wait_for_dispatched():
  """Blocks on this thread's tokens without reporting anything."""
  _barrier.wait_for_thread()


run_script = functools.partial(helpers.run_script, timeout=120)


PRELUDE = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_effects as je
mesh = Mesh(np.array(jax.devices()), ("i",))
x = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P("i")))
"""


# --- 1. exceptions whose __str__/__repr__ raise ---------------------------------

def test_hostile_exception_single_device_reaches_caller_as_itself():
  raised = []

  def host(v):
    raised.append(Hostile())
    raise raised[-1]

  f = je.jit(lambda x: (je.callback(host, None, x), x + 1)[1])
  before = sum(map(len, _errors.deferred.values()))
  got = reports(lambda: f(jnp.int32(1)))   # at the call, or the barrier
  assert len(got) == 1 and got[0] is raised[0]
  assert sum(map(len, _errors.deferred.values())) == before   # nothing kept


def test_hostile_exception_on_one_device_with_a_collective_never_aborts():
  # One device raises before a psum: the other 7 must not wait forever (the
  # process aborted after ~60 s); the caller gets the very exception object.
  proc = run_script(PRELUDE + """
class Hostile(Exception):
  def __str__(self): raise RuntimeError("str")
  def __repr__(self): raise RuntimeError("repr")
raised = []
def host(v):
  if int(v[0]) == 3:
    raised.append(Hostile())
    raise raised[-1]
def body(v):
  je.callback(host, None, v)
  return jax.lax.psum(v, "i")
f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))
out = f(x)
try:
  je.effects_barrier()
  print("NOT RAISED")
except Hostile as exc:
  print("SAME" if exc is raised[0] else "COPY")
je.effects_barrier()
print("sum", int(out[0]))
""", timeout=100)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["SAME", "sum", "28"], proc.stdout


# --- 6. errors of one execution reported together, once; bounded --------------

def test_every_device_failing_every_call_is_one_report_per_execution(mesh):
  calls = 40
  raised = []
  lock = threading.Lock()

  def boom(v):
    exc = UserError(int(v[0]))
    with lock:
      raised.append(exc)
    raise exc

  f = je.jit(jax.shard_map(lambda v: (je.callback(boom, None, v), v)[1],
                           mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  x = sharded(mesh, jnp.arange(N, dtype=jnp.int32))
  got = []
  ran = 0
  for _ in range(calls):
    try:
      f(x)
      ran += 1
    except BaseException as exc:  # noqa: BLE001
      got.append(exc)
  got += reports(lambda: None)
  # Every report holds whole executions (8 errors each, one per device),
  # kept or counted (a report keeps at most MAX_KEPT_ERRORS: under heavy load
  # several executions can fail before the thread's next call sees one).
  errors = [e for r in got for e in flat(r)]
  dropped = sum(getattr(r, "jax_effects_dropped", 0) for r in got)
  # (a call that raised its own errors ran too: they ran inline in it)
  assert len(raised) % N == 0 and ran <= len(raised) // N <= calls
  assert all((len(flat(r)) + getattr(r, "jax_effects_dropped", 0)) % N == 0
             for r in got)
  assert all(isinstance(r, ExceptionGroup) for r in got)
  # Each error once, as itself; nothing left behind.
  assert len({id(e) for e in errors}) == len(errors)
  assert {id(e) for e in errors} <= {id(e) for e in raised}
  assert len(errors) + dropped == len(raised)
  assert not _errors.deferred and not _errors._dropped
  je.effects_barrier(all_threads=True)


def test_error_backlog_is_bounded_whatever_the_error_rate(mesh):
  # 100 effects (separate chains) fail on 8 devices in one execution: 800
  # errors, at most MAX_KEPT_ERRORS kept, the rest counted.
  effects = [je.Effect(f"backlog-{i}") for i in range(100)]

  def boom(v):
    raise UserError(int(v[0]))

  def body(v):
    for e in effects:
      je.callback(boom, None, v, effect=e)
    return v

  f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  x = sharded(mesh, jnp.arange(N, dtype=jnp.int32))
  got = reports(lambda: f(x))
  assert len(got) == 1
  group = got[0]
  kept = _errors.MAX_KEPT_ERRORS
  assert len(group.exceptions) == kept
  assert group.jax_effects_dropped == 100 * N - kept
  assert f"{100 * N - kept} more" in str(group)
  assert not _errors.deferred and not _errors._dropped


# --- 7. a deferred error never costs another call's result ----------------------

def test_no_effect_runs_after_a_failed_callback_of_its_chain(mesh,
                                                             effects_capture):
  def fail_on_3(v):
    if int(v[0]) == 3:
      raise UserError("device 3")
    return v

  def body(v):
    y = je.callback(fail_on_3, jax.ShapeDtypeStruct((1,), jnp.int32), v)
    je.print("y={}", y)                 # on device 3: would print y=[0]
    return y

  def f(x):
    y = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
    je.print("total={}", y.sum())       # after the devices: would use the 0
    return y

  x = sharded(mesh, jnp.array([10, 11, 12, 3, 14, 15, 16, 17], jnp.int32))
  got = reports(lambda: je.jit(f)(x))
  assert [str(e) for r in got for e in flat(r)] == ["device 3"]
  lines = effects_capture.printed
  assert sorted(lines) == sorted(
      f"[device {d} shard {d} process 0] y=[{v}]"
      for d, v in enumerate([10, 11, 12, 3, 14, 15, 16, 17]) if d != 3)
  assert not any("total" in line for line in lines)
  assert not any("y=[0]" in line for line in lines)


def test_deferred_error_is_raised_before_the_next_call_dispatches(
    mesh, effects_capture):
  def boom(v):
    if int(v[0]) == 5:
      raise UserError("five")

  bad = je.jit(jax.shard_map(lambda v: (je.callback(boom, None, v), v)[1],
                             mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  counter = []
  good = je.jit(lambda x: (je.callback(counter.append, None, x), x + 1)[1],
                )
  bad(sharded(mesh, jnp.arange(N, dtype=jnp.int32)))
  wait_for_dispatched()        # the failure has been filed
  with pytest.raises(UserError, match="five"):
    good(jnp.int32(7))          # raised before good dispatched anything
  assert counter == []
  assert int(good(jnp.int32(7))) == 8    # the retry runs its effects once
  je.effects_barrier()
  assert [int(c) for c in counter] == [7]


def _first_effect_at_top(fail, record):
  def f(x):
    je.callback(fail, None, x)
    je.callback(record, None, x)
    return x + 1
  return f


def _first_effect_in_loop(fail, record):
  def f(x):
    def body(i, c):
      je.callback(fail, None, c)
      je.callback(record, None, c)
      return c + 1
    return lax.fori_loop(0, 2, body, x)
  return f


def _first_effect_in_cond(fail, record):
  def f(x):
    def yes(v):
      je.callback(fail, None, v)
      je.callback(record, None, v)
      return v + 1
    return lax.cond(x >= 0, yes, lambda v: v - 1, x)
  return f


def _first_effect_in_shard_map(mesh):
  def make(fail, record):
    def body(v):
      je.callback(fail, None, v)
      je.callback(record, None, v)
      return v + 1
    return jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  return make


@pytest.mark.parametrize("where", ["top", "loop", "cond", "shard_map"])
def test_a_failed_execution_never_skips_a_later_executions_effects(mesh, where):
  # A failed effect marks its chain's carrier FAILED (the rest of that
  # execution's chain is skipped) and the mark may leave in the returned
  # token; the next execution must run all its effects, wherever the chain's
  # first effect is (design/errors.md).
  make = {"top": _first_effect_at_top, "loop": _first_effect_in_loop,
          "cond": _first_effect_in_cond,
          "shard_map": _first_effect_in_shard_map(mesh)}[where]
  failing = [True]
  ran = []

  def fail(v):
    if failing[0]:
      raise UserError("first call")

  def record(v):
    ran.append(np.asarray(v).tolist())

  f = je.jit(make(fail, record))
  x = (sharded(mesh, jnp.arange(N, dtype=jnp.int32)) if where == "shard_map"
       else jnp.int32(1))
  got = reports(lambda: f(x))
  assert got and all(isinstance(e, UserError) for r in got for e in flat(r))
  assert ran == []            # skipped after the failure, in that execution
  failing[0] = False
  f(x)
  f(x)
  je.effects_barrier()
  per_call = {"top": [1], "loop": [1, 2], "cond": [1],
              "shard_map": [[i] for i in range(N)]}[where]
  if where == "shard_map":
    assert sorted(ran) == sorted(per_call * 2)
  else:
    assert ran == per_call * 2


# --- 3. ordered=False per-device errors reach the dispatching thread -------------

def test_unordered_per_device_error_reaches_its_own_thread_only(mesh):
  def boom(v):
    if int(v[0]) == 2:
      raise UserError("unordered two")

  f = je.jit(jax.shard_map(
      lambda v: (je.callback(boom, None, v, ordered=False), v)[1],
      mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  x = sharded(mesh, jnp.arange(N, dtype=jnp.int32))
  dispatched = threading.Event()
  other_done = threading.Event()
  other_saw = []

  def other():
    dispatched.wait(60)
    try:
      je.effects_barrier()        # another thread's barrier: not its error
    except BaseException as exc:  # noqa: BLE001
      other_saw.append(exc)
    other_done.set()

  t = threading.Thread(target=other)
  t.start()
  f(x)
  wait_for_dispatched()
  dispatched.set()
  other_done.wait(60)
  t.join(60)
  assert other_saw == []
  got = reports(lambda: None)
  assert [str(e) for r in got for e in flat(r)] == ["unordered two"]


# --- 10. errors under plain jax.jit and eager control flow -----------------------

def test_plain_jit_error_is_the_original_type_and_nothing_accumulates():
  def host(v):
    raise UserError(f"plain {int(v)}")

  after = []
  g = jax.jit(lambda x: (je.callback(host, None, x),
                         je.callback(after.append, None, x), x + 1)[2])
  before = sum(map(len, _errors.deferred.values()))
  got = []
  for i in range(100):
    got += reports(lambda: g(jnp.int32(i)))
  assert [type(e) for e in got] == [UserError] * 100
  assert [str(e) for e in got] == [f"plain {i}" for i in range(100)]
  # Under plain jax.jit no carrier names the execution, so the effects
  # after a failed one are not skipped (design/errors.md, "Plain jax.jit"),
  # and one failure never stops another call's effects.
  assert after == list(range(100))
  assert sum(map(len, _errors.deferred.values())) == before
  assert not _errors.deferred


def test_jax_effects_jit_inside_plain_jit_error_is_the_original_type():
  def host(v):
    raise UserError("inner")

  inner = je.jit(lambda x: (je.callback(host, None, x), x * 2)[1])
  outer = jax.jit(lambda x: inner(x) + 1)
  got = reports(lambda: outer(jnp.int32(3)))
  assert [type(e) for e in got] == [UserError]


def test_eager_while_loop_error_is_the_original_type():
  def host(i):
    if int(i) == 2:
      raise UserError("eager loop")

  def body(i):
    je.callback(host, None, i)
    return i + 1

  got = reports(lambda: lax.while_loop(lambda i: i < 4, body, jnp.int32(0)))
  assert [type(e) for e in got] == [UserError]
  assert not _errors.deferred


# --- 4. errors pending at interpreter exit -------------------------------------

def test_error_pending_at_exit_is_printed_and_fails_the_exit_status():
  proc = run_script(PRELUDE + """
def boom(v):
  if int(v[0]) == 6:
    raise ValueError("failed after the last line")
f = je.jit(jax.shard_map(lambda v: (je.callback(boom, None, v), v)[1],
                         mesh=mesh, in_specs=P("i"), out_specs=P("i")))
f(x)
print("last line")
""")
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  assert proc.stdout.splitlines() == ["last line"]
  assert "Traceback" in proc.stderr
  assert "ValueError: failed after the last line" in proc.stderr


def test_clean_exit_keeps_status_zero():
  proc = run_script(PRELUDE + """
f = je.jit(jax.shard_map(lambda v: (je.print("v={}", v), v)[1],
                         mesh=mesh, in_specs=P("i"), out_specs=P("i")))
f(x)
""")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert len(proc.stdout.splitlines()) == N


# --- 5. thread lifetime ---------------------------------------------------------

def test_exited_threads_release_their_token_state_and_arrays():
  f = je.jit(lambda x: (je.print("t {}", x, effect=je.Effect("life-a")),
                        je.callback(lambda v: None, None, x,
                                    effect=je.Effect("life-b")), x)[2])
  f(jnp.int32(0))
  je.effects_barrier(all_threads=True)
  gc.collect()
  arrays_before = len(jax.live_arrays())
  states_before = len(_thread_slots._all_states)

  def short_lived(i):
    f(jnp.int32(i))
    if i % 2:   # half wait for their effects, half exit with them pending
      je.effects_barrier()

  for start in range(0, 200, 20):
    threads = [threading.Thread(target=short_lived, args=(i,))
               for i in range(start, start + 20)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  # No all-threads barrier: exiting is enough to release a thread's state.
  # Tokens of exited threads still pending are kept until they complete,
  # and let go when a thread next starts using jax_effects (its first call
  # sweeps them): wait for them without a barrier, then start one more.
  for t in _thread_slots.orphans():
    t.block_until_ready()
  last = threading.Thread(target=short_lived, args=(201,))
  last.start()
  last.join()
  gc.collect()
  assert len(_thread_slots._all_states) <= states_before
  # 200 threads x (initial token + token) were held before the fix
  assert len(jax.live_arrays()) <= arrays_before + 10
  je.effects_barrier(all_threads=True)   # and the others' lines are all out


# --- 2. barriers and mode switches inside a callback ------------------------------

# (one child for the three, each after a line "== call", bounded each by
# faulthandler: a call that deadlocks ends the child with every thread's
# stack, failing its own test, and the ones after it as never run. Each
# barrier must report exactly its own 8 errors, so errors one left behind
# fail the next; the mode switch runs last, so one wrongly made cannot change
# how the others run)
_IN_CALLBACK = ["je.effects_barrier(all_threads=True)", "je.effects_barrier()",
                "je.set_ordering('global')"]


@pytest.fixture(scope="module")
def in_callback():
  blocks = [f"""
print({"== " + call!r}, flush=True)
faulthandler.dump_traceback_later(90, exit=True)
def host(v):
  {call}
def body(v):
  je.callback(host, None, v)
  return jax.lax.psum(v, "i")
f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))
f(x)
try:
  je.effects_barrier()
  print("no error")
except ExceptionGroup as group:
  print(len(group.exceptions), {{type(e).__name__ for e in group.exceptions}})
  print(str(group.exceptions[0]))
""" for call in _IN_CALLBACK]
  return run_script(PRELUDE + "import faulthandler\n" + "".join(blocks)
                    + "faulthandler.cancel_dump_traceback_later()\n"
                    + "print('== end')\n", timeout=300)


@pytest.mark.parametrize("call", _IN_CALLBACK)
def test_barrier_or_mode_switch_inside_a_callback_is_an_error_not_a_deadlock(
    in_callback, call):
  lines = helpers.scenario_lines(in_callback, call)
  assert lines[0] == "8 {'RuntimeError'}", lines
  assert "from a host callback" in lines[1] and call.split("(")[0][3:] in lines[1]


# --- 12. ordering() inside a traced function ------------------------------------

@pytest.mark.parametrize("mode", ["global", "per_effect"])
def test_ordering_inside_a_traced_function_is_a_clear_error(mode):
  def f(x):
    with je.ordering(mode):
      je.print("x={}", x)
    return x

  with pytest.raises(RuntimeError, match=r"ordering\('.*'\).*traced"):
    je.jit(f)(jnp.int32(1))
  with pytest.raises(RuntimeError, match="traced"):
    jax.jit(f)(jnp.int32(1))
  assert je.get_ordering() == "per_effect"


def _barrier_inside(x):
  je.print("x={}", x)
  je.effects_barrier()
  return x


def _deterministic_inside(x):
  with je.deterministic():
    je.print("x={}", x)
  return x


def _barrier_in_loop(x):
  def body(i, c):
    je.effects_barrier(all_threads=True)
    return c + i
  return jax.lax.fori_loop(0, 3, body, x)


@pytest.mark.parametrize("fn,call", [
    (_barrier_inside, "effects_barrier(all_threads=False)"),
    (_deterministic_inside, "deterministic()"),
    (_barrier_in_loop, "effects_barrier(all_threads=True)")])
@pytest.mark.parametrize("jit", [je.jit, jax.jit, jax.make_jaxpr],
                         ids=["je.jit", "jax.jit", "make_jaxpr"])
def test_barrier_and_deterministic_inside_a_traced_function_are_clear_errors(
    fn, call, jit, effects_capture):
  # Run at trace time they would do nothing when the computation runs.
  with pytest.raises(RuntimeError) as info:
    jit(fn)(jnp.int32(1))
  msg = str(info.value)
  assert call in msg and "traced" in msg and "around the call" in msg
  assert not _output.holding()
  assert effects_capture.printed == []
  # Eagerly (no jaxpr built) they still do what they do.
  with je.deterministic():
    je.print("eager {}", 1)
  je.effects_barrier()
  assert effects_capture.printed == ["eager 1"]


# --- 8. KeyboardInterrupt during dispatch --------------------------------------

def test_interrupt_after_dispatch_keeps_the_token(mesh, monkeypatch):
  # SIGINT's KeyboardInterrupt is raised at the next Python instruction of
  # the dispatching thread: after a per-device computation is dispatched (it
  # runs asynchronously) and before its token is stored, at the entry of
  # TokenStore.update. Simulated there, deterministically, once.
  order = []
  lock = threading.Lock()

  def slow(v):
    threading.Event().wait(0.2)     # still running when the next call comes
    with lock:
      order.append(("slow", int(v[0])))

  f = je.jit(jax.shard_map(lambda v: (je.callback(slow, None, v), v)[1],
                           mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  g = je.jit(lambda x: (je.callback(lambda v: order.append(("next", int(v))),
                                    None, x), x)[1])
  x = sharded(mesh, jnp.arange(N, dtype=jnp.int32))
  f(x)
  g(jnp.int32(0))
  je.effects_barrier()
  order.clear()

  real_update = _token_store.TokenStore.update
  calls = []

  def interrupted_update(*args):
    if not calls:
      calls.append(1)
      raise KeyboardInterrupt
    return real_update(*args)

  monkeypatch.setattr(_threads.ThreadTokens, "update", interrupted_update)
  with pytest.raises(KeyboardInterrupt):
    f(x)
  monkeypatch.setattr(_threads.ThreadTokens, "update", real_update)
  g(jnp.int32(1))           # must follow the interrupted call's effects
  je.effects_barrier()      # and the barrier must wait for them
  assert len(order) == N + 1, order
  assert sorted(order[:N]) == [("slow", d) for d in range(N)]
  assert order[N] == ("next", 1)


@pytest.mark.parametrize("path", ["fast", "general"])
def test_sigint_while_a_call_blocks_in_dispatch_keeps_its_token(path):
  # A computation XLA's cost analysis finds cheap (a loop on a scalar, here
  # ten million steps) runs inline on the CPU client: the call blocks in
  # JAX's C++ dispatch while the computation runs. SIGINT
  # there raises KeyboardInterrupt as soon as the call returns, before its
  # result (the new runtime token) is stored: the token must be stored, and
  # the interrupt still reach the user, once. ("general": two chains, the
  # general dispatch hook.) The signal is sent from a timer thread halfway
  # through the call; where a loaded machine delays it past the call's end
  # (or holds the main thread up before the dispatch), the attempt is
  # repeated, the late signal waited for within it; none landing fails.
  two = "je.callback(lambda v: None, None, x[0, 0], effect=je.Effect('b'))"
  proc = run_script(f"""
import os, signal, threading, time
# Python's own handler, whatever the parent left (a background job, as
# under nohup or some CI runners, inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
import jax, jax.numpy as jnp
from jax import lax
import jax_effects as je
ran = []
@je.jit
def f(x):
  je.callback(lambda v: ran.append(1), None, x[0, 0])
  {two if path == "general" else ""}
  return lax.fori_loop(0, 10_000_000, lambda i, c: c * 1.0000001 + 1e-9, x[0, 0])
x = jnp.ones((64, 64)) * 0.01
f(x); f(x); je.effects_barrier()
start = time.perf_counter(); f(x); took = time.perf_counter() - start
je.effects_barrier()
assert took > 0.02, took   # the call blocks while the computation runs
for attempt in range(50):
  before = je.runtime_tokens().effects[je.DEFAULT]
  n = len(ran)
  timer = threading.Timer(took / 2, os.kill, (os.getpid(), signal.SIGINT))
  returned = False
  timer.start()
  try:
    f(x)
    returned = True
    timer.join(60)   # the signal came late: it lands here (try again)
  except KeyboardInterrupt:
    # (the call runs inline: its callback ran if it was dispatched; a
    # signal landing before the dispatch, the main thread held up that
    # long, is tried again)
    if not returned and len(ran) > n:
      after = je.runtime_tokens().effects[je.DEFAULT]
      print("stored", after is not before)
      break
  timer.join(60)
  assert not timer.is_alive()
else:
  print("no signal landed in a call")
n = len(ran)
f(x)
je.effects_barrier()
print("calls", n + 1 == len(ran))
""", timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["stored", "True", "calls", "True"], proc.stdout


# --- 11. a new thread's first call does not wait for busy devices ---------------

def test_new_threads_first_call_does_not_wait_for_busy_devices():
  # Thread A's per-device callbacks occupy all 8 devices until thread B's
  # first call (single device, a fresh thread: its first token) has run its
  # callback. If B's first call waited for the devices, both would stall
  # until A's callbacks gave up.
  proc = run_script(PRELUDE + """
import threading
released = threading.Event()
gave_up = []
def wait_for_b(v):
  if not released.wait(30):
    gave_up.append(int(v[0]))
a = je.jit(jax.shard_map(lambda v: (je.callback(wait_for_b, None, v), v)[1],
                         mesh=mesh, in_specs=P("i"), out_specs=P("i")))
b = je.jit(lambda v: (je.callback(lambda _: released.set(), None, v), v)[1])
released.set(); a(x); b(jnp.zeros(2)); je.effects_barrier(); released.clear()
started = threading.Event()
def thread_a():
  a(x)
  started.set()
  je.effects_barrier()
ta = threading.Thread(target=thread_a)
ta.start()
started.wait(30)
tb = threading.Thread(target=lambda: b(jnp.zeros(2)))
tb.start()
tb.join(60)
ta.join(60)
je.effects_barrier(all_threads=True)
print("gave up" if gave_up else "ok")
""", timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["ok"]
