"""Per-device effects in shard_map and pmap (8 simulated CPU devices;
``design/placement.md``: "Three placements", "Order across devices, and the
deterministic view").

Each per-device line carries ``[device D shard S process P]``; tests group the
output by device and compare each device's sequence with what program order
gives, since devices run concurrently (except in the deterministic view).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_effects as je

N = 8
PREFIX = re.compile(r"^\[device (\d+) shard (\S+|\(.*?\)) process (\d+)\] (.*)$")


def by_device(lines):
  """device id -> [text, ...] for per-device lines; '*' -> other lines."""
  out = {}
  for line in lines:
    m = PREFIX.match(line)
    key = int(m.group(1)) if m else "*"
    out.setdefault(key, []).append(m.group(4) if m else line)
  return out


@pytest.mark.parametrize("check_vma", [True, False])
def test_per_device_program_order_across_calls(mesh, effects_capture, check_vma):
  def body(x):
    je.print("a {}", x[0])
    y = x * 2
    je.print("b {}", y[0])
    return y

  f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                           check_vma=check_vma))
  for call in range(3):
    out = f(jnp.arange(N, dtype=jnp.float32) + 10 * call)
    np.testing.assert_allclose(out, 2 * (np.arange(N) + 10 * call))
  got = by_device(effects_capture.printed)
  assert sorted(got) == list(range(N))
  for d in range(N):
    expected = []
    for call in range(3):
      v = float(d + 10 * call)
      expected += [f"a {v}", f"b {2 * v}"]
    assert got[d] == expected, d


def test_prefix_names_device_shard_process(mesh, effects_capture):
  f = je.jit(jax.shard_map(lambda x: (je.print("x={}", x[0]), x)[1], mesh=mesh,
                           in_specs=P("i"), out_specs=P("i")))
  f(jnp.arange(N, dtype=jnp.int32) * 100)
  lines = sorted(effects_capture.printed)
  assert lines == sorted(f"[device {d} shard {d} process 0] x={100 * d}"
                         for d in range(N))


def test_2d_mesh_shard_index_is_a_tuple(effects_capture):
  mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  f = je.jit(jax.shard_map(lambda x: (je.print("v={}", x[0, 0]), x)[1],
                           mesh=mesh2, in_specs=P("a", "b"),
                           out_specs=P("a", "b")))
  f(jnp.arange(N, dtype=jnp.int32).reshape(2, 4))
  expected = sorted(f"[device {d} shard ({d // 4}, {d % 4}) process 0] v={d}"
                    for d in range(N))
  assert sorted(effects_capture.printed) == expected


def test_placement_inside_per_device_callback(mesh):
  def where(x):
    p = je.placement()
    return np.array([p.device_id, p.shard_index, p.process_index], np.int32)

  f = je.jit(jax.shard_map(
      lambda x: je.callback(where, jax.ShapeDtypeStruct((3,), jnp.int32), x),
      mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  out = np.asarray(f(jnp.zeros(N))).reshape(N, 3)
  assert out.tolist() == [[d, d, 0] for d in range(N)]


def test_effects_before_and_after_shard_map_stay_in_order(mesh, effects_capture):
  def f(x):
    je.print("before {}", x.sum())
    y = jax.shard_map(lambda v: (je.print("in {}", v[0]), v + 1)[1], mesh=mesh,
                      in_specs=P("i"), out_specs=P("i"))(x)
    je.print("after {}", y.sum())
    return y

  jf = je.jit(f)
  for call in range(3):
    jf(jnp.arange(N, dtype=jnp.float32) * (call + 1))
  lines = effects_capture.printed
  assert len(lines) == 3 * (N + 2)
  for call in range(3):
    chunk = lines[call * (N + 2):(call + 1) * (N + 2)]
    s = (call + 1) * sum(range(N))
    assert chunk[0] == f"before {float(s)}"
    assert chunk[-1] == f"after {float(s + N)}"
    assert sorted(by_device(chunk[1:-1])) == list(range(N))


def test_control_flow_and_results_inside_shard_map(mesh, effects_capture):
  def body(x):
    def step(i, c):
      je.print("it {} {}", i, c)
      return c + 1
    c = jax.lax.fori_loop(0, 2, step, x[0])
    c = jax.lax.cond(c > 4, lambda c: (je.print("big {}", c), c)[1],
                     lambda c: (je.print("small {}", c), c)[1], c)
    r = je.callback(lambda v: (v * 10).astype(np.int32),
                    jax.ShapeDtypeStruct((1,), jnp.int32), x)
    return r + c

  f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  out = f(jnp.arange(N, dtype=jnp.int32))
  assert np.asarray(out).tolist() == [10 * d + d + 2 for d in range(N)]
  got = by_device(effects_capture.printed)
  for d in range(N):
    last = f"big {d + 2}" if d + 2 > 4 else f"small {d + 2}"
    assert got[d] == [f"it 0 {d}", f"it 1 {d + 1}", last]


def test_pmap_under_jit_is_per_device(effects_capture):
  f = je.jit(jax.pmap(lambda v: (je.print("pm {}", v), v + 1)[1]))
  for call in range(2):
    out = f(jnp.arange(N, dtype=jnp.int32) + call)
    assert np.asarray(out).tolist() == list(range(1 + call, N + 1 + call))
  got = by_device(effects_capture.printed)
  assert got == {d: [f"pm {d}", f"pm {d + 1}"] for d in range(N)}


def test_pmap_axis_name_and_collectives(effects_capture):
  def g(v):
    s = jax.lax.psum(v, "d")
    je.print("v={} s={}", v, s)
    return s

  f = je.jit(jax.pmap(g, axis_name="d"))
  f(jnp.arange(N, dtype=jnp.int32))
  got = by_device(effects_capture.printed)
  assert got == {d: [f"v={d} s={sum(range(N))}"] for d in range(N)}


def errors_reported(call, exc_type):
  """The ``exc_type`` errors raised by ``call()`` and then by barriers (each
  barrier raises one pending error), until a barrier raises none."""
  got = []
  try:
    call()
  except exc_type as exc:
    got.append(exc)
  while True:
    try:
      je.effects_barrier()
      return got
    except exc_type as exc:
      got.append(exc)


def test_error_inside_shard_map_reported_once_then_calls_work(
    mesh, effects_capture):
  def fail_on_3(v):
    if int(v[0]) == 3:
      raise ValueError("device three says no")

  bad = je.jit(jax.shard_map(
      lambda x: (je.callback(fail_on_3, None, x), je.print("bad {}", x[0]),
                 x)[2],
      mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  good = je.jit(jax.shard_map(lambda x: (je.print("good {}", x[0]), x)[1],
                              mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  # The devices' parts cannot fail (the others would wait forever): the error
  # is raised by the dispatching call if the callback has run by the time it
  # returns, else by the thread's next barrier; once.
  got = errors_reported(lambda: bad(jnp.arange(N, dtype=jnp.int32)),
                        ValueError)
  assert [str(e) for e in got] == ["device three says no"]
  effects_capture.clear()
  bad(jnp.arange(N, dtype=jnp.int32) + 10)   # no device fails now
  good(jnp.arange(N, dtype=jnp.int32))
  je.effects_barrier()
  got = by_device(effects_capture.printed)
  assert got == {d: [f"bad {d + 10}", f"good {d}"] for d in range(N)}


def test_every_device_fails_each_error_reported_once(mesh):
  def boom(v):
    raise KeyError(f"device {int(v[0])}")

  f = je.jit(jax.shard_map(lambda x: (je.callback(boom, None, x), x)[1],
                           mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  # The errors of one execution are reported together, once (design/errors.md).
  got = errors_reported(lambda: f(jnp.arange(N, dtype=jnp.int32)),
                        ExceptionGroup)
  assert len(got) == 1
  assert sorted(e.args[0] for e in got[0].exceptions) == [
      f"device {d}" for d in range(N)]
  je.effects_barrier()


def test_mixing_shard_map_and_plain_computations_in_one_thread(
    mesh, effects_capture):
  sm = je.jit(jax.shard_map(lambda x: (je.print("sm {}", x[0]), x)[1],
                            mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  one = je.jit(lambda x: (je.print("one {}", x.sum()), x)[1])
  for r in range(3):
    sm(jnp.full(N, r))
    one(jax.device_put(jnp.full(2, r), jax.devices()[r + 2]))
    sm(jnp.full(N, r + 100))
  lines = effects_capture.printed
  # A single-device effect follows all per-device ones of the previous
  # dispatch on the same effect (and precedes the next ones).
  chunks = [lines[i:i + 2 * N + 1] for i in range(0, len(lines), 2 * N + 1)]
  for r, chunk in enumerate(chunks):
    assert chunk[N] == f"one {2 * r}"
    assert {m for m in chunk[:N]} == {
        f"[device {d} shard {d} process 0] sm {r}" for d in range(N)}
    assert {m for m in chunk[N + 1:]} == {
        f"[device {d} shard {d} process 0] sm {r + 100}" for d in range(N)}


def test_deterministic_view_orders_by_program_point_then_device(
    mesh, effects_capture):
  def body(x):
    je.print("p1 {}", x[0])
    je.print("p2 {}", x[0] * 2)
    return x

  f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  expected = []
  for k in (0, 1):
    for point, scale in (("p1", 1), ("p2", 2)):
      expected += [f"[device {d} shard {d} process 0] {point} {(d + k) * scale}"
                   for d in range(N)]
  runs = []
  for _ in range(2):
    effects_capture.clear()
    with je.deterministic():
      f(jnp.arange(N, dtype=jnp.int32))
      # released when the shard_map execution ends, not when the block exits
      assert effects_capture.printed == expected[:2 * N]
      f(jnp.arange(N, dtype=jnp.int32) + 1)
    runs.append(effects_capture.printed)
  assert runs[0] == expected
  assert runs[1] == expected


def test_deterministic_view_two_effects_per_effect_mode(mesh, effects_capture):
  a, b = je.Effect("det_a"), je.Effect("det_b")

  def body(x):
    je.print("A {}", x[0], effect=a)
    je.print("B {}", x[0], effect=b)
    je.print("A2 {}", x[0], effect=a)
    return x

  f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  with je.deterministic():
    f(jnp.arange(N, dtype=jnp.int32))
  lines = effects_capture.printed
  a_lines = [l for l in lines if "] A" in l]
  b_lines = [l for l in lines if "] B" in l]
  assert a_lines == ([f"[device {d} shard {d} process 0] A {d}" for d in range(N)]
                     + [f"[device {d} shard {d} process 0] A2 {d}"
                        for d in range(N)])
  assert b_lines == [f"[device {d} shard {d} process 0] B {d}" for d in range(N)]


def test_deterministic_view_global_mode_and_log_records(mesh, effects_capture,
                                                        caplog):
  caplog.set_level("INFO", logger="jax_effects")

  def body(x):
    je.print("p {}", x[0])
    je.log("l {}", x[0])
    return x

  f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  with je.ordering("global"), je.deterministic():
    f(jnp.arange(N, dtype=jnp.int32))
  recs = effects_capture.logged
  assert [(r.device_id, r.getMessage()) for r in recs] == [
      (d, f"l {d}") for d in range(N)]
  assert effects_capture.printed == [
      f"[device {d} shard {d} process 0] p {d}" for d in range(N)]


def test_partially_manual_shard_map_is_a_clear_error():
  mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  f = je.jit(jax.shard_map(lambda x: (je.print("{}", x), x)[1], mesh=mesh2,
                           in_specs=P("a"), out_specs=P("a"),
                           axis_names={"a"}))
  with pytest.raises(NotImplementedError, match="manually"):
    f(jnp.zeros((2, 4)))


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_shard_map_in_scan_body_after_once_effect(mesh, effects_capture, loop):
  # A scan body (and a fori_loop with static bounds, a scan) is a loop: the
  # shard_map's per-device carriers are reduced to the scalar carry there
  # (the pass treated a top-level scan's body as the top level and kept them
  # per device: "carry input and carry output must have equal types").
  def body(i, x):
    je.print("once {}", i)
    return jax.shard_map(lambda v: (je.print("dev {} {}", i, v[0]), v + 1)[1],
                         mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)

  if loop == "scan":
    f = je.jit(lambda x: jax.lax.scan(
        lambda c, i: (body(i, c), None), x, jnp.arange(3))[0])
  else:
    f = je.jit(lambda x: jax.lax.fori_loop(0, 3, body, x))
  expected = []
  for call in range(2):
    for i in range(3):
      expected.append(f"once {i}")
      expected += [f"[device {d} shard {d} process 0] dev {i} {d + i + 3 * call}"
                   for d in range(N)]
  with je.deterministic():
    for call in range(2):
      out = f(jnp.arange(N, dtype=jnp.int32) + 3 * call)
      np.testing.assert_array_equal(out, np.arange(N) + 3 * call + 3)
  assert effects_capture.printed == expected


def test_per_device_token_passed_back_into_a_mesh_with_explicit_axes():
  # The token a shard_map program returns is kept per device and passed to
  # the next call; over a mesh with Explicit axes (jax.make_mesh's default
  # from JAX 0.9) it arrives typed as replicated, which shard_map's in_specs
  # check refused on the second call.
  seen = []
  mesh = jax.make_mesh((2,), ("i",),
                       axis_types=(jax.sharding.AxisType.Explicit,))

  @je.jit
  def f(x):
    je.callback(lambda v: seen.append(("before", float(v))), None, x)
    y = jax.shard_map(
        lambda v: (je.callback(lambda w: seen.append(("in", float(w))),
                               None, v), v + 1)[1],
        mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(x)
    je.callback(lambda v: seen.append(("after", float(v))), None, y)
    return y

  for i in range(3):
    assert float(f(jnp.float32(i))) == i + 1
  je.effects_barrier()
  assert seen == [e for i in range(3) for e in
                  [("before", i), ("in", i), ("in", i), ("after", i + 1)]]
