"""The token-threading pass (``design/tokens.md``, "Inside a computation";
``design/transformations.md``, "Higher-order primitives").

Order of effects through nested jit, cond/switch, while (body and cond_fun),
scan/fori_loop, custom_jvp/custom_vjp, checkpoint and call primitives;
compiler tokens created inside the computation; an effect-free jaxpr after
the pass; a clear error for a higher-order primitive without a rule.
Every ordering test compares with eager execution (``jax.disable_jit()``).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_effects as je


import helpers
from helpers import Recorder


@pytest.fixture
def rec():
  return Recorder()


def check(rec, fun, *args, expected=None):
  jitted, eager = rec.run(fun, *args)
  assert jitted == eager
  if expected is not None:
    assert jitted == expected
  return jitted


# --- control flow ------------------------------------------------------------

def test_straight_line_and_nested_jit(rec):
  @jax.jit
  def inner(x):
    rec("inner", x)
    return x + 1

  @je.jit
  def inner_je(x):
    rec("inner_je", x)
    return x * 2

  def f(x):
    rec("a", x)
    y = inner(x)
    rec("b", y)
    z = inner_je(jax.jit(lambda v: inner(v))(y))
    rec("c", z)
    return z

  check(rec, f, jnp.int32(1), expected=[
      ("a", 1), ("inner", 1), ("b", 2), ("inner", 2), ("inner_je", 3),
      ("c", 6)])


def test_cond_and_switch(rec):
  def f(x):
    rec("before", x)

    def t(v):
      rec("true", v)
      return v + 1

    def e(v):
      return v - 1  # no effect in this branch

    y = lax.cond(x > 0, t, e, x)
    branches = [lambda v, i=i: (rec(f"br{i}", v), v * i)[1] for i in range(3)]
    z = lax.switch(y, branches, y)
    rec("after", z)
    return z

  assert check(rec, f, jnp.int32(1)) == [
      ("before", 1), ("true", 1), ("br2", 2), ("after", 4)]
  assert check(rec, f, jnp.int32(-1)) == [
      ("before", -1), ("br0", -2), ("after", 0)]  # switch clamps the index
  assert check(rec, f, jnp.int32(0)) == [("before", 0), ("br0", -1),
                                          ("after", 0)]


def test_while_effects_in_body_and_cond(rec):
  def f(n):
    def cond(c):
      rec("cond", c[0])
      return c[0] < n

    def body(c):
      rec("body", c[0])
      return c[0] + 1, c[1] * 2

    rec("start", n)
    i, acc = lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(1)))
    rec("end", i, acc)
    return acc

  assert check(rec, f, jnp.int32(3)) == [
      ("start", 3), ("cond", 0), ("body", 0), ("cond", 1), ("body", 1),
      ("cond", 2), ("body", 2), ("cond", 3), ("end", 3, 8)]
  assert check(rec, f, jnp.int32(0)) == [("start", 0), ("cond", 0),
                                          ("end", 0, 1)]


def test_while_effects_only_in_cond(rec):
  def f(n):
    def cond(i):
      rec("cond", i)
      return i < n
    return lax.while_loop(cond, lambda i: i + 1, jnp.int32(0))

  assert check(rec, f, jnp.int32(2)) == [("cond", 0), ("cond", 1), ("cond", 2)]


def test_scan_and_fori_loop(rec):
  def f(xs):
    def step(c, x):
      rec("step", c, x)
      return c + x, c * x

    c, ys = lax.scan(step, jnp.int32(0), xs)
    rec("scan", c, ys)
    r = lax.scan(step, jnp.int32(100), xs[:2], reverse=True)[0]
    static = lax.fori_loop(0, 2, lambda i, a: (rec("fs", i, a), a + i)[1], r)
    dynamic = lax.fori_loop(0, xs[0], lambda i, a: (rec("fd", i), a - i)[1],
                            static)
    return dynamic

  events = check(rec, f, jnp.arange(1, 4, dtype=jnp.int32))
  assert events == [
      ("step", 0, 1), ("step", 1, 2), ("step", 3, 3), ("scan", 6, [0, 2, 9]),
      ("step", 100, 2), ("step", 102, 1), ("fs", 0, 103), ("fs", 1, 103),
      ("fd", 0)]


def test_scan_unrolled_and_map(rec):
  def f(xs):
    c, _ = lax.scan(lambda c, x: (rec("u", x), (c + x, None))[1], 0.0, xs,
                    unroll=2)
    ys = lax.map(lambda x: (rec("m", x), x * 2)[1], xs)
    return c, ys

  assert check(rec, f, jnp.arange(3.0)) == [
      ("u", 0.0), ("u", 1.0), ("u", 2.0), ("m", 0.0), ("m", 1.0), ("m", 2.0)]


def test_nested_loops_and_conds(rec):
  def f(x):
    def outer(i, acc):
      def inner_cond(c):
        rec("ic", i, c)
        return c < i

      def inner_body(c):
        lax.cond(c % 2 == 0, lambda: rec("even", c), lambda: rec("odd", c))
        return c + 1

      c = lax.while_loop(inner_cond, inner_body, 0)
      return acc + c

    return lax.fori_loop(0, x, outer, 0)

  events = check(rec, f, jnp.int32(3))
  assert events[:4] == [("ic", 0, 0), ("ic", 1, 0), ("even", 0), ("ic", 1, 1)]
  assert len(events) == 6 + 3  # cond evals: 1+2+3; bodies: 0+1+2


def test_custom_jvp_custom_vjp_checkpoint_and_call_primitives(rec):
  @jax.custom_jvp
  def cj(x):
    rec("cj", x)
    return jnp.sin(x)

  cj.defjvp(lambda p, t: (cj(p[0]), jnp.cos(p[0]) * t[0]))

  @jax.custom_vjp
  def cv(x):
    rec("cv", x)
    return x * 3

  cv.defvjp(lambda x: (cv(x), None), lambda _, g: (g * 3,))

  @jax.checkpoint
  def ck(x):
    rec("ck", x)
    return x + 1

  @jax.named_call
  def named(x):
    rec("named", x)
    return x - 1

  def f(x):
    return named(ck(cv(cj(x))))

  check(rec, f, jnp.float32(0.0), expected=[
      ("cj", 0.0), ("cv", 0.0), ("ck", 0.0), ("named", 1.0)])


def test_named_effects_in_control_flow(rec):
  a, b = je.Effect("lower-a"), je.Effect("lower-b")

  def f(x):
    def body(i, acc):
      rec("a", i, effect=a)
      lax.cond(i % 2 == 0, lambda: rec("b", i, effect=b), lambda: None)
      return acc + i
    return lax.fori_loop(0, x, body, 0)

  events = check(rec, f, jnp.int32(4))
  assert [e for e in events if e[0] == "a"] == [("a", i) for i in range(4)]
  assert [e for e in events if e[0] == "b"] == [("b", 0), ("b", 2)]


# --- what the pass produces ---------------------------------------------------

def _threaded_trace(f, *args):
  """The trace of the token-threaded function jax.jit dispatches (``.trace``
  of a function with effects shows its jaxpr)."""
  return f.trace(*args)


def test_threaded_computation_has_no_jax_effects():
  @je.jit
  def f(x):
    je.print("a {}", x)
    y = lax.while_loop(lambda c: (je.print("c {}", c), c < 3)[1],
                       lambda c: c + 1, x)
    lax.cond(y > 0, lambda: je.print("p", effect=je.Effect("lower-fx")),
             lambda: None)
    je.print("u", ordered=False)
    return lax.scan(lambda c, v: (je.print("s"), (c + v, v))[1], y,
                    jnp.arange(3))[0]

  traced = _threaded_trace(f, jnp.int32(0))
  assert traced.jaxpr.effects == set()
  text = str(traced.jaxpr)
  assert "jax_effects_effect[" not in text
  assert "jax_effects_threaded_effect" in text
  # the plain jaxpr of the user function does carry our markers
  assert jax.make_jaxpr(f.__wrapped__)(jnp.int32(0)).effects


def test_compiler_tokens_are_created_inside_per_chain():
  a, b = je.Effect("lower-ta"), je.Effect("lower-tb")

  @je.jit
  def f(x):
    je.print("a0", effect=a)
    je.print("b0", effect=b)
    je.print("a1", effect=a)
    je.print("b1", effect=b)
    return x

  text = f.lower(jnp.float32(0)).as_text()
  main = re.search(r"func\.func public @main\((.*?)\) ->(.*?)\{", text)
  params, results = main.group(1), main.group(2)
  # one runtime-token operand (int32 scalar) per ordered effect, no token type
  assert params.count("tensor<i32>") == 2
  assert "!stablehlo.token" not in params + results
  assert text.count("stablehlo.create_token") == 2


def test_effects_inside_loop_lower_with_token_per_iteration():
  @je.jit
  def f(n):
    return lax.fori_loop(0, n, lambda i, a: (je.print("{}", i), a + i)[1], 0)

  text = f.lower(jnp.int32(3)).as_text()
  assert "stablehlo.while" in text
  assert "stablehlo.create_token" in text
  assert re.search(r"stablehlo\.custom_call @" + helpers.HOST_CALL
                   + r"\(%\S+, ", text)


def test_refused_higher_order_primitive_is_a_clear_error():
  # (tests/pass/test_higher_order_primitives.py checks every one)
  def f(b):
    return lax.reduce(b, 0.0, lambda x, y: (je.print("add {}", x), x + y)[1],
                      (0,))

  with pytest.raises(NotImplementedError,
                     match=r"jax_effects.print\('add \{\}'\) is inside JAX's "
                           r"higher-order primitive 'reduce'"):
    je.jit(f)(jnp.ones(2))


def test_higher_order_primitive_without_effects_needs_no_rule():
  @je.jit
  def f(b):
    je.print("before")
    return lax.custom_linear_solve(lambda v: 2 * v, b, lambda _, v: v / 2)

  np.testing.assert_allclose(f(jnp.ones(2)), [0.5, 0.5])
