"""Forward-mode derivatives and the vmap rule "no batched operand, one run"
(``design/transformations.md``: "vmap", "Differentiation: jvp, grad,
linearize, vjp, checkpoint").

``jax.jacfwd``/``jax.hessian`` are ``vmap`` of ``jvp`` over tangent
directions: an effect sees only primal values, which vmap does not batch, so
it runs once, as ``jax.debug.print`` does (the oracle here: the same program
with ``jax.debug.callback`` recording what JAX runs). Batched operands still
run once per element, in batch order. Inside a ``while_loop`` whose predicate
vmap batched, an effect depends on the batch index through the predicate and
runs per live element even without batched operands.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_effects as je


def eager(f):
  return f


RUNNERS = [pytest.param(eager, id="eager"), pytest.param(je.jit, id="je.jit"),
           pytest.param(jax.jit, id="jax.jit")]


def _recorder():
  seen = []

  def ours(tag, *args):
    je.callback(lambda *v: seen.append((tag, *(np.asarray(a).tolist() for a in v))),
                None, *args)

  def theirs(tag, *args):
    jax.debug.callback(
        lambda *v: seen.append((tag, *(np.asarray(a).tolist() for a in v))),
        *args, ordered=False)

  def take():
    je.effects_barrier()
    jax.effects_barrier()
    out = list(seen)
    seen.clear()
    return out
  return ours, theirs, take


def _loss(rec):
  def loss(x):
    rec("loss", x.sum())
    y = jnp.sum(x ** 3)
    def body(i, c):
      rec("it", i, c)
      return c + x[i] * c
    return lax.fori_loop(0, 2, body, y)
  return loss


TRANSFORMS = {
    "hessian": jax.hessian,
    "jacfwd": jax.jacfwd,
    "jacfwd_jacrev": lambda f: jax.jacfwd(jax.jacrev(f)),
    "jacfwd_jacfwd": lambda f: jax.jacfwd(jax.jacfwd(f)),
    "vmap_jvp": lambda f: (lambda x: jax.vmap(
        lambda t: jax.jvp(f, (x,), (t,))[1])(jnp.eye(x.shape[0]))),
}


@functools.cache
def _jax_runs(how: str):
  """JAX's value of transform ``how`` of the loss (plain jax.jit, no
  effects), its value with ``jax.debug.callback`` (eager) and the calls JAX
  ran there: the same for every runner, so computed once per transform."""
  _, theirs, take = _recorder()
  x = jnp.arange(1.0, 5.0)
  expected_value = jax.jit(TRANSFORMS[how](_loss(lambda *a: None)))(x)
  reference = TRANSFORMS[how](_loss(theirs))(x)
  return expected_value, reference, take()


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("how", sorted(TRANSFORMS))
def test_forward_mode_runs_effects_once_like_jax_debug(run, how):
  ours, _, take = _recorder()
  x = jnp.arange(1.0, 5.0)
  expected_value, reference, want = _jax_runs(how)
  assert want == [("loss", 10.0), ("it", 0, 100.0), ("it", 1, 200.0)]
  out = run(TRANSFORMS[how](_loss(ours)))(x)
  assert take() == want
  np.testing.assert_allclose(out, expected_value)
  np.testing.assert_allclose(reference, expected_value)


@pytest.mark.parametrize("run", RUNNERS)
def test_stateful_callback_runs_once_under_hessian(run, effects_capture):
  calls = []

  def loss(x):
    je.print("loss at {}", x)
    je.callback(lambda v: calls.append(v.tolist()), None, x)
    return jnp.sum(jnp.sin(x))

  x = jnp.arange(4.0)
  h = run(jax.hessian(loss))(x)
  je.effects_barrier()
  np.testing.assert_allclose(h, jnp.diag(-jnp.sin(x)), rtol=1e-6)
  assert calls == [[0.0, 1.0, 2.0, 3.0]]
  assert effects_capture.printed == ["loss at [0. 1. 2. 3.]"]


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("transform", [jax.jacfwd, jax.hessian, jax.jacrev])
def test_callback_result_feeding_the_loss(run, transform):
  calls = []

  def scale(v):
    calls.append(v.tolist())
    return (2 * v).astype(v.dtype)

  def loss(x):
    y = je.callback(scale, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jnp.sum(y * x ** 3)

  def reference(x):   # a host result has a zero tangent, as stop_gradient
    return jnp.sum(lax.stop_gradient(2 * x) * x ** 3)

  x = jnp.arange(1.0, 4.0)
  out = run(transform(loss))(x)
  je.effects_barrier()
  np.testing.assert_allclose(out, transform(reference)(x), rtol=1e-6)
  assert calls == [[1.0, 2.0, 3.0]]


@pytest.mark.parametrize("run", RUNNERS)
def test_vmap_of_jvp_with_batched_primals_runs_per_element(run):
  ours, theirs, take = _recorder()

  def f(x):
    ours("x", x)
    return x ** 2

  xs = jnp.arange(3.0)
  out = run(jax.vmap(lambda x: jax.jvp(f, (x,), (1.0,))))(xs)
  np.testing.assert_allclose(out[1], 2 * xs)
  assert take() == [("x", 0.0), ("x", 1.0), ("x", 2.0)]


@pytest.mark.parametrize("run", RUNNERS)
def test_unbatched_callback_result_stays_unbatched(run):
  calls = []

  def f(x, k):
    y = je.callback(lambda k: (calls.append(int(k)), k * 10)[1],
                    jax.ShapeDtypeStruct((), jnp.int32), k)
    return x + y

  out = run(jax.vmap(f, in_axes=(0, None)))(jnp.arange(3), 4)
  je.effects_barrier()
  np.testing.assert_array_equal(out, [40, 41, 42])
  assert calls == [4]


def test_vmap_of_while_effect_without_batched_operands_runs_per_live_element():
  seen = []

  def f(n):
    def body(i):
      je.callback(lambda: seen.append("tick"), None)
      return i + 1
    return lax.while_loop(lambda i: i < n, body, 0)

  ns = jnp.array([2, 0, 3])
  np.testing.assert_array_equal(je.jit(jax.vmap(f))(ns), ns)
  je.effects_barrier()
  assert seen == ["tick"] * int(ns.sum())
  seen.clear()
  # an unbatched predicate: one run per iteration
  je.jit(jax.vmap(f, in_axes=None, axis_size=3))(2)
  je.effects_barrier()
  assert seen == ["tick"] * 2


def _while_loss(rec):
  def loss(x):
    def body(c):
      i, y = c
      rec("body", i)
      return i + 1, y * x
    n = jnp.int32(jnp.sum(x) > 0) + 1     # 2 iterations
    return lax.while_loop(lambda c: (rec("cond", c[0]), c[0] < n)[1], body,
                          (0, x))[1].sum()
  return loss


@functools.cache
def _jax_while_runs(how: str):
  """Transform ``how`` of the while loss with ``jax.debug.callback``
  (eager): its value and the calls JAX ran, once per transform."""
  _, theirs, take = _recorder()
  want_out = TRANSFORMS[how](_while_loss(theirs))(jnp.arange(1.0, 4.0))
  return want_out, take()


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("how", ["jacfwd", "jacfwd_jacfwd", "vmap_jvp"])
def test_forward_mode_of_a_while_loop_runs_each_iteration_once(run, how):
  # The loop's predicate depends on primal values only: vmap over tangents
  # leaves it unbatched, so its effects run once per iteration. (Forward
  # mode only: JAX has no reverse mode of a while_loop.)
  ours, _, take = _recorder()
  x = jnp.arange(1.0, 4.0)
  want_out, want = _jax_while_runs(how)
  assert want == [("cond", 0), ("body", 0), ("cond", 1), ("body", 1),
                  ("cond", 2)]
  out = run(TRANSFORMS[how](_while_loss(ours)))(x)
  assert take() == want
  np.testing.assert_allclose(out, want_out, rtol=1e-6)


def test_vmap_of_while_with_every_carry_batched_masks_unbatched_effects():
  # Every carry is batched from the start: the fixpoint jax_effects runs to
  # find the predicate batched must not leave JAX's rule a cached body in
  # which the effect is not batched.
  seen = []

  def f(n):
    def body(c):
      i, s = c
      je.callback(lambda: seen.append("tick"), None)
      return i + 1, s + i
    return lax.while_loop(lambda c: c[0] < n, body, (n * 0, n * 0))

  ns = jnp.array([1, 3, 0])
  i, _ = je.jit(jax.vmap(f))(ns)
  je.effects_barrier()
  np.testing.assert_array_equal(i, ns)
  assert seen == ["tick"] * 4
