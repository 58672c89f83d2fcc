"""The dispatch path under races between threads (``design/architecture.md``,
the ``_dispatch/function`` entry: chains learnt while tracing, dispatch
states).

* Threads learning a function's chains while another thread builds the
  ``jax.jit`` object for the chains it knew: the object must match the keys
  it is called with (a stale one would take the wrong number of token
  arguments, so the user's function would get a token as an argument).
* The fast hook under ``jax.disable_jit()`` on a thread that has no runtime
  token for the function's chain yet (its initial token is a NumPy scalar).
"""
import threading

import jax
import jax.numpy as jnp
import pytest

import jax_effects as je
from jax_effects._dispatch import tracing as _jit_options


def test_concurrent_learning_never_leaves_a_jit_for_the_wrong_token_count(
    monkeypatch):
  logs = {}

  @je.jit
  def f(t, i):
    je.callback(lambda t, i: logs.setdefault(int(t), []).append(int(i)),
                None, t, i)
    return i + 1

  f(0, 0)   # learnt in "per_effect"; "global" is learnt below, by two threads
  je.effects_barrier()
  original = _jit_options.Traceable
  building = threading.Event()
  other_done = threading.Event()
  slow = {}

  def traceable(body, fun_ref, names, sig, k):
    # Thread A stops after deciding how many tokens its jax.jit takes (none:
    # no chain known in "global" yet) until thread B learnt the chain.
    if threading.current_thread() is slow.get("thread") and k == 0:
      building.set()
      other_done.wait(3)   # (times out where building holds a lock)
    return original(body, fun_ref, names, sig, k)

  # (the g a jax.jit object of f is built around, tracing.Traceable)
  monkeypatch.setattr(_jit_options, "Traceable", traceable)
  errors = []

  def run(t):
    try:
      for i in range(3):
        f(t, i)
      je.effects_barrier()
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  previous = je.get_ordering()
  je.set_ordering("global")
  try:
    a = threading.Thread(target=run, args=(1,))
    slow["thread"] = a
    a.start()
    assert building.wait(60)
    b = threading.Thread(target=run, args=(2,))
    b.start()
    b.join(60)
    other_done.set()
    a.join(60)
    b.join(60)
  finally:
    je.set_ordering(previous)
    monkeypatch.setattr(_jit_options, "Traceable", original)
  assert errors == []
  assert logs[1] == [0, 1, 2] and logs[2] == [0, 1, 2]
  assert f.keys["global"] == (je.GLOBAL,)
  f(3, 0)
  je.effects_barrier()
  assert logs[3] == [0]


def test_fast_hook_under_disable_jit_without_a_token_for_the_chain():
  printed = []
  a = je.Effect("races-a")

  @je.jit
  def h(x):
    je.callback(lambda v: printed.append(("h", float(v))), None, x)
    return x + 1

  @je.jit
  def g(x):
    je.callback(lambda v: printed.append(("g", float(v))), None, x, effect=a)
    return x * 2

  h(1.0)
  h(2.0)   # h's fast hook is installed (by this thread)
  results = []

  def worker():
    g(3.0)
    g(4.0)   # this thread dispatches (fast) but has no token for DEFAULT
    with jax.disable_jit():
      results.append(float(h(5.0)))
    results.append(float(h(6.0)))
    je.effects_barrier()

  t = threading.Thread(target=worker)
  t.start()
  t.join(60)
  je.effects_barrier()
  assert results == [6.0, 7.0]
  assert printed == [("h", 1.0), ("h", 2.0), ("g", 3.0), ("g", 4.0),
                     ("h", 5.0), ("h", 6.0)]
  token = je.runtime_tokens().effects[je.DEFAULT]
  assert isinstance(token, jax.Array)


def test_set_ordering_from_another_thread_during_a_general_dispatch():
  # Thread A's general dispatch (a function with two chains) is in flight
  # while thread B switches the process to "global": A's later calls through
  # fast hooks must be in "global" mode (its effects in one order), not keep
  # the mode of the dispatch that was in flight.
  from jax import lax
  out = []
  a = je.Effect("races-switch")

  def switch_now(v):
    if int(v) == 1:
      b = threading.Thread(target=je.set_ordering, args=("global",))
      b.start()
      b.join(30)

  @je.jit
  def h(i):   # two chains: always the general hook
    je.callback(switch_now, None, i)
    je.callback(lambda v: None, None, i, effect=a)
    return i

  @je.jit
  def f(x):
    je.callback(lambda v: out.append("f"), None, x.sum())
    return x

  @je.jit
  def g(x):
    je.callback(lambda v: out.append("g"), None, x, effect=a)
    return x

  slow = jax.jit(lambda x: lax.fori_loop(0, 300, lambda k, y: jnp.tanh(y @ y),
                                         x))
  x = jnp.ones((300, 300)) / 300
  one = jax.device_put(1.0, jax.devices()[1])
  previous = je.get_ordering()
  assert previous == "per_effect"
  try:
    for _ in range(2):
      f(x)
      g(one)
      h(0)
    slow(x).block_until_ready()
    je.effects_barrier()
    out.clear()
    h(1)   # during this dispatch, another thread switches to "global"
    assert je.get_ordering() == "global"
    f(slow(x))   # its effect waits for slow(x), on device 0
    g(one)       # on device 1; in "global" mode after f's effect
    je.effects_barrier()
  finally:
    je.set_ordering(previous)
  assert out == ["f", "g"]


@pytest.mark.parametrize("chains", [1, 2])   # fast hook, general hook
def test_callback_error_of_a_call_that_failed_in_xla_is_not_raised_after_the_next_call_ran(chains):
  # f's callback fails (inline), then f's computation fails in XLA (a
  # jax.pure_callback raising on the zeros that stand for the failed result).
  # f raises XLA's error; the callback's error is reported by the next call
  # *before* it dispatches anything (errors.md), never after the next call
  # ran (its result discarded for an earlier call's error).
  out = []
  other = je.Effect("races-xla")

  def host(v):
    if v > 0.5:
      raise ZeroDivisionError("callback failure")
    return v + 1

  def pure(v):
    if v == 0:
      raise RuntimeError("pure_callback failure")
    return v

  @je.jit
  def f(x):
    if chains == 2:
      je.callback(lambda v: None, None, x, effect=other)
    z = je.callback(host, jax.ShapeDtypeStruct((), jnp.float32), x)
    return x + jax.pure_callback(pure, jax.ShapeDtypeStruct((), jnp.float32), z)

  @je.jit
  def g(x):
    je.callback(lambda v: out.append(float(v)), None, x)
    return x

  for _ in range(2):
    f(jnp.float32(0))
    g(jnp.float32(0))
  for _ in range(2):
    out.clear()
    with pytest.raises(Exception) as info:   # XLA's error
      f(jnp.float32(1))
    assert not isinstance(info.value, ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
      g(jnp.float32(2))
    assert out == []     # raised before dispatching anything
    assert float(g(jnp.float32(3))) == 3.0
    je.effects_barrier()
    assert out == [3.0]


def test_placement_called_from_c_with_no_python_caller():
  # placement() walks the stack for a host frame; called straight from C (a
  # thread started with _thread.start_new_thread, an atexit function) there
  # is no Python frame below it: None, not "call stack is not deep enough".
  import _thread
  import operator
  import sys
  import time
  errors, results = [], []
  old_hook = sys.unraisablehook
  sys.unraisablehook = lambda args: errors.append(args.exc_value)
  # Each thread runs results.extend(map(call, [je.placement])): C calling
  # C calling placement, whose result lands in results (the threads are
  # waited for by it, bounded, not by a sleep).
  call = operator.methodcaller("__call__")
  try:
    for _ in range(2):
      _thread.start_new_thread(results.extend, (map(call, [je.placement]),))
    deadline = time.monotonic() + 120
    while len(results) < 2 and not errors and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    sys.unraisablehook = old_hook
  assert errors == []
  assert results == [None, None]
  assert je.placement() is None
