"""JAX's own callbacks inside ``jax_effects.jit`` keep program order
(``design/architecture.md``, the ``_pass/adopted`` entry).

``jax.debug.print``/``log``/``callback`` and ``io_callback`` traced inside a
``jax_effects.jit`` function are adopted by the token-threading pass:
ordered or not, they join the ``DEFAULT`` chain (program order with our
effects, in the computation and across dispatches); they run where JAX
refuses ordered callbacks (several devices, ``shard_map``, ``pmap``) and
the function keeps ``jax.jit``'s C++ fast path. Oracle: the same
function with ``jax.disable_jit()`` (everything eager, in program order).
"""
import collections
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import Mesh, PartitionSpec as P

import jax_effects as je
from helpers import in_thread


def _mixed(record):
  def f(x):
    jax.debug.print("1 jax.debug.print {}", x, ordered=True)
    je.print("2 je.print {}", x)
    io_callback(lambda v: record.append(("3 io", int(v))), None, x,
                ordered=True)
    y = io_callback(lambda v: np.int32(v * 10),
                    jax.ShapeDtypeStruct((), jnp.int32), x, ordered=True)
    je.callback(lambda v: record.append(("4 je", int(v))), None, y)
    jax.debug.callback(lambda v: record.append(("5 dbg", int(v))), y,
                       ordered=True)
    jax.debug.print("6 jax.debug.print {}", y, ordered=True)
    return y + 1
  return f


def test_program_order_with_our_effects_as_without_jit(capsys):
  def run(call):
    record = []
    f = _mixed(record)
    g = call(f)
    outs = [int(g(jnp.int32(i))) for i in range(4)]
    je.effects_barrier()
    return outs, record, capsys.readouterr().out.splitlines()

  with jax.disable_jit():
    expected = run(lambda f: f)
  got = run(je.jit)
  assert got == expected
  outs, record, lines = got
  assert outs == [1, 11, 21, 31]
  assert record == [r for i in range(4)
                    for r in (("3 io", i), ("4 je", 10 * i), ("5 dbg", 10 * i))]
  assert lines == [l for i in range(4) for l in (
      f"1 jax.debug.print {i}", f"2 je.print {i}",
      f"6 jax.debug.print {10 * i}")]


def test_alternating_prints_in_program_order(capsys):
  # Before adoption JAX's ordered prints and ours were two chains: printed
  # as 1 2 3 5 4.
  def f(x):
    jax.debug.print("1 {}", x, ordered=True)
    je.print("2 {}", x)
    jax.debug.print("3 {}", x, ordered=True)
    je.print("4 {}", x)
    jax.debug.print("5 {}", x, ordered=True)
    return x

  g = je.jit(f)
  for i in range(3):
    g(i)
  je.effects_barrier()
  got = capsys.readouterr().out.splitlines()
  with jax.disable_jit():
    for i in range(3):
      f(i)
  assert got == capsys.readouterr().out.splitlines()
  assert got == [f"{k} {i}" for i in range(3) for k in range(1, 6)]


def test_default_unordered_jax_prints_join_program_order(capsys):
  # jax.debug.print without ordered=True (what most code calls): JAX promises
  # no order; inside jax_effects.jit it keeps program order with ours.
  record = []

  def f(x):
    je.print("1 {}", x)
    jax.debug.print("2 {}", x)
    je.print("3 {}", x)
    jax.debug.print("4 {}", x)
    jax.debug.callback(lambda v: record.append(int(v)), x)
    io_callback(lambda v: record.append(-int(v)), None, x)
    je.callback(lambda v: record.append(100 + int(v)), None, x)
    je.print("5 {}", x)
    return x

  g = je.jit(f)
  for i in range(5):
    g(i)
  je.effects_barrier()
  assert capsys.readouterr().out.splitlines() == [
      f"{k} {i}" for i in range(5) for k in range(1, 6)]
  assert record == [r for i in range(5) for r in (i, -i, 100 + i)]


def test_order_holds_across_dispatches_of_jax_and_our_effects():
  # A slow JAX ordered callback in one function; our effect in the next:
  # the DEFAULT runtime token makes the second wait for the first.
  record = []

  def slow(v):
    time.sleep(0.002)
    record.append(("jax", int(v)))

  f_jax = je.jit(lambda x: jax.debug.callback(slow, x, ordered=True) or x)
  f_ours = je.jit(lambda x: je.callback(
      lambda v: record.append(("ours", int(v))), None, x) or x)

  def go():
    for i in range(20):
      f_jax(jnp.int32(i))
      f_ours(jnp.int32(i))
    je.effects_barrier()
  in_thread(go)
  assert record == [(who, i) for i in range(20) for who in ("jax", "ours")]


def test_effects_in_control_flow_keep_program_order():
  record = []

  @je.jit
  def f(x):
    def body(i, c):
      jax.debug.callback(lambda v: record.append(("dbg", int(v))), i,
                         ordered=True)
      je.callback(lambda v: record.append(("je", int(v))), None, i)
      c = jax.lax.cond(
          i % 2 == 0,
          lambda c: (io_callback(lambda v: record.append(("even", int(v))),
                                 None, i, ordered=True), c + 1)[1],
          lambda c: c, c)
      return c
    return jax.lax.fori_loop(0, 4, body, x)

  assert int(f(jnp.int32(0))) == 2
  je.effects_barrier()
  expected = []
  for i in range(4):
    expected += [("dbg", i), ("je", i)] + ([("even", i)] if i % 2 == 0 else [])
  assert record == expected


def test_io_callback_results_and_errors():
  @je.jit
  def f(x):
    y = io_callback(lambda v: (v * 2).astype(np.float32),
                    jax.ShapeDtypeStruct((3,), jnp.float32), x, ordered=True)
    return y + 1

  np.testing.assert_array_equal(f(jnp.arange(3.0)), [1.0, 3.0, 5.0])

  class Boom(Exception):
    pass

  def bad(v):
    raise Boom("from io_callback")

  g = je.jit(lambda x: io_callback(bad, jax.ShapeDtypeStruct((), jnp.float32),
                                   x, ordered=True) + x)
  # As jax.jit delivers it (tests/frontends/test_adopted_as_jax.py):
  # JaxRuntimeError, the user's exception as its cause.
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match="(?s)CpuCallback error.*Boom: from io_callback"
                     ) as info:
    g(jnp.float32(1))
    je.effects_barrier()
  assert type(info.value.__cause__) is Boom
  je.effects_barrier()   # reported once


def _streams(f, *args):
  def go():
    f(*args)
    je.effects_barrier()
    return set(je.runtime_tokens().effects)
  return in_thread(go)


def test_ordered_and_unordered_ones_join_default(capsys):
  ordered = je.jit(lambda x: jax.debug.print("o {}", x, ordered=True) or x)
  unordered = je.jit(lambda x: jax.debug.print("u {}", x) or x)
  io_unordered = je.jit(lambda x: io_callback(lambda v: None, None, x) or x)
  assert _streams(ordered, 1) == {je.DEFAULT}
  assert _streams(unordered, 2) == {je.DEFAULT}
  assert _streams(io_unordered, 3) == {je.DEFAULT}
  assert capsys.readouterr().out.splitlines() == ["o 1", "u 2"]

  def global_mode():
    with je.ordering("global"):
      ordered(4)
      je.effects_barrier()
      return set(je.runtime_tokens().effects)
  assert in_thread(global_mode) == {je.GLOBAL}


def test_jax_debug_log_is_adopted(caplog):
  @je.jit
  def f(x):
    jax.debug.log("jax log {}", x)
    return x

  with caplog.at_level(logging.INFO):
    f(jnp.int32(7))
    je.effects_barrier()
  assert [r.getMessage() for r in caplog.records
          if "jax log" in r.getMessage()] == ["jax log 7"]
  assert not f.trace(jnp.int32(7)).jaxpr.effects


# --- where JAX refuses them ---------------------------------------------------

def test_ordered_jax_print_in_shard_map_runs_per_device(capfd):
  mesh = Mesh(np.array(jax.devices()), ("i",))

  def fun(x):
    jax.debug.print("before", ordered=True)

    def body(b):
      jax.debug.print("dev {} a", b[0], ordered=True)
      jax.debug.print("dev {} b", b[0], ordered=True)
      return b * 2
    y = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
    jax.debug.print("after", ordered=True)
    return y

  with pytest.raises(ValueError, match="not supported for more than 1 device"):
    jax.jit(fun)(jnp.arange(8))   # JAX refuses it
  capfd.readouterr()
  out = je.jit(fun)(jnp.arange(8))
  je.effects_barrier()
  np.testing.assert_array_equal(out, 2 * np.arange(8))
  lines = capfd.readouterr().out.splitlines()
  assert lines[0] == "before" and lines[-1] == "after"
  per_device = collections.defaultdict(list)
  for line in lines[1:-1]:
    _, d, which = line.split()
    per_device[int(d)].append(which)
  assert per_device == {d: ["a", "b"] for d in range(8)}


def test_ordered_jax_callback_in_pmap_runs_per_device():
  record = []
  lock = threading.Lock()

  def host(v):
    with lock:
      record.append(int(v))

  def fun(x):
    def per_device(v):
      jax.debug.callback(host, v, ordered=True)
      jax.debug.callback(host, v + 100, ordered=True)
      return v + 1
    return jax.pmap(per_device)(x)

  with pytest.raises(ValueError, match="not supported for more than 1 device"):
    jax.jit(fun)(jnp.arange(8))   # JAX refuses it
  record.clear()
  out = je.jit(fun)(jnp.arange(8))
  je.effects_barrier()
  np.testing.assert_array_equal(out, np.arange(8) + 1)
  assert sorted(record) == [*range(8), *range(100, 108)]
  for d in range(8):   # each device: its two callbacks in program order
    assert record.index(d) < record.index(d + 100)


def test_io_callback_on_several_devices_under_automatic_partitioning():
  record = []
  devices = np.array(jax.devices())
  mesh = Mesh(devices, ("i",))
  sharding = jax.sharding.NamedSharding(mesh, P("i"))

  @je.jit
  def f(x):
    io_callback(lambda v: record.append(v.tolist()), None, x.sum(),
                ordered=True)
    je.callback(lambda v: record.append(("je", v.tolist())), None, x.sum())
    return x * 2

  x = jax.device_put(jnp.arange(8), sharding)
  f(x)
  f(x + 1)
  je.effects_barrier()
  assert record == [28, ("je", 28), 36, ("je", 36)]


def test_ordered_jax_print_on_several_devices_runs_once(capsys):
  mesh = Mesh(np.array(jax.devices()), ("i",))
  x = jax.device_put(jnp.arange(8), jax.sharding.NamedSharding(mesh, P("i")))

  def fun(x):
    jax.debug.print("sum {}", x.sum(), ordered=True)
    je.print("ours {}", x[0])
    jax.debug.print("max {}", x.max(), ordered=True)
    return x + 1

  with pytest.raises(ValueError, match="not supported for more than 1 device"):
    jax.jit(fun)(x)   # JAX refuses it
  capsys.readouterr()
  f = je.jit(fun)
  f(x)
  f(x)
  je.effects_barrier()
  assert capsys.readouterr().out.splitlines() == ["sum 28", "ours 0",
                                                  "max 7"] * 2


# --- fast path ----------------------------------------------------------------

def test_adopted_effects_keep_the_cpp_fast_path(jax_events, capsys):
  record = []
  f = je.jit(_mixed(record))
  assert not f.trace(jnp.int32(0)).jaxpr.effects   # no JAX effect left

  def go():
    f(jnp.int32(0))
    f(jnp.int32(0))
    jax_events.clear()
    for i in range(5):
      f(jnp.int32(i))
    je.effects_barrier()
  in_thread(go)
  assert jax_events["jit_cpp_cache_miss"] == 0, jax_events
  assert len(record) == 3 * 7


def test_jax_print_inside_a_solver_prints_as_under_jax_jit(capsys):
  # jax.scipy.sparse.linalg.cg (custom_linear_solve) with a print in its
  # matvec: the same lines as under jax.jit, whether or not the pass has a
  # rule for the solver's primitive.
  a = jnp.array([[4.0, 1.0], [1.0, 3.0]])

  def solve(b):
    def matvec(v):
      jax.debug.print("matvec {}", v)
      return a @ v
    return jax.scipy.sparse.linalg.cg(matvec, b, tol=1e-6)[0]

  b = jnp.array([1.0, 2.0])
  expected_x = jax.jit(solve)(b)
  jax.effects_barrier()
  expected = capsys.readouterr().out.splitlines()
  x = je.jit(solve)(b)
  je.effects_barrier()
  assert capsys.readouterr().out.splitlines() == expected
  assert len(expected) >= 2
  np.testing.assert_allclose(x, expected_x, rtol=1e-6)


def test_partitioned_jax_callback_stays_jaxs_and_runs_per_shard():
  mesh = Mesh(np.array(jax.devices()), ("i",))
  x = jax.device_put(jnp.arange(8.0),
                     jax.sharding.NamedSharding(mesh, P("i")))
  shards = []
  lock = threading.Lock()

  def host(v):
    with lock:
      shards.append(np.asarray(v).tolist())

  @je.jit
  def f(x):
    jax.debug.callback(host, x, partitioned=True)
    je.print("ours {}", x.sum())
    return x + 1

  np.testing.assert_array_equal(f(x), np.arange(8.0) + 1)
  je.effects_barrier()
  assert sorted(shards) == [[float(i)] for i in range(8)]


@pytest.mark.parametrize("result", [
    lambda v: 1.5, lambda v: np.float64(2.0), lambda v: np.ones(3),
    lambda v: v * 2],
    ids=["py-float", "np-f64-scalar", "np-f64-array", "array"])
def test_io_callback_results_converted_as_jax_does(result):
  def fun(x):
    shape = np.shape(result(np.zeros(3)))
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    return io_callback(result, spec, x, ordered=True)

  x = jnp.arange(3.0)
  expected = jax.jit(fun)(x)
  got = je.jit(fun)(x)
  je.effects_barrier()
  assert got.dtype == expected.dtype == jnp.float32
  np.testing.assert_array_equal(got, expected)


def test_io_callback_wrong_result_shape_is_jaxs_error():
  f = je.jit(lambda x: io_callback(lambda v: np.zeros(2, np.float32),
                                   jax.ShapeDtypeStruct((3,), jnp.float32),
                                   x, ordered=True))
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"Incorrect output shape for return value #0: "
                           r"Expected: \(3,\), Actual: \(2,\)"):
    f(jnp.zeros(3))
    je.effects_barrier()
