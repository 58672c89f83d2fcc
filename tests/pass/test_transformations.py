"""Effects under JAX transformations: vmap, jvp/grad/linearize/vjp, checkpoint,
vmap of while/cond/scan (liveness), and plain ``jax.jit``
(``design/transformations.md``: "vmap", "Differentiation: jvp, grad,
linearize, vjp, checkpoint", "Plain ``jax.jit`` and eager execution").

Each test records what the host saw (``Recorder``) and asserts the exact
sequence. Most run three ways: eagerly, under ``jax_effects.jit``, and (where
the plain-``jax.jit`` fallback gives the same semantics) under ``jax.jit``.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_effects as je


from helpers import RUNNERS, Recorder
ALL_RUNNERS = RUNNERS + [pytest.param(jax.jit, id="jax.jit")]


# --- vmap ------------------------------------------------------------------------

@pytest.mark.parametrize("run", ALL_RUNNERS)
def test_vmap_runs_once_per_element_in_batch_order(run, effects_capture):
  def f(x, y):
    je.print("x={} y={}", x, y)
    return x * y

  out = run(jax.vmap(f, in_axes=(0, None)))(jnp.arange(4), 10)
  np.testing.assert_array_equal(out, [0, 10, 20, 30])
  assert effects_capture.printed == [f"x={i} y=10" for i in range(4)]


@pytest.mark.parametrize("run", ALL_RUNNERS)
def test_vmap_callback_returns_each_elements_result(run):
  calls = []

  def host(x, k):
    calls.append((x.tolist(), int(k)))
    return (x.sum() * k).astype(np.int32)

  def f(x, k):
    return je.callback(host, jax.ShapeDtypeStruct((), jnp.int32), x, k)

  xs = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  out = run(jax.vmap(f, in_axes=(1, None)))(xs, 2)   # batch axis 1, size 3
  je.effects_barrier()
  np.testing.assert_array_equal(out, [6, 10, 14])
  assert calls == [([0, 3], 2), ([1, 4], 2), ([2, 5], 2)]


@pytest.mark.parametrize("run", RUNNERS)
def test_nested_vmap_is_row_major(run):
  rec = Recorder()

  def f(x, y):
    rec("xy", x, y)
    return x + y

  g = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))
  out = run(g)(jnp.arange(2), 10 * jnp.arange(3))
  assert out.shape == (3, 2)
  assert rec.take() == [("xy", x, y) for y in (0, 10, 20) for x in (0, 1)]


@pytest.mark.parametrize("run", ALL_RUNNERS)
def test_vmap_effect_without_batched_operands_runs_once(run):
  # As jax.debug.print: nothing depends on the batch index, so one run.
  rec = Recorder()

  def f(x):
    rec("tick")
    rec("k", 7)
    return x + 1

  run(jax.vmap(f))(jnp.arange(3))
  assert rec.take() == [("tick",), ("k", 7)]


@pytest.mark.parametrize("run", RUNNERS)
def test_vmap_keeps_program_order_between_effects(run, effects_capture):
  def f(x):
    je.print("a{}", x)
    je.print("b{}", x)
    return x

  run(jax.vmap(f))(jnp.arange(2))
  assert effects_capture.printed == ["a0", "a1", "b0", "b1"]


def test_vmap_result_shape_error_names_callback():
  def f(x):
    return je.callback(lambda v: np.zeros(2, np.float32),
                       jax.ShapeDtypeStruct((), jnp.float32), x)
  with pytest.raises(TypeError, match=r"callback\(.*lambda.*result #0 has shape \(2,\)"):
    je.jit(jax.vmap(f))(jnp.arange(3.0))
  # the runtime keeps working
  assert je.jit(jax.vmap(lambda x: x + 1))(jnp.arange(2)).tolist() == [1, 2]


# --- vmap of control flow ----------------------------------------------------------

def _counting_loop(rec, effect_in_cond):
  def f(n):
    def cond(c):
      if effect_in_cond:
        rec("cond", n, c[0])
      return c[0] < n

    def body(c):
      i, s = c
      rec("body", n, i)
      return i + 1, s + i

    return lax.while_loop(cond, body, (0, 0))
  return f


def _expected_loop(ns, effect_in_cond):
  """What each element does alone, interleaved iteration by iteration."""
  seen = []
  for it in range(max(ns) + 1):
    for n in ns:   # cond of iteration `it` for the elements still live
      if it <= n and effect_in_cond:
        seen.append(("cond", n, it))
    for n in ns:
      if it < n:
        seen.append(("body", n, it))
  return seen


@pytest.mark.parametrize("effect_in_cond", [False, True])
def test_vmap_of_while_runs_only_live_iterations(effect_in_cond):
  rec = Recorder()
  ns = [1, 3, 0, 2]
  f = _counting_loop(rec, effect_in_cond)
  i, s = je.jit(jax.vmap(f))(jnp.array(ns))
  np.testing.assert_array_equal(i, ns)
  np.testing.assert_array_equal(s, [n * (n - 1) // 2 for n in ns])
  assert rec.take() == _expected_loop(ns, effect_in_cond)
  # Differential: each element's own effects are exactly what lax.map
  # (one element at a time) produces for it.
  je.jit(lambda ns: lax.map(f, ns))(jnp.array(ns))
  sequential = rec.take()
  vmapped = _expected_loop(ns, effect_in_cond)
  for n in ns:
    assert ([e for e in vmapped if e[1] == n]
            == [e for e in sequential if e[1] == n])


def test_nested_vmap_of_while_uses_each_elements_liveness():
  rec = Recorder()
  f = _counting_loop(rec, effect_in_cond=False)
  ns = jnp.array([[1, 0], [2, 1]])
  i, _ = je.jit(jax.vmap(jax.vmap(f)))(ns)
  np.testing.assert_array_equal(i, ns)
  assert rec.take() == [("body", 1, 0), ("body", 2, 0), ("body", 1, 0),
                        ("body", 2, 1)]


def test_vmap_of_while_with_ambiguous_axes_is_an_error():
  rec = Recorder()

  def f(n, x):   # the predicate depends on n only
    def body(c):
      rec("x", x)
      return c + 1
    return lax.while_loop(lambda c: c < n, body, 0) + x

  g = jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None))
  with pytest.raises(NotImplementedError, match="while_loop.*ambiguous"):
    je.jit(g)(jnp.array([1, 2]), jnp.array([5, 6]))
  # different sizes: unambiguous
  je.jit(g)(jnp.array([1, 2]), jnp.array([5, 6, 7]))
  assert rec.take() == [("x", 5), ("x", 6), ("x", 7)] * 2 + [("x", 5), ("x", 6), ("x", 7)]


def test_vmap_of_scan_runs_every_iteration_of_every_element():
  rec = Recorder()

  def f(x):
    def body(c, y):
      rec("s", c, y)
      return c + y, None
    return lax.scan(body, x, jnp.arange(2))[0]

  out = je.jit(jax.vmap(f))(jnp.arange(3))
  np.testing.assert_array_equal(out, [1, 2, 3])
  assert rec.take() == [("s", 0, 0), ("s", 1, 0), ("s", 2, 0),
                        ("s", 0, 1), ("s", 1, 1), ("s", 2, 1)]


def _branchy(rec):
  def f(p, x):
    return lax.cond(p, lambda x: (rec("T", x), x + 1)[1],
                    lambda x: (rec("F", x), x - 1)[1], x)
  return f


@pytest.mark.parametrize("run", ALL_RUNNERS)
def test_vmap_of_cond_with_unbatched_predicate_runs_taken_branch(run):
  rec = Recorder()
  out = run(jax.vmap(_branchy(rec), in_axes=(None, 0)))(False, jnp.arange(3))
  np.testing.assert_array_equal(out, [-1, 0, 1])
  assert rec.take() == [("F", 0), ("F", 1), ("F", 2)]


@pytest.mark.parametrize("run", ALL_RUNNERS)
def test_vmap_of_cond_with_batched_predicate_runs_taken_branches(run):
  # (tests/primitives/test_vmap_cond.py has the details)
  rec = Recorder()
  g = jax.vmap(_branchy(rec))
  out = run(g)(jnp.array([True, False]), jnp.arange(2))
  np.testing.assert_array_equal(out, [1, 0])
  assert rec.take() == [("F", 1), ("T", 0)]
  # lax.map runs the same effects, element after element
  out = je.jit(lambda p, x: lax.map(lambda a: _branchy(rec)(*a), (p, x)))(
      jnp.array([True, False]), jnp.arange(2))
  np.testing.assert_array_equal(out, [1, 0])
  assert rec.take() == [("T", 0), ("F", 1)]


# --- differentiation ---------------------------------------------------------------

def _f(rec):
  def f(x):
    rec("f", x)
    return jnp.sin(x) * 2
  return f


DIFF = {
    "grad": lambda f, x: jax.grad(f)(x),
    "jvp": lambda f, x: jax.jvp(f, (x,), (1.0,))[1],
    "linearize": lambda f, x: jax.linearize(f, x)[1](1.0),
    "vjp": lambda f, x: jax.vjp(f, x)[1](1.0)[0],
    "checkpoint_grad": lambda f, x: jax.grad(jax.checkpoint(f))(x),
    "grad_grad": lambda f, x: -jax.grad(jax.grad(f))(x) * 2 / jnp.tan(x) / 2,
}


@pytest.mark.parametrize("run", ALL_RUNNERS)
@pytest.mark.parametrize("how", sorted(DIFF))
def test_effect_runs_once_with_primal_values_under_differentiation(run, how):
  rec = Recorder()
  f = _f(rec)
  d = run(lambda x: DIFF[how](f, x))(jnp.float32(0.5))
  np.testing.assert_allclose(d, 2 * np.cos(0.5), rtol=1e-5)
  assert rec.take() == [("f", 0.5)]


@pytest.mark.parametrize("run", RUNNERS)
def test_checkpointed_scan_does_not_rerun_effects_on_the_backward_pass(run):
  rec = Recorder()
  f = jax.checkpoint(_f(rec))

  def loss(x):
    return lax.scan(lambda c, _: (f(c), None), x, None, length=3)[0]

  run(jax.grad(loss))(jnp.float32(0.5))
  seen = rec.take()
  assert [t for t, _ in seen] == ["f"] * 3
  np.testing.assert_allclose([v for _, v in seen],
                             [0.5, 2 * np.sin(0.5), 2 * np.sin(2 * np.sin(0.5))],
                             rtol=1e-5)


@pytest.mark.parametrize("run", RUNNERS)
def test_callback_results_have_zero_tangent(run):
  def f(x):
    y = je.callback(lambda v: v * 3, jax.ShapeDtypeStruct((), jnp.float32), x)
    return x * 2 + y

  assert float(run(jax.grad(f))(jnp.float32(1.0))) == 2.0


@pytest.mark.parametrize("run", RUNNERS)
def test_vmap_of_grad(run):
  rec = Recorder()
  out = run(jax.vmap(jax.grad(_f(rec))))(jnp.array([0.0, 1.0], jnp.float32))
  np.testing.assert_allclose(out, 2 * np.cos([0.0, 1.0]), rtol=1e-5)
  assert rec.take() == [("f", 0.0), ("f", 1.0)]


# --- plain jax.jit -----------------------------------------------------------------

def test_plain_jit_keeps_program_order_within_and_across_calls(effects_capture):
  @jax.jit
  def f(x):
    for i in range(12):
      je.print("{}:{}", x, i)
      x = x + 1
    return x

  x = jnp.int32(0)
  for _ in range(3):
    x = f(x) * 0 + x + 100
  je.print("eager")
  expected = [f"{100 * k + i}:{i}" for k in range(3) for i in range(12)]
  expected.append("eager")
  assert effects_capture.printed == expected


def test_plain_jit_effects_on_several_devices_run_once_in_order(effects_capture):
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip("needs several devices")
  mesh = jax.make_mesh((len(devices),), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  xs = jax.device_put(jnp.arange(len(devices)), sharding)

  @jax.jit
  def f(xs):
    je.print("first")
    s = jnp.sum(xs)
    je.print("sum={}", s)
    return xs * 2

  f(xs)
  f(xs)
  assert effects_capture.printed == [
      "first", f"sum={sum(range(len(devices)))}"] * 2


def test_plain_jit_inside_jax_effects_jit_is_threaded(effects_capture):
  inner = jax.jit(lambda x: (je.print("inner {}", x), x + 1)[1])

  @je.jit
  def f(x):
    je.print("before")
    x = inner(x)
    je.print("after")
    return x

  assert int(f(1)) == 2
  assert effects_capture.printed == ["before", "inner 1", "after"]
