"""vmap of ``cond``/``switch`` with a batched predicate
(``design/transformations.md``, "vmap of control flow").

JAX's batching rule evaluates every branch for every element and selects.
jax_effects wraps that rule: unchanged (the same jaxpr, bit for bit) unless a
branch holds one of our effects; then each branch's effects get
``index == i`` as an extra batched operand and run only for the elements that
took the branch, in batch order, branch after branch (site-major, as vmap
orders effects elsewhere). Oracle: ``lax.map`` (one element at a time) gives
each element the same effects.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.interpreters import batching
from jax.extend.core import primitives as jex_prims

import jax_effects as je
from helpers import Recorder
from jax_effects._primitives import effect as _control_flow_batching


# rec(tag, *values) in traced code records (tag, *values) when it runs;
# take() waits for effects and returns the records so far.
rec = Recorder()
take = rec.take


def eager(f):
  return f


RUNNERS = [pytest.param(eager, id="eager"), pytest.param(je.jit, id="je.jit"),
           pytest.param(jax.jit, id="jax.jit")]


def branchy(p, x):
  return lax.cond(p, lambda x: (rec("T", x), x + 1)[1],
                  lambda x: (rec("F", x), x - 1)[1], x)


def per_element(seen, key):
  return {k: [e for e in seen if e[1] == k] for k in key}


@pytest.mark.parametrize("run", RUNNERS)
def test_only_the_taken_branch_runs_per_element_in_batch_order(run):
  take()
  p = jnp.array([True, False, True, False])
  x = jnp.arange(4)
  out = run(jax.vmap(branchy))(p, x)
  np.testing.assert_array_equal(out, [1, 0, 3, 2])
  assert take() == [("F", 1), ("F", 3), ("T", 0), ("T", 2)]
  # differential: each element's effects as lax.map runs them
  je.jit(lambda p, x: lax.map(lambda a: branchy(*a), (p, x)))(p, x)
  assert sorted(take()) == sorted([("T", 0), ("F", 1), ("T", 2), ("F", 3)])


@pytest.mark.parametrize("run", RUNNERS)
def test_switch_with_callback_results(run):
  take()

  def f(i, x):
    def branch(k):
      def g(x):
        rec(f"b{k}", x)
        return je.callback(lambda v: (v * 10 + k).astype(v.dtype),
                           jax.ShapeDtypeStruct((), x.dtype), x)
      return g
    return lax.switch(i, [branch(0), branch(1), branch(2)], x)

  i = jnp.array([2, 0, 1, 2])
  x = jnp.arange(4)
  out = run(jax.vmap(f))(i, x)
  np.testing.assert_array_equal(out, [2, 10, 21, 32])
  assert take() == [("b0", 1), ("b1", 2), ("b2", 0), ("b2", 3)]


@pytest.mark.parametrize("run", RUNNERS)
def test_effect_without_batched_operands_runs_per_taking_element(run):
  take()

  def f(p, x):
    return lax.cond(p, lambda x: (rec("yes"), x)[1],
                    lambda x: (rec("no"), -x)[1], x)

  run(jax.vmap(f))(jnp.array([True, True, False]), jnp.arange(3))
  assert take() == [("no",), ("yes",), ("yes",)]


def test_control_flow_inside_a_vmapped_branch():
  # (je.jit only: eagerly JAX runs a vmapped while with its own jit, see
  # design/transformations.md, plain jax.jit limits)
  run = je.jit
  take()

  def f(p, n):
    def yes(n):
      def body(c):
        rec("while", n, c)
        return c + 1
      c = lax.while_loop(lambda c: c < n, body, 0)
      s, _ = lax.scan(lambda s, y: ((rec("scan", n, y), s + y)[1], None), c,
                      jnp.arange(2))
      return jax.jit(lambda s: (rec("jit", n, s), s)[1])(s)
    return lax.cond(p, yes, lambda n: (rec("no", n), -n)[1], n)

  p = jnp.array([True, False, True])
  n = jnp.array([1, 5, 2])
  out = run(jax.vmap(f))(p, n)
  np.testing.assert_array_equal(out, [2, -5, 3])
  seen = take()
  je.jit(lambda p, n: lax.map(lambda a: f(*a), (p, n)))(p, n)
  sequential = take()
  for k in (1, 5, 2):
    assert ([e for e in seen if e[1] == k] == [e for e in sequential if e[1] == k])
  assert [e for e in seen if e[0] == "no"] == [("no", 5)]
  assert [e for e in seen if e[0] == "while"] == [("while", 1, 0), ("while", 2, 0),
                                                  ("while", 2, 1)]


def test_nested_vmaps_with_the_predicate_batched_at_either_level():
  take()

  def f(p, x):
    return lax.cond(p, lambda x: (rec("T", x), x + 1)[1],
                    lambda x: (rec("F", x), x - 1)[1], x)

  # predicate batched by the outer vmap only
  g = jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None))
  out = je.jit(g)(jnp.array([True, False]), jnp.array([10, 20]))
  np.testing.assert_array_equal(out, [[11, 21], [9, 19]])
  assert take() == [("F", 10), ("F", 20), ("T", 10), ("T", 20)]
  # by the inner vmap only
  g = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))
  out = je.jit(g)(jnp.array([True, False]), jnp.array([10, 20]))
  np.testing.assert_array_equal(out, [[11, 9], [21, 19]])
  assert sorted(take()) == sorted([("T", 10), ("F", 10), ("T", 20), ("F", 20)])


def test_grad_of_vmapped_cond_runs_taken_branches_once():
  take()

  def f(p, x):
    return lax.cond(p, lambda x: (rec("T", x), jnp.sin(x))[1],
                    lambda x: (rec("F", x), jnp.cos(x))[1], x)

  def pure(p, x):
    return lax.cond(p, jnp.sin, jnp.cos, x)

  p = jnp.array([True, False, True])
  x = jnp.arange(3.0)
  g = je.jit(jax.grad(lambda x: jax.vmap(f)(p, x).sum()))(x)
  np.testing.assert_allclose(g, jax.grad(lambda x: jax.vmap(pure)(p, x).sum())(x))
  assert take() == [("F", 1.0), ("T", 0.0), ("T", 2.0)]


# --- programs without our effects: JAX's rule, bit for bit ----------------------

def _with_jax_rules(fn):
  """Runs ``fn`` with JAX's own batching rules of cond and while restored."""
  cond_p, while_p = jex_prims.cond_p, jex_prims.while_p
  ours = (batching.fancy_primitive_batchers[cond_p],
          batching.fancy_primitive_batchers[while_p])
  assert ours == (_control_flow_batching._cond_batcher,
                  _control_flow_batching._while_batcher)
  batching.fancy_primitive_batchers[cond_p] = _control_flow_batching._jax_cond_batcher
  batching.fancy_primitive_batchers[while_p] = _control_flow_batching._jax_while_batcher
  try:
    return fn()
  finally:
    (batching.fancy_primitive_batchers[cond_p],
     batching.fancy_primitive_batchers[while_p]) = ours


def _no_effects(p, x):
  y = lax.cond(p, lambda x: jnp.sin(x) * 2, lambda x: jnp.cos(x) - 1, x)
  y = lax.switch(jnp.int32(p) + 1, [jnp.sin, jnp.cos, jnp.tan], y)
  return lax.while_loop(lambda c: c[0] < 3 + p, lambda c: (c[0] + 1, c[1] * 2.0),
                        (0, y))[1]


def _debug_only(p, x):
  return lax.cond(p, lambda x: (jax.debug.print("T {}", x), x + 1)[1],
                  lambda x: x - 1, x)


@pytest.mark.parametrize("prog", [_no_effects, _debug_only])
@pytest.mark.parametrize("transform", [
    pytest.param(lambda f: jax.vmap(f), id="vmap"),
    pytest.param(lambda f: jax.vmap(jax.vmap(f, in_axes=(0, None)),
                                    in_axes=(None, 0)), id="vmap2"),
    pytest.param(lambda f: jax.vmap(
        lambda p, x: jax.jvp(lambda x: f(p, x), (x,), (1.0,))), id="vmap_jvp"),
])
def test_programs_without_our_effects_get_jaxs_rule_bit_for_bit(prog, transform,
                                                                 capfd):
  p = jnp.array([1, 0, 1])
  x = jnp.arange(3.0) + 0.5
  f = transform(prog)
  ours_text = str(jax.make_jaxpr(f)(p, x))
  theirs_text = _with_jax_rules(lambda: str(jax.make_jaxpr(f)(p, x)))
  assert ours_text == theirs_text
  assert "select_n" in ours_text   # the cond became JAX's select
  ours = jax.jit(f)(p, x)
  theirs = _with_jax_rules(lambda: jax.jit(transform(prog))(p, x))
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("how", ["vmap_grad", "vmap_jvp", "jacfwd_vmap",
                                 "hessian_vmap"])
def test_derivatives_around_a_vmapped_cond(how):
  take()

  def make(rec):
    def f(p, x):
      return lax.cond(p, lambda x: (rec("T", x), jnp.sin(x))[1],
                      lambda x: (rec("F", x), jnp.cos(x))[1], x)
    return f

  p = jnp.array([True, False, True])
  x = jnp.arange(3.0)
  transforms = {
      "vmap_grad": lambda f: lambda x: jax.vmap(jax.grad(f, argnums=1))(p, x),
      "vmap_jvp": lambda f: lambda x: jax.vmap(
          lambda p, x: jax.jvp(lambda x: f(p, x), (x,), (1.0,)))(p, x),
      "jacfwd_vmap": lambda f: jax.jacfwd(lambda x: jax.vmap(f)(p, x)),
      "hessian_vmap": lambda f: jax.hessian(lambda x: jax.vmap(f)(p, x).sum()),
  }
  out = je.jit(transforms[how](make(rec)))(x)
  assert take() == [("F", 1.0), ("T", 0.0), ("T", 2.0)]
  # (JAX's values, compiled: one program rather than each operation of the
  # derivative dispatched on its own)
  want = jax.jit(transforms[how](make(lambda *a: None)))(x)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
