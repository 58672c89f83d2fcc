"""Programs under a user's mesh context (``jax.set_mesh``, ``with mesh:``).

Our own helper computations (combining a per-device runtime token, the thread's
initial token) must never pick up the user's ambient mesh: after a per-device
(``shard_map``/``pmap``) call, the next ``jax_effects.jit`` call under the same
mesh must not fail with "Received incompatible devices ... _combine"
(``design/placement.md``, "Tokens across devices"). Oracle: the same sequence
of calls with no mesh context, in the deterministic view (per-device output in
a fixed order), prints the same lines. Each scenario runs in a fresh thread
(fresh runtime tokens, and the mesh contexts are thread-local).
"""
import contextlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_effects as je
from helpers import in_thread

N = 8


def _mesh(axis_type, n=N):
  return jax.make_mesh((n,), ("x",), axis_types=(axis_type,),
                       devices=jax.devices()[:n])


def _program(mesh):
  """A per-device step, a step that runs once, a pmap, a named effect."""
  logged = je.Effect("meshes-metrics")

  @je.jit
  def per_device(x):
    def body(b):
      je.print("body {}", b.sum())
      je.print("metric {}", b.sum(), effect=logged)
      return b * 2
    return jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                         out_specs=P("x"))(x)

  @je.jit
  def once(x):
    # (x whole: under an explicit mesh its type says it is sharded)
    je.print("once {} {}", x.sum(), x)
    return x.sum()

  @je.jit
  def pmapped(x):
    return jax.pmap(lambda v: (je.print("pmap {}", v), v + 1)[1])(x)

  def run(xs, context):
    # (JAX refuses pmap under jax.set_mesh: the pmap runs between two blocks)
    with context():
      outs = [per_device(xs), once(xs), per_device(xs + 1), once(xs * 2)]
    outs.append(pmapped(jnp.arange(float(mesh.size))))
    with context():
      outs += [once(xs + 3), per_device(xs)]
    outs.append(once(xs))
    je.effects_barrier()
    return [np.asarray(o) for o in outs]
  return run


def _sharded(mesh):
  return jax.device_put(jnp.arange(float(mesh.size)),
                        NamedSharding(mesh, P("x")))


def _run_in(context_factory, mesh, effects_capture):
  def go():
    with je.deterministic():
      return _program(mesh)(_sharded(mesh), context_factory)
  effects_capture.clear()
  outs = in_thread(go)
  return outs, list(effects_capture.printed)


@contextlib.contextmanager
def _global_set_mesh(mesh):
  setter = jax.set_mesh(mesh)   # the global setter (this thread)
  try:
    yield
  finally:
    # back to no mesh (jax.set_mesh(None) is refused by JAX 0.8 and 0.9)
    setter.__exit__(None, None, None)


@contextlib.contextmanager
def _legacy_with_mesh(mesh):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with mesh:
      yield


CONTEXTS = {
    "set_mesh": lambda mesh: jax.set_mesh(mesh),
    "set_mesh_global": _global_set_mesh,
    "with_mesh": _legacy_with_mesh,
    "use_abstract_mesh": lambda mesh: jax.sharding.use_abstract_mesh(
        mesh.abstract_mesh),
}


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_calls_under_a_mesh_context_print_as_without_one(
    axis_type, effects_capture):
  mesh = _mesh(axis_type)
  expected_outs, expected = _run_in(contextlib.nullcontext, mesh,
                                    effects_capture)
  # the oracle itself: 8 per-device lines per effect per shard_map call
  assert sum(line.endswith("body 0.0") for line in expected) == 2
  assert len(expected) == 3 * (8 + 8) + 4 + 8
  for context in sorted(CONTEXTS):
    outs, printed = _run_in(lambda: CONTEXTS[context](mesh), mesh,
                            effects_capture)
    assert printed == expected, context
    for a, b in zip(outs, expected_outs):
      np.testing.assert_array_equal(a, b, err_msg=context)


def test_first_call_of_a_thread_inside_a_mesh_on_a_subset_of_devices(
    effects_capture):
  # the thread's initial token is created under a 4-device mesh; later calls
  # run outside it and on other devices
  mesh = _mesh(AxisType.Explicit, 4)

  @je.jit
  def once(x):
    je.print("once {}", x)
    return x + 1

  def go():
    with jax.set_mesh(mesh):
      once(jnp.float32(1))
    _program(mesh)(_sharded(mesh), lambda: jax.set_mesh(mesh))
    once(jnp.float32(2))
    once(jax.device_put(jnp.float32(3), jax.devices()[7]))
    je.effects_barrier()

  in_thread(go)
  printed = effects_capture.printed
  assert printed[0] == "once 1.0" and printed[-2:] == ["once 2.0", "once 3.0"]
  assert len(printed) == 1 + 3 * (4 + 4) + 4 + 4 + 2


def test_deterministic_view_under_set_mesh_releases_in_order(effects_capture):
  mesh = _mesh(AxisType.Explicit)

  @je.jit
  def per_device(x):
    def body(b):
      je.print("p {}", b.sum())
      return b
    return jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                         out_specs=P("x"))(x)

  @je.jit
  def once(x):
    je.print("once")
    return x

  def go():
    with jax.set_mesh(mesh), je.deterministic():
      xs = _sharded(mesh)
      per_device(xs)
      once(1.0)
      per_device(xs)
  in_thread(go)
  per = [f"[device {d} shard {d} process 0] p {float(d)}" for d in range(N)]
  assert effects_capture.printed == [*per, "once", *per]


def _shard_lines(lines):
  """``"shard S text"`` of per-device lines (the device id left out: under
  an abstract mesh the lowering may not know it)."""
  out = []
  for line in lines:
    m = re.match(r"^\[device (\S+) shard (\d+) process 0\] (.*)$", line)
    assert m, line
    out.append(f"shard {m.group(2)} {m.group(3)}")
  return out


def test_shard_map_from_the_context_mesh_outside_the_context_is_jaxs_error(
    effects_capture):
  # A shard_map without mesh= takes the mesh of jax.set_mesh; called later
  # outside that context, either it runs as before (a cached executable) or
  # the user gets JAX's own message (as with jax.jit and jax.debug.print),
  # never an internal error of ours ("AbstractMesh does not implement
  # devices", from our lowering, before).
  mesh = _mesh(AxisType.Auto)

  @je.jit
  def g(x):
    def body(v):
      je.print("s {}", v[0])
      return v * 2
    return jax.shard_map(body, in_specs=P("x"), out_specs=P("x"))(x)

  x = jnp.arange(float(N))
  with jax.set_mesh(mesh):
    g(x)
    je.effects_barrier()
  assert sorted(_shard_lines(effects_capture.printed)) == [
      f"shard {d} s {float(d)}" for d in range(N)]
  effects_capture.clear()
  try:
    g(x)
    je.effects_barrier()
  except ValueError as err:
    assert "context mesh cannot be empty" in str(err)
  else:
    assert sorted(_shard_lines(effects_capture.printed)) == [
        f"shard {d} s {float(d)}" for d in range(N)]
  with jax.set_mesh(mesh):   # a new signature, lowered under the context
    g(jnp.arange(float(N)).astype(jnp.float16))
  with pytest.raises(ValueError, match="context mesh cannot be empty"):
    g(jnp.arange(N))   # a new signature, lowered outside any context
