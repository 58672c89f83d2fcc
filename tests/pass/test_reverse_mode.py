"""Effects on tangents and cotangents: custom_jvp rules, custom_vjp backward
rules, linear_transpose (``design/transformations.md``, "Effects on tangents
and cotangents").

The oracle is JAX's own ``jax.debug.callback(ordered=True)`` in the same
program: forward mode (``jvp``, ``linearize``) runs an effect on tangents with
the tangent values; reverse mode (``grad``, ``vjp``, ``linear_transpose``)
never computes those tangents and drops it, as JAX does; a ``custom_vjp``
backward rule runs its effects in the order of the backward pass.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je


SEEN = []


def ours(tag, *args):
  je.callback(lambda *v: SEEN.append((tag, *(np.asarray(a).tolist() for a in v))),
              None, *args)


def theirs(tag, *args):
  jax.debug.callback(
      lambda *v: SEEN.append((tag, *(np.asarray(a).tolist() for a in v))),
      *args, ordered=True)


def take():
  je.effects_barrier()
  jax.effects_barrier()
  out = list(SEEN)
  SEEN.clear()
  return out


def _jvp_program(rec):
  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  @f.defjvp
  def f_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    rec("primal", x)
    rec("tangent", t)
    return jnp.sin(x), jnp.cos(x) * t

  def loss(x):
    rec("loss", x)
    return f(x) * 3.0
  return loss


HOW = {
    "grad": lambda f: jax.grad(f),
    "vjp": lambda f: lambda x: jax.vjp(f, x)[1](1.0),
    "jvp": lambda f: lambda x: jax.jvp(f, (x,), (2.0,)),
    "linearize": lambda f: lambda x: jax.linearize(f, x)[1](2.0),
    "grad_of_grad": lambda f: jax.grad(jax.grad(f)),
    "hessian": lambda f: jax.hessian(f),
}


@pytest.mark.parametrize("run", [pytest.param(lambda f: f, id="eager"),
                                 pytest.param(je.jit, id="je.jit")])
@pytest.mark.parametrize("how", sorted(HOW))
def test_custom_jvp_rule_with_effects_on_tangents(how, run):
  take()
  want_out = jax.jit(HOW[how](_jvp_program(theirs)))(1.0)
  want = take()
  out = run(HOW[how](_jvp_program(ours)))(1.0)
  assert take() == want
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want_out)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_forward_and_reverse_mode_differ_as_in_jax():
  # (pins the oracle: forward mode sees the tangent, reverse mode does not)
  take()
  je.jit(HOW["jvp"](_jvp_program(ours)))(1.0)
  assert take() == [("loss", 1.0), ("primal", 1.0), ("tangent", 2.0)]
  je.jit(HOW["grad"](_jvp_program(ours)))(1.0)
  assert take() == [("loss", 1.0), ("primal", 1.0)]


def _vjp_program(rec):
  def make(name, fn, dfn):
    @jax.custom_vjp
    def g(x):
      return fn(x)

    def fwd(x):
      rec(f"{name}.fwd", x)
      return fn(x), x

    def bwd(x, ct):
      rec(f"{name}.bwd", x, ct)
      return (dfn(x) * ct,)
    g.defvjp(fwd, bwd)
    return g

  inner = make("inner", jnp.sin, jnp.cos)
  outer = make("outer", lambda x: x ** 2, lambda x: 2 * x)
  return lambda x: outer(inner(x)) * 3.0


@pytest.mark.parametrize("run", [pytest.param(lambda f: f, id="eager"),
                                 pytest.param(je.jit, id="je.jit"),
                                 pytest.param(jax.jit, id="jax.jit")])
def test_custom_vjp_backward_rules_run_in_backward_order(run):
  take()
  want_out = jax.jit(jax.grad(_vjp_program(theirs)))(0.5)
  want = take()
  assert [w[0] for w in want] == ["inner.fwd", "outer.fwd", "outer.bwd",
                                  "inner.bwd"]
  out = run(jax.grad(_vjp_program(ours)))(0.5)
  assert take() == want
  np.testing.assert_allclose(out, want_out, rtol=1e-6)


@pytest.mark.parametrize("run", [pytest.param(lambda f: f, id="eager"),
                                 pytest.param(je.jit, id="je.jit")])
def test_linear_transpose_drops_effects_on_linear_values_like_jax(run):
  take()

  def lin(rec):
    def f(x):
      rec("lin", x)
      return 2.0 * x
    return f

  want_out = jax.jit(lambda: jax.linear_transpose(lin(theirs), 1.0)(5.0))()
  want = take()
  out = run(lambda: jax.linear_transpose(lin(ours), 1.0)(5.0))()
  assert take() == want == []
  np.testing.assert_allclose(out[0], want_out[0])
  # forward, the same function prints
  run(lin(ours))(5.0)
  assert take() == [("lin", 5.0)]


def test_callback_results_used_on_tangents_cannot_be_transposed():
  take()

  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  @f.defjvp
  def f_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    scaled = je.callback(lambda v: v * 2, jax.ShapeDtypeStruct((), jnp.float32), t)
    return jnp.sin(x), scaled

  # forward mode: the callback gets the tangent
  np.testing.assert_allclose(je.jit(lambda x: jax.jvp(f, (x,), (3.0,))[1])(1.0),
                             6.0)
  with pytest.raises(NotImplementedError,
                     match=r"callback\(.*lambda.*takes tangents.*results are used"
                           r".*custom_vjp"):
    je.jit(jax.grad(f))(1.0)
  take()


@pytest.mark.parametrize("how", ["jit_of_grad", "grad_of_jit"])
def test_effect_with_constant_operands_in_a_scan_runs_every_iteration_under_grad(
    effects_capture, how):
  """JAX's partial evaluation of a scan (grad) moves equations whose inputs
  do not change between iterations out of the forward loop; an effect stays
  in it and runs once per iteration, as without grad (JAX's own
  ``jax.debug.print("step")`` runs once there)."""
  def loss(w):
    def step(c, _):
      je.print("step")
      return c * w, None
    return jax.lax.scan(step, 1.0, None, length=3)[0]

  g = (je.jit(jax.grad(loss)) if how == "jit_of_grad"
       else jax.grad(je.jit(loss)))
  assert g(2.0) == 12.0
  assert effects_capture.printed == ["step"] * 3
