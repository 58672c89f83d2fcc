"""Ordered effects across devices: token placement, sharded jit (8 CPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_effects as je

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
  # The token covers all 8 devices; the runtime token is its first shard.
  assert set(je.runtime_tokens().devices) == set(mesh.devices.flat)
  assert len(je.runtime_tokens().effects[je.DEFAULT].devices()) == 1


def test_sharded_jit_callback_placement_is_first_device(mesh):
  where = []
  x = jax.device_put(jnp.arange(N, dtype=jnp.float32),
                     NamedSharding(mesh, P("i")))
  f = je.jit(lambda x: (je.callback(lambda v: where.append(
      (je.placement(), v.shape)), None, x), x)[1])
  f(x)
  je.effects_barrier()
  assert where == [(je.Placement(mesh.devices.flat[0].id, None, 0), (N,))]


def test_sharded_jit_lowering_replicates_tokens(mesh):
  x = jax.ShapeDtypeStruct((N,), jnp.float32, sharding=NamedSharding(mesh, P("i")))
  f = je.jit(lambda x: (je.print("{}", x), x)[1])
  text = f.lower(x).as_text()
  assert "maximal" in text      # the callback runs once (on one device)
  assert "xla_ffi_python_cpu_callback" in text


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
