"""Under another trace a ``jax_effects.jit`` function is a nested jit, as under ``jax.jit``.

Called under an enclosing trace (eager ``grad``/``vmap``/``jvp``, another
jit, ``make_jaxpr``) the function binds one ``jit`` equation, whatever it
did before: whether it ever ran an effect never changes what it computes,
which errors it raises or how often it traces. Oracle: the same program
with ``jax.jit`` (jaxpr shape, gradients, errors, traces), and under
``jax.disable_jit()`` (the order of the effects). Contract:
``design/architecture.md``, the ``_dispatch`` entry ("Calls under another
trace").
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_effects as je
from jax_effects._dispatch.function import describe

JAX_JIT = jax.jit
JITS = pytest.mark.parametrize("jit", [JAX_JIT, je.jit],
                               ids=["jax.jit", "je.jit"])


def _shape(jaxpr) -> list:
  """The primitives of a jaxpr, a nested jit's as ``(name, [inner])``."""
  out = []
  for eqn in jaxpr.eqns:
    inner = eqn.params.get("jaxpr")
    if eqn.primitive.name in ("jit", "pjit") and inner is not None:
      out.append((eqn.params["name"], _shape(inner.jaxpr)))
    else:
      out.append(eqn.primitive.name)
  return out


def _printing(x):
  je.print("x = {}", x)
  return jnp.sin(x) * 2


def _ran_an_effect(f):
  """Runs ``f`` once at the top level (another signature), as a library's
  shared jit function did before: it is then in its threaded state."""
  f(jnp.ones(3, jnp.float32))
  je.effects_barrier()
  assert describe(f).state in ("threaded", "fast")


@pytest.mark.parametrize("before", ["fresh", "ran an effect"])
def test_make_jaxpr_shows_a_jit_equation_as_for_jax_jit(before):
  f = je.jit(_printing)
  if before != "fresh":
    _ran_an_effect(f)
  x = jnp.float32(1)
  for transform in (lambda g: g, jax.grad, jax.vmap):
    arg = jnp.ones(2) if transform is jax.vmap else x
    ours = jax.make_jaxpr(transform(f))(arg)
    theirs = jax.make_jaxpr(transform(JAX_JIT(_printing)))(arg)
    assert _shape(ours.jaxpr) == _shape(theirs.jaxpr)
    assert ("_printing" in str(ours))


def _integrate_like(jit):
  """A BacksolveAdjoint-like solve (diffrax's): a custom_vjp whose backward
  rule differentiates only array inputs (as equinox's filter_custom_vjp
  does), in a jit function with an effect. Under a nested jit its inputs
  are the jit's tracers (arrays); run inline under eager ``grad`` a Python
  scalar's primal reaches the rule as a float, which it takes for a
  constant (the 0.0 gradients of issue 29)."""

  @jax.custom_vjp
  def integrate(y0, a):   # y(1) of dy/dt = a * y
    return y0 * jnp.exp(a)

  def fwd(y0, a):
    out = integrate(y0, a)
    return out, (out, a)

  def bwd(res, g):
    out, a = res
    ga = jnp.sum(g * out) if isinstance(a, jax.Array) else jnp.zeros(())
    return g * jnp.exp(a), ga

  integrate.defvjp(fwd, bwd)

  @jit
  def solve(y0, a):
    je.print("solving")
    return integrate(y0, a)

  return solve


@pytest.mark.parametrize("before", ["fresh", "ran an effect"])
def test_backsolve_like_gradients_match_jax_jit(before, effects_capture):
  results = {}
  for name, jit in (("jax.jit", JAX_JIT), ("je.jit", je.jit)):
    solve = _integrate_like(jit)
    if before != "fresh":
      solve(jnp.ones(3), jnp.float32(0.5))
    loss = lambda a, solve=solve: solve(2.0, a)
    results[name] = (
        jax.grad(loss)(0.5),                                  # eager grad
        JAX_JIT(jax.grad(loss), static_argnums=0)(0.5),       # in a jit
        je.jit(jax.grad(loss), static_argnums=0)(0.5),        # in ours
        jax.vmap(jax.grad(loss))(jnp.array([0.5, 1.0])))
    je.effects_barrier()
  expected = 2.0 * np.exp(0.5)
  np.testing.assert_allclose(results["jax.jit"][0], expected, rtol=1e-6)
  for ours, theirs in zip(results["je.jit"], results["jax.jit"]):
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def _closure_error(jit, before: bool):
  """A custom_vjp closing over a value being differentiated, inside a jit
  function with an effect (diffrax's test_closure_errors)."""
  box = {}

  def solve(x):
    je.print("solving")

    @jax.custom_vjp
    def h(y):
      return y * box["w"]
    h.defvjp(lambda y: (y * box["w"], None), lambda _, g: (g * box["w"],))
    return h(x)

  jitted = jit(solve)
  if before:
    box["w"] = 1.0
    jitted(jnp.ones(3))

  def run(w):
    box["w"] = w
    return jitted(1.0)

  try:
    JAX_JIT(jax.grad(run))(2.0)
  except Exception as err:  # noqa: BLE001 - the outcome compared
    return type(err)
  return None


@pytest.mark.parametrize("before", [False, True], ids=["fresh", "ran"])
def test_custom_vjp_closure_error_as_under_jax_jit(before):
  expected = _closure_error(JAX_JIT, before)
  je.effects_barrier()
  assert expected is not None and expected.__name__ == "CustomVJPException"
  assert _closure_error(je.jit, before) is expected
  je.effects_barrier()


def _counting(counter):
  def f(x):
    counter[0] += 1
    je.print("f {}", x)
    return jnp.sin(x)
  return f


def test_traced_once_under_eager_transformations(effects_capture):
  counts = {}
  for name, jit in (("jax.jit", JAX_JIT), ("je.jit", je.jit)):
    counter = [0]
    f = jit(_counting(counter))
    x = jnp.float32(0.5)
    f(x)
    for _ in range(3):
      jax.grad(f)(x)
      jax.vmap(f)(jnp.ones(2, jnp.float32))
      jax.jvp(f, (x,), (x,))
    je.effects_barrier()
    counts[name] = counter[0]
  # (jax.jit: once; its transformations reuse the jaxpr)
  assert counts["je.jit"] == counts["jax.jit"] == 1, counts


def _program(f, h):
  """Top-level calls, eager transformations of them and eager effects."""
  x = jnp.float32(0.5)
  h(x)
  jax.grad(f)(x)
  je.print("between")
  jax.vmap(f)(jnp.array([1.0, 2.0], jnp.float32))
  h(jnp.float32(3))
  jax.jvp(f, (x,), (x,))
  f(jnp.float32(4))
  jax.grad(f)(jnp.float32(5))
  h(jnp.float32(6))
  je.effects_barrier()


def test_effects_order_as_under_disable_jit(effects_capture):
  def body(x):
    je.print("f {}", x)
    return jnp.sin(x)

  def other(x):
    je.print("h {}", x)
    return x

  with jax.disable_jit():
    _program(je.jit(body), je.jit(other))
  expected = list(effects_capture.printed)
  effects_capture.clear()
  _program(je.jit(body), je.jit(other))
  assert effects_capture.printed == expected
  assert expected[:4] == ["h 0.5", "f 0.5", "between", "f 1.0"]


def test_callback_error_under_eager_grad_is_raised_by_that_call_once():
  class Boom(Exception):
    pass

  def fail(x):
    raise Boom(float(x))

  @je.jit
  def f(x):
    je.callback(fail, None, x)
    return x * 2

  f_ok = je.jit(lambda x: x + 1)
  f_ok(1.0)
  for transform in (jax.grad, jax.vmap):
    arg = jnp.ones(2) if transform is jax.vmap else jnp.float32(1)
    with pytest.raises(Boom):
      transform(f)(arg)
    je.effects_barrier()   # reported once: nothing left
    f_ok(2.0)


def test_under_an_outer_jax_effects_jit_threads_the_outer_tokens(
    effects_capture):
  f = je.jit(_printing)
  _ran_an_effect(f)
  effects_capture.clear()

  @je.jit
  def outer(x):
    je.print("before")
    y = jax.grad(f)(x) + f(x)
    je.print("after")
    return y

  text = outer.lower(jnp.float32(1)).as_text()
  assert "stablehlo.custom_call" in text
  outer(jnp.float32(1))
  je.effects_barrier()
  assert effects_capture.printed == ["before", "x = 1.0", "x = 1.0", "after"]
  assert describe(outer).state in ("threaded", "fast")


def test_static_argnums_and_kwargs_under_a_trace_as_jax_jit():
  def body(x, n, *, scale):
    je.print("n={}", n)
    return x * n * scale

  ours = je.jit(body, static_argnums=1)
  theirs = JAX_JIT(body, static_argnums=1)
  ours(jnp.float32(1), 2, scale=1.0)
  for f in (ours, theirs):
    g = jax.grad(lambda x, f=f: f(x, 3, scale=2.0))(jnp.float32(1))
    assert float(g) == 6.0
  je.effects_barrier()


def _slow_host(seen, name):
  def host(v):
    time.sleep(0.3)
    seen.append(name)
  return host


def test_eager_transformation_follows_effects_still_running(mesh):
  # A computation over several devices runs on XLA's threads: its slow
  # callback is still running when the call returns. The eager grad's
  # computation (on one device) runs after it, and the next call after the
  # grad's.
  seen = []

  @je.jit
  def slow(x):
    je.callback(_slow_host(seen, "slow"), None, x.sum())
    return x * 2

  @je.jit
  def f(x):
    je.callback(lambda v: seen.append("f"), None, x)
    return jnp.sin(x)

  @je.jit
  def after(x):
    je.callback(lambda v: seen.append("after"), None, x)
    return x

  x = helpers.sharded(mesh, jnp.arange(16.0))
  for _ in range(2):   # (the first round learns the chains)
    seen.clear()
    slow(x)
    jax.grad(f)(jnp.float32(1))
    after(jnp.float32(2))
    je.effects_barrier()
    assert seen == ["slow", "f", "after"]
