"""The pass copies the equations it leaves unchanged; it does not re-trace them.

A first call of a ``jax_effects.jit`` function with effects traces the user
function once; finding effects, it neither re-emits the plain program
(``tracing.program_effects``) nor re-binds the equations the token pass
leaves as they are: they are copied into ``jax.jit``'s trace
(``_compat.equation_copier``), as ``jax.jit``'s own inlining does. That is
what a fresh process pays on top of loading the executable from JAX's
persistent cache (bench row (o)). What is copied must be what re-binding
would have made: the differential tests below run programs with every kind
of equation (control flow, literals, constants, weak types, dropped
outputs, nested jit, custom derivatives, closures over an enclosing trace)
against ``jax.jit`` and ``jax.disable_jit()``. A run of
:data:`~jax_effects._core.jaxpr_eval.STRETCH` or more such equations is
staged as one nested ``jit`` equation instead (``_compat.stretch_binder``;
inlined at lowering from JAX 0.11, a function the module calls before):
the same tests run with every segment
between two effects padded past that length, so each kind of equation is
also staged inside a stretch.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

import jax_effects as je
from jax_effects import _compat
from jax_effects._core import jaxpr_eval

#: Elementwise steps (two equations each) that make every segment of
#: ``_program`` between two effects a stretch; 0: none.
PADS = [0, jaxpr_eval.STRETCH]


class _CountingPrimitive(Primitive):
  """A primitive (doubling its operand) that counts its binds."""

  binds = 0

  def bind(self, *args, **params):
    type(self).binds += 1
    return super().bind(*args, **params)


double_p = _CountingPrimitive("test_double")
double_p.def_abstract_eval(lambda x: x)
double_p.def_impl(lambda x: x * 2)
mlir.register_lowering(double_p, mlir.lower_fun(lambda x: x * 2,
                                                multiple_results=False))


@pytest.mark.parametrize("with_print", [True, False])
def test_a_first_call_binds_each_equation_once(capsys, with_print):
  # Before: three binds with a print (the user trace, the plain program
  # re-emitted, the pass re-binding), two without (the pass re-binding).
  def f(x):
    y = double_p.bind(x)
    if with_print:
      je.print("y = {}", y)
    return y + 1

  g = je.jit(f)
  _CountingPrimitive.binds = 0
  out = g(jnp.float32(3))
  je.effects_barrier()
  assert float(out) == 7.0
  assert _CountingPrimitive.binds == 1
  assert capsys.readouterr().out == ("y = 6.0\n" if with_print else "")
  g(jnp.float32(4))   # (cached: no trace)
  je.effects_barrier()
  assert _CountingPrimitive.binds == 1


BIG = np.linspace(0.0, 1.0, 1000, dtype=np.float32)   # a constant, not a literal


def _pad(v, pad):
  for _ in range(pad):   # (exact: eager and compiled print the same)
    v = -(-v)
  return v


def _program(emit, pad=0):
  """Every kind of equation a program has, with effects between them;
  ``pad`` steps more at the start of each segment between two effects."""
  @jax.custom_jvp
  def soft(x):
    return jnp.log1p(jnp.exp(x))

  soft.defjvp(lambda p, t: (soft(p[0]), t[0] * jax.nn.sigmoid(p[0])))

  @jax.jit
  def inner(x):   # a nested jit without effects: copied whole
    return jnp.tanh(x) * 2

  def program(x, n):
    y = _pad(x, pad) * 2.5 + 1            # weak-typed literals
    emit("start {}", y[:3])
    z = _pad(y, pad)
    z = jnp.dot(BIG[:8], z) + jnp.ones(8).sum() * 3   # constants
    def body(c, xs):
      return c + xs, c * xs
    c, _ = lax.scan(body, z, y)           # a dropped output
    w = lax.cond(c > 0, jnp.sin, jnp.cos, y)
    i, v = lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1,
                                                         s[1] * 0.9),
                          (0, w))
    emit("mid {} {}", i, v.sum())
    v = _pad(v, pad)
    u = inner(v) + soft(v)
    emit("end {}", u.mean())
    return u, i

  return program


def _stretches(jaxpr) -> int:
  return sum(eqn.primitive.name in ("jit", "pjit")
             and eqn.params["name"] == "jax_effects_stretch"
             for eqn in jaxpr.eqns)


@pytest.mark.parametrize("pad", PADS)
def test_a_program_of_every_kind_of_equation_as_under_jax_jit(capsys, pad):
  x = jnp.arange(8.0, dtype=jnp.float32)
  ours = je.jit(_program(je.print, pad))
  out = ours(x, 5)
  je.effects_barrier()
  printed = capsys.readouterr().out
  reference = jax.jit(_program(lambda *a: None, pad))(x, 5)
  for a, b in zip(out, reference):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.dtype == b.dtype and a.weak_type == b.weak_type
  with jax.disable_jit():
    _program(je.print, pad)(x, 5)
    je.effects_barrier()
  assert printed == capsys.readouterr().out
  assert printed.count("\n") == 3
  # Each of the three segments before an effect is one stretch. From JAX
  # 0.11 lowering inlines them; before, the module calls each.
  traced = ours.trace(x, 5)
  assert _stretches(traced.jaxpr.jaxpr) == (3 if pad else 0)
  calls = traced.lower().as_text().count("call @jax_effects_stretch")
  assert calls == (0 if _compat.stretches_inlined_at_lowering() else
                   3 if pad else 0)


@pytest.mark.parametrize("pad", PADS)
def test_its_derivative_and_batching_as_under_jax_jit(capsys, pad):
  x = jnp.arange(8.0, dtype=jnp.float32) / 8

  def loss(emit):
    prog = _program(emit, pad)
    return lambda v: prog(v, 3)[0].sum()

  t = jnp.ones_like(x)   # (forward mode: the program has a while loop)
  got = jax.jvp(je.jit(loss(je.print)), (x,), (t,))
  want = jax.jvp(jax.jit(loss(lambda *a: None)), (x,), (t,))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
  batch = jnp.stack([x, x + 1])
  got = jax.vmap(je.jit(loss(je.print)))(batch)
  want = jax.vmap(jax.jit(loss(lambda *a: None)))(batch)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
  je.effects_barrier()
  assert capsys.readouterr().out.count("start") == 3   # jvp 1, vmap 2


@pytest.mark.parametrize("pad", PADS)
def test_closures_over_an_enclosing_trace_are_bound_as_before(capsys, pad):
  # An input from another trace can be neither copied nor staged in a
  # stretch: bound as before.
  @jax.jit
  def outer(x):
    @je.jit
    def f(y):
      z = jnp.sin(x) + _pad(y, pad)      # x: the enclosing trace's
      je.print("z = {}", z)
      return z * x

    return f(x + 1)

  x = jnp.float32(0.5)
  out = outer(x)
  je.effects_barrier()
  want = (np.sin(np.float32(0.5)) + np.float32(1.5)) * np.float32(0.5)
  np.testing.assert_allclose(float(out), want, rtol=1e-6)
  assert capsys.readouterr().out.startswith("z = ")


def _sub_jaxprs(jaxpr):
  for eqn in jaxpr.eqns:
    for sub in _compat.jaxprs_in_params(eqn.params):
      yield eqn.primitive.name, sub
      yield from _sub_jaxprs(sub)


def test_the_regions_the_pass_retraces_carry_its_debug_info(capsys):
  # JAX's control-flow APIs take a function's ``__fun_debug_info__`` rather
  # than inspecting its signature and source (``_compat.traced_as_region``):
  # every region the pass re-traces has the pass's, none a function's.
  def f(x):
    def body(c, _):
      je.print("c = {}", c)
      return c + 1, c
    c, ys = lax.scan(body, x, None, length=2)
    c = lax.cond(c > 0, lambda c: (je.print("pos"), c)[1], lambda c: c, c)
    c = lax.while_loop(lambda c: c < 4, lambda c: (je.print("w"), c + 1)[1], c)
    return c, ys

  g = je.jit(f)
  regions = list(_sub_jaxprs(g.trace(jnp.float32(0)).jaxpr.jaxpr))
  assert sorted({name for name, _ in regions}) == ["cond", "scan", "while"]
  assert {(s.debug_info.traced_for, s.debug_info.func_src_info)
          for _, s in regions} == {("jax_effects pass", "jax_effects region")}
  c, ys = g(jnp.float32(0))
  je.effects_barrier()
  assert (float(c), ys.tolist()) == (4.0, [0.0, 1.0])
  assert capsys.readouterr().out == "c = 0.0\nc = 1.0\npos\nw\nw\n"


@pytest.mark.parametrize("pad", PADS)
def test_stretches_inside_the_regions_the_pass_retraces(capsys, pad):
  # A region with an effect is re-traced through the pass: its long runs
  # are stretches too, in ``lax.scan``'s and ``lax.cond``'s traces.
  def f(x):
    def body(c, _):
      c = _pad(c, pad) + 1
      je.print("c = {}", c)
      return _pad(c, pad), c
    c, ys = lax.scan(body, x, None, length=3)
    c = lax.cond(c > 0, lambda c: (je.print("pos"), _pad(c * 2, pad))[1],
                 lambda c: c, c)
    return c, ys

  g = je.jit(f)
  c, ys = g(jnp.float32(0))
  je.effects_barrier()
  assert (float(c), ys.tolist()) == (6.0, [1.0, 2.0, 3.0])
  assert capsys.readouterr().out == "c = 1.0\nc = 2.0\nc = 3.0\npos\n"
  inside = sum(_stretches(sub) for _, sub in
               _sub_jaxprs(g.trace(jnp.float32(0)).jaxpr.jaxpr))
  assert inside == (3 if pad else 0)   # two in the body, one in a branch


def test_a_program_without_effects_keeps_the_jaxpr_jax_jit_makes():
  # Stretches are for threaded programs: a print-free one (what a drop-in
  # jax.jit runs most) is the same jaxpr as under jax.jit, however long.
  def f(x):
    return _pad(x, 2 * jaxpr_eval.STRETCH) + 1

  x = jnp.arange(4.0)
  ours = je.jit(f).trace(x).jaxpr
  assert _stretches(ours.jaxpr) == 0
  assert str(ours) == str(jax.jit(f).trace(x).jaxpr)
