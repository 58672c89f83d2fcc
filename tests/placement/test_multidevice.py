"""Ordered effects across devices: token placement, sharded jit (8 CPU
devices).

Contract: ``design/placement.md``, "Three placements" (an effect of a sharded
computation runs once, on the first device, adding no collective) and
"Tokens across devices".
"""
import subprocess
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_effects as je

import helpers
from helpers import run_script

N = 8


def test_runtime_token_follows_single_device_work(devices, effects_capture):
  f = je.jit(lambda x: (je.print("on {}", x), x + 1)[1])
  order = [0, 3, 3, 5, 1, 0]
  for n, d in enumerate(order):
    out = f(jax.device_put(jnp.int32(n), devices[d]))
    assert out.devices() == {devices[d]}
    token = je.runtime_tokens().effects[je.DEFAULT]
    # The token lives where the last computation ran, uncommitted so the next
    # computation's dispatch moves it only when its devices differ.
    assert token.devices() == {devices[d]}
    assert not token.committed
  assert effects_capture.printed == [f"on {n}" for n in range(len(order))]
  # One output token per device used; the barrier waited on all of them.
  per_device = je.runtime_tokens().devices
  for d in set(order):
    assert per_device[devices[d]].devices() == {devices[d]}
  assert all(t.is_ready() for t in per_device.values())


def test_a_function_over_several_devices_compiles_once(mesh, effects_capture):
  # The first call passes its runtime token replicated over the mesh of its
  # argument, as the call returns it; the calls after it pass that token
  # back and find the first call's executable. (Passed uncommitted, JAX
  # placed it as an equivalent GSPMDSharding, which jax.jit caches apart
  # from the NamedSharding it returns: a second compile of the program.)
  from jax_effects._dispatch.function import describe

  @je.jit
  def f(x):
    je.print("f {}", x.sum())
    return x * 2

  @je.jit
  def g(x):
    je.print("g {}", x[0])
    return x + 1

  x = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("i")))
  for _ in range(3):   # f starts the chain, then g and f take turns on it
    f(x)
    g(x)
  je.effects_barrier()
  assert effects_capture.printed == ["f 120.0", "g 0.0"] * 3
  assert describe(f).executables == 1, describe(f)
  assert describe(g).executables == 1, describe(g)


def test_dispatch_order_across_devices_matches_eager(devices):
  seen = []

  def record(i, v):
    seen.append((int(i), float(v)))

  def step(i, x):
    je.callback(record, None, i, x)
    return x * 2

  f = je.jit(step)
  calls = [(i, devices[(3 * i) % N]) for i in range(24)]
  for i, d in calls:
    f(jax.device_put(jnp.int32(i), d), jax.device_put(jnp.float32(i), d))
  je.effects_barrier()
  jitted = list(seen)
  seen.clear()
  with jax.disable_jit():
    for i, _ in calls:
      f(jnp.int32(i), jnp.float32(i))
  assert jitted == seen == [(i, float(i)) for i in range(24)]


def test_barrier_waits_on_every_device(devices):
  done = []
  f = je.jit(lambda x: (je.callback(lambda v: done.append(int(v)), None, x),
                        x)[1])
  for d in range(N):
    f(jax.device_put(jnp.int32(d), devices[d]))
  je.effects_barrier()
  assert sorted(done) == list(range(N))
  assert set(je.runtime_tokens().devices) == set(devices)


def test_sharded_jit_prints_once_on_full_value_in_order(mesh, effects_capture):
  x = jax.device_put(jnp.arange(N, dtype=jnp.int32), NamedSharding(mesh, P("i")))
  f = je.jit(lambda x: (je.print("x={} sum={}", x, x.sum()), x * 2)[1])
  for call in range(3):
    x = f(x)
    assert x.sharding.spec == P("i")
  assert effects_capture.printed == [
      f"x={np.arange(N) * 2 ** c} sum={sum(range(N)) * 2 ** c}"
      for c in range(3)]
  # The token covers all 8 devices and stays there as the runtime token, for
  # the next call over them (as a shard_map program's per-device token does;
  # a computation elsewhere gets the first device's copy).
  assert set(je.runtime_tokens().devices) == set(mesh.devices.flat)
  assert je.runtime_tokens().effects[je.DEFAULT].devices() == set(
      mesh.devices.flat)


@pytest.mark.parametrize("shape", [(0,), (12, 0), (0, 3)])
def test_empty_array_over_devices_prints_like_jax(mesh, shape, effects_capture):
  # An operand with no elements crosses no bytes: the once-on-the-first-
  # device call makes it itself (XLA 0.11.2's compiler crashes on a
  # shard_map with a zero-size operand; this test segfaulted there).
  x = jax.device_put(np.zeros(shape, np.int16), NamedSharding(mesh, P()))
  f = je.jit(lambda x: (je.print("{} {!r}", x, jnp.flip(x, 0)), x + 1)[1])
  out = f(x)
  je.effects_barrier()
  assert out.shape == shape
  whole = jnp.zeros(shape, jnp.int16)   # (repr: a jax.Array's, as JAX's)
  assert effects_capture.printed == [f"{whole} {whole!r}"]


def test_sharded_jit_callback_placement_is_first_device(mesh):
  where = []
  x = jax.device_put(jnp.arange(N, dtype=jnp.float32),
                     NamedSharding(mesh, P("i")))
  f = je.jit(lambda x: (je.callback(lambda v: where.append(
      (je.placement(), v.shape)), None, x), x)[1])
  f(x)
  je.effects_barrier()
  assert where == [(je.Placement(mesh.devices.flat[0].id, None, 0), (N,))]


#: What a compiled program's collectives look like in XLA's HLO text.
COLLECTIVES = ("all-reduce(", "all-gather(", "collective-permute(",
               "all-to-all(", "reduce-scatter(")


def _once_top(x):
  je.print("top")
  je.callback(lambda: None, None)
  return x * 2


def _once_fori(x):
  def step(i, c):
    je.print("i={}", i)
    jax.lax.cond(i % 2 == 0, lambda: je.print("even {}", i),
                 lambda: je.print("odd {}", i))
    return c + 1
  return jax.lax.fori_loop(0, 3, step, x)


def _once_while(x):
  def step(c):
    je.print("i={}", c[0])
    return c[0] + 1, c[1] * 2
  return jax.lax.while_loop(lambda c: c[0] < 3, step, (0, x))[1]


def _once_scan(x):
  def step(c, i):
    je.print("i={}", i)
    return c + i, None
  return jax.lax.scan(step, x, jnp.arange(3.0))[0]


ONCE = {"top": _once_top, "fori_cond": _once_fori, "while": _once_while,
        "scan": _once_scan}


@pytest.mark.parametrize("name", sorted(ONCE))
def test_once_effects_over_devices_add_no_collective(mesh, name, effects_capture):
  # Effects that run once in a program over 8 devices (on the first one) must
  # not make the other devices wait for them: no collective of ours (the
  # program itself has none), so a slow callback cannot stall or abort them.
  x = jax.device_put(jnp.arange(N, dtype=jnp.float32),
                     NamedSharding(mesh, P("i")))
  f = je.jit(ONCE[name])
  text = f.lower(x).compile().as_text()
  assert helpers.HOST_CALL in text
  assert [l.strip() for l in text.splitlines()
          if any(c in l for c in COLLECTIVES)] == []
  out = f(x)
  got = effects_capture.printed
  with jax.disable_jit():   # the same program, eagerly: the same lines
    expected_out = ONCE[name](jnp.arange(N, dtype=jnp.float32))
  assert got and effects_capture.printed == got * 2
  np.testing.assert_array_equal(out, expected_out)


def test_once_callback_results_reach_every_device(mesh):
  # A callback's results are the first device's; the others get them too.
  x = jax.device_put(jnp.arange(N, dtype=jnp.float32),
                     NamedSharding(mesh, P("i")))
  sds = jax.ShapeDtypeStruct((), jnp.float32)

  def f(x):
    x = x + je.callback(lambda: np.float32(100), sds)
    return jax.lax.fori_loop(
        0, 3, lambda i, c: c + je.callback(lambda i: np.float32(10 * i), sds, i),
        x)

  out = je.jit(f)(x)
  np.testing.assert_array_equal(out, np.arange(N) + 130)
  assert out.sharding.spec == P("i")


@pytest.mark.parametrize("order", ["mesh", "reversed"])
def test_once_effect_then_another_device_keeps_order(devices, order):
  # The next computation, on a device that did not run the callback, still
  # follows it: the runtime token is the running device's copy.
  mesh = Mesh(np.array(devices if order == "mesh" else devices[::-1]), ("i",))
  x = jax.device_put(jnp.arange(N, dtype=jnp.float32),
                     NamedSharding(mesh, P("i")))
  seen = []

  def slow():
    time.sleep(0.2)
    seen.append("multi")

  def quick():
    seen.append("single")

  multi = je.jit(lambda x: (je.callback(slow, None), x * 2)[1])
  single = je.jit(lambda y: (je.callback(quick, None), y + 1)[1])
  for _ in range(3):
    multi(x)
    single(jax.device_put(jnp.float32(1), devices[5]))
  je.effects_barrier()
  assert seen == ["multi", "single"] * 3


def test_one_function_over_devices_in_two_orders_keeps_order(devices):
  # The token a call leaves on its devices is the first device's (of that
  # call's device order); a call with the devices in another order, so
  # another first device, follows it all the same.
  meshes = [Mesh(np.array(devices), ("i",)), Mesh(np.array(devices[::-1]), ("i",))]
  xs = [jax.device_put(jnp.arange(N, dtype=jnp.float32),
                       NamedSharding(m, P("i"))) for m in meshes]
  seen = []

  def record(tag):
    if tag == 0:
      time.sleep(0.1)
    seen.append((int(tag), je.placement().device_id))

  f = je.jit(lambda x, tag: (je.callback(record, None, tag), x * 2)[1])
  for _ in range(3):
    f(xs[0], 0)
    f(xs[1], 1)
  je.effects_barrier()
  assert seen == [(0, devices[0].id), (1, devices[-1].id)] * 3


#: Start of a script run by _run: XLA's collective timeout lowered (XLA
#: aborts the process when a collective's participants wait longer than
#: this: 40 s by default, a callback in a debugger; it waits the warning's
#: timeout, then the terminating one: 0 + 1 s here, which the scripts' slow
#: callbacks, 2 s, outlast), 8 devices, ``x`` sharded.
SHORT_COLLECTIVE_TIMEOUT = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_cpu_collective_call_warn_stuck_timeout_seconds=0"
        + " --xla_cpu_collective_call_terminate_timeout_seconds=1")
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_effects as je

    mesh = Mesh(np.array(jax.devices()), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
""")

SLOW_CALLBACK = SHORT_COLLECTIVE_TIMEOUT + textwrap.dedent("""
    def top(x):
      je.callback(lambda: time.sleep(2), None)
      return x * 2

    def loop(x):
      def step(i, c):
        je.callback(lambda: time.sleep(2), None)
        return c + 1
      return jax.lax.fori_loop(0, 2, step, x)

    for f in (top, loop):
      print(je.jit(f)(x).sum())
      je.effects_barrier()
    print("OK")
""")


def _run(script: str) -> subprocess.CompletedProcess:
  """Runs ``script`` in a fresh interpreter (XLA's flags are read at start;
  an abort must not take the test process)."""
  return run_script(script, timeout=120)


def test_callback_slower_than_xla_collective_timeout_does_not_abort():
  proc = _run(SLOW_CALLBACK)
  assert proc.returncode == 0 and proc.stdout.split() == ["56.0", "44.0", "OK"], (
      f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")


def test_sharded_jit_callback_error_reported_once_then_works(mesh, effects_capture):
  x = jax.device_put(jnp.arange(N, dtype=jnp.float32),
                     NamedSharding(mesh, P("i")))

  def boom(v):
    raise RuntimeError("sharded boom")

  bad = je.jit(lambda x: (je.callback(boom, None, x), x)[1])
  ok = je.jit(lambda x: (je.print("ok {}", x.sum()), x)[1])
  # Raised once: by the call if the callback has run when it returns, else by
  # the thread's next barrier.
  got = []
  try:
    bad(x)
  except RuntimeError as exc:
    got.append(exc)
  try:
    je.effects_barrier()
  except RuntimeError as exc:
    got.append(exc)
  assert [str(e) for e in got] == ["sharded boom"]
  je.effects_barrier()
  ok(x)
  assert effects_capture.printed == [f"ok {float(sum(range(N)))}"]


def test_single_device_callback_error_is_still_raised(devices):
  def boom(v):
    raise ZeroDivisionError("single")

  f = je.jit(lambda x: (je.callback(boom, None, x), x)[1])
  with pytest.raises(ZeroDivisionError, match="single"):
    f(jax.device_put(jnp.float32(1), devices[2]))
    je.effects_barrier()
  je.effects_barrier()


def test_multi_to_single_to_multi_device(mesh, devices, effects_capture):
  x8 = jax.device_put(jnp.arange(N, dtype=jnp.int32), NamedSharding(mesh, P("i")))
  f = je.jit(lambda x: (je.print("n={}", x.size), x)[1])
  for r in range(3):
    f(x8)
    f(jax.device_put(jnp.arange(2), devices[7 - r]))
    assert je.runtime_tokens().effects[je.DEFAULT].devices() == {devices[7 - r]}
  assert effects_capture.printed == ["n=8", "n=2"] * 3



TWO_CHAINS = SHORT_COLLECTIVE_TIMEOUT + textwrap.dedent("""
    # (a slow callback outlasts XLA's 1-s abort clock: a collective that
    # waited for it would abort the process)
    SLOW = 1.5
    a, b = je.Effect("chain_a"), je.Effect("chain_b")
    seen = []

    def f(x):
      je.callback(lambda: seen.append("b1"), None, effect=b)
      y = jax.shard_map(
          lambda v: (je.callback(lambda v: seen.append(("a", int(v[0]))),
                                 None, v, effect=a), v + 1)[1],
          mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
      je.callback(lambda: (time.sleep(SLOW), seen.append("b2")), None, effect=b)
      return y

    jf = je.jit(f)
    for _ in range(2):   # the second call gets the per-device token
      print(jf(x).sum())
      je.effects_barrier()
    je.jit(lambda x: (je.callback(lambda: seen.append("next"), None,
                                  effect=b), x)[1])(x)
    je.effects_barrier()
    ones = [s for s in seen if isinstance(s, str)]
    assert ones == ["b1", "b2", "b1", "b2", "next"], seen
    assert sorted(s for s in seen if not isinstance(s, str)) == sorted(
        [("a", d) for d in range(8)] * 2), seen

    # b's once effects in a loop, after a's shard_map: from the second call
    # the token comes per device; b takes it as one scalar at the start, not
    # a vector reduced around its effect in every iteration.
    seen.clear()
    delay = [0.0]

    def slow_b(i):
      if i == 0:   # (the next iteration's effect used to wait for it)
        time.sleep(delay[0])
      seen.append(("b", int(i)))

    def g(x):
      y = jax.shard_map(
          lambda v: (je.callback(lambda v: None, None, v, effect=a), v)[1],
          mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
      return jax.lax.fori_loop(
          0, 2, lambda i, c: (je.callback(slow_b, None, i, effect=b), c + 1)[1],
          y)

    jg = je.jit(g)
    jg(x)
    delay[0] = SLOW
    print(jg(x).sum())
    je.effects_barrier()
    assert seen == [("b", 0), ("b", 1)] * 2, seen
    print("OK")
""")


def test_once_effect_of_a_chain_without_per_device_effects_waits_for_none():
  # Effect b runs once, effect a per device (shard_map): independent chains,
  # so no device waits for b's callbacks. The token returned is per device
  # (a's); b's carrier used to be broadcast from device 0 into it (at the
  # end, and after b's effect in the next call, which gets that token), a
  # collective in which every device waited for b's slow callback: XLA
  # aborted. Now b's real carrier stays in device 0's element, which b's next
  # effect (the max of the elements) and any other computation read.
  proc = _run(TWO_CHAINS)
  assert proc.returncode == 0 and proc.stdout.split() == ["36.0", "36.0", "44.0", "OK"], (
      f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
