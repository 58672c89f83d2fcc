"""JAX's debugging switches on ``jax_effects.jit`` functions, as on ``jax.jit``'s.

* ``jax.disable_jit()`` runs every function eagerly on values, with effects
  or without (``design/architecture.md``, the `_dispatch/function, core, ...` entry).
* ``jax_debug_nans``/``jax_debug_infs``: a NaN/Inf output raises
  ``FloatingPointError`` naming the operation (JAX's de-optimized re-run,
  ``_dispatch.tracing.replay``); the call's effects ran once, in order, and
  later calls keep the order.
* ``jax.transfer_guard("disallow")``: our runtime tokens make no transfer
  the guard refuses (``design/tokens.md``, the initial token); the user's
  own transfers are refused as under ``jax.jit``.

Differential: the same function under ``jax.jit``.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je
from jax_effects._dispatch.function import describe
from helpers import in_thread
from helpers import PRELUDE_8_DEVICES
from helpers import run_script


# --- jax.disable_jit ----------------------------------------------------------

def _absolute(x):
  if x > 0:   # a Python branch on the value: only eagerly
    return x
  return -x


@pytest.mark.parametrize("jit", [jax.jit, je.jit], ids=["jax.jit", "je.jit"])
def test_disable_jit_runs_pure_functions_on_values(jit):
  # before any call, and once the function is known (compiled) to be pure
  with jax.disable_jit():
    assert float(jit(_absolute)(jnp.float32(-2.0))) == 2.0
  traced = []

  def double(x):
    traced.append(isinstance(x, jax.core.Tracer))
    return x * 2

  f = jit(double)
  assert float(f(jnp.float32(1.0))) == 2.0
  with jax.disable_jit():
    assert float(f(jnp.float32(4.0))) == 8.0
    assert float(jit(double)(jnp.float32(5.0))) == 10.0
  assert float(f(jnp.float32(6.0))) == 12.0
  assert traced == [True, False, False]
  with jax.disable_jit():   # .trace() still traces
    assert f.trace(jnp.ones(2)).out_info.shape == (2,)
  assert traced[-1] is True


def test_disable_jit_first_call_of_an_effectful_function_learns_nothing(
    effects_capture):
  @je.jit
  def f(x):
    je.print("f {}", x)
    if x > 0:
      return x
    return -x

  with jax.disable_jit():
    assert float(f(jnp.float32(-1.0))) == 1.0
  assert describe(f).state == "first"      # not taken for a pure function

  @je.jit
  def g(x):
    je.print("g {}", x)
    return x + 1

  with jax.disable_jit():
    g(jnp.float32(0.0))
  g(jnp.float32(1.0))
  g(jnp.float32(2.0))
  assert describe(g).state == "fast"
  with jax.disable_jit():   # .trace() traces, threaded, and runs nothing
    assert "jax_effects_threaded_effect" in str(g.trace(jnp.ones(2)).jaxpr)
  je.effects_barrier()
  assert effects_capture.printed == ["f -1.0", "g 0.0", "g 1.0", "g 2.0"]


# --- jax_debug_nans / jax_debug_infs ---------------------------------------------

def _error_of(call):
  try:
    call()
  except FloatingPointError as e:
    return str(e)
  raise AssertionError("no FloatingPointError")


@pytest.mark.parametrize("switch", ["jax_debug_nans", "jax_debug_infs"])
def test_debug_nans_and_infs_raise_as_under_jax_jit_effects_once(switch):
  events = []
  if switch == "jax_debug_nans":
    plain = lambda x: x / x   # noqa: E731   (NaN at 0)
  else:
    plain = lambda x: 1.0 / x   # noqa: E731   (Inf at 0)

  def f(x):
    je.callback(lambda v: events.append(("before", float(v))), None, x)
    y = plain(x)
    # (JAX's own callback, adopted: its de-optimized re-run would run it)
    jax.debug.callback(lambda v: events.append(("after", float(v))), y)
    return y

  bad = 0.0
  ours = je.jit(f)
  with getattr(jax, switch[4:])(True):   # jax.debug_nans / jax.debug_infs
    assert float(ours(jnp.float32(1.0))) == 1.0
    theirs = _error_of(lambda: jax.jit(plain)(jnp.float32(bad)))
    mine = _error_of(lambda: ours(jnp.float32(bad)))
    assert float(ours(jnp.float32(2.0))) in (1.0, 0.5)
    ours(jnp.float32(4.0))
  je.effects_barrier()
  # the same message as jax.jit's de-optimized re-run gives (naming the op)
  assert mine == theirs, (mine, theirs)
  assert re.search(r"invalid value \((nan|inf)\) encountered in", mine)
  # every effect once, in program order, the failing call's included
  kind = "nan" if switch == "jax_debug_nans" else "inf"
  assert [e[0] for e in events] == ["before", "after"] * 4
  assert [e[1] for e in events[::2]] == [1.0, 0.0, 2.0, 4.0]
  assert str(events[3][1]) == kind


def test_debug_nans_of_a_pure_function_as_under_jax_jit():
  f = lambda x: jnp.log(x) * 2   # noqa: E731
  with jax.debug_nans(True):
    errors = [_error_of(lambda: jit(f)(jnp.float32(-1.0)))
              for jit in (jax.jit, je.jit)]
  assert errors[0] == errors[1] and "log" in errors[0]


def test_debug_nans_inside_control_flow_runs_no_effect_twice():
  events = []

  @je.jit
  def f(x):
    def body(i, c):
      je.callback(lambda v: events.append(int(v)), None, i)
      return c + jnp.where(i == 2, jnp.log(x), 0.0)
    return jax.lax.fori_loop(0, 4, body, jnp.float32(0))

  f(jnp.float32(1.0))
  with jax.debug_nans(True):
    with pytest.raises(FloatingPointError, match="invalid value"):
      f(jnp.float32(-1.0))
    f(jnp.float32(1.0))
  je.effects_barrier()
  assert events == [0, 1, 2, 3] * 3


# --- jax.transfer_guard ------------------------------------------------------------

@pytest.mark.parametrize("level", ["disallow", "disallow_explicit", "log"])
def test_transfer_guard_first_calls_and_unordered_effects(
    level, effects_capture, capfd):
  a = je.Effect("guard-a")
  adopted = []

  @je.jit
  def f(x):
    je.print("f {}", x)
    je.print("u {}", x, ordered=False)
    return x + 1

  @je.jit
  def g(x):
    je.print("g {}", x, effect=a)
    if level != "disallow_explicit":
      # (JAX's callbacks put their operands on a device explicitly, which
      # "disallow_explicit" refuses under jax.jit as well)
      jax.debug.callback(lambda v: adopted.append(float(v)), x)
    return x * 2

  x = jnp.float32(1.0)   # the user's arrays are on the device already

  def run():
    with jax.transfer_guard(level):
      y = f(x)          # the thread's first call and stream
      y = f(y)
      z = g(y)          # first use of another stream
      je.effects_barrier()
      return float(z)

  assert in_thread(run) == 6.0
  assert in_thread(run) == 6.0    # (the function known: the fast hook)
  # ("log" writes each transfer it sees to stderr, from C++)
  assert "transfer" not in capfd.readouterr().err
  assert effects_capture.printed.count("u 1.0") == 2
  ordered = [p for p in effects_capture.printed if not p.startswith("u")]
  assert ordered == ["f 1.0", "f 2.0", "g 3.0"] * 2
  assert adopted == ([] if level == "disallow_explicit" else [3.0, 3.0])


@pytest.mark.parametrize("jit", [jax.jit, je.jit], ids=["jax.jit", "je.jit"])
def test_transfer_guard_still_refuses_the_users_own_transfers(jit):
  @jit
  def f(x, y):
    je.print("x {}", x)
    return x + y

  x = jnp.float32(1.0)

  def run():
    f(x, x)   # learnt and compiled outside the guard
    with jax.transfer_guard("disallow"):
      with pytest.raises(Exception, match="Disallowed host-to-device"):
        f(x, np.float32(2.0))
    je.effects_barrier()

  in_thread(run)


def test_transfer_guard_first_call_does_not_wait_for_busy_devices():
  # As without a guard (test_fault_contract): thread A's per-device
  # callbacks occupy all 8 devices until thread B's first call (under the
  # guard: its token put on the default device by an explicit transfer) has
  # run its callback. Had that transfer waited for the devices, both would
  # stall until A's callbacks gave up.
  proc = run_script(PRELUDE_8_DEVICES + """
import threading
released = threading.Event()
gave_up, done = [], []
def wait_for_b(v):
  if not released.wait(30):
    gave_up.append(int(v[0]))
a = je.jit(jax.shard_map(lambda v: (je.callback(wait_for_b, None, v), v)[1],
                         mesh=mesh, in_specs=P("i"), out_specs=P("i")))
b = je.jit(lambda v: (je.callback(lambda _: released.set(), None, v), v)[1])
z = jnp.zeros(2)
released.set(); a(x); b(z); je.effects_barrier(); released.clear()
started = threading.Event()
def thread_a():
  a(x)
  started.set()
  je.effects_barrier()
def thread_b():
  with jax.transfer_guard("disallow"):
    y = b(z)
  done.append(float(y[0]))
ta = threading.Thread(target=thread_a)
ta.start()
started.wait(30)
tb = threading.Thread(target=thread_b)
tb.start()
tb.join(60)
ta.join(60)
je.effects_barrier(all_threads=True)
print("gave up" if gave_up else "ok" if done else "refused")
""", timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["ok"]
