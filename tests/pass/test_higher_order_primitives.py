"""Every higher-order primitive of JAX: effects inside run in program order,
or are refused with a reason (never a pointer at jax_effects internals;
``design/transformations.md``, "Higher-order primitives").

The census: one representative program per public JAX API that stages a
primitive holding jaxprs in its params (control flow, calls, custom
derivatives, solvers, ``custom_vmap``, ``composite``, ``linear_call``,
reductions with a user combiner, ``shard_map``/``pmap``, Pallas). Each
program puts an effect inside that primitive, between effects before and after
it. Walking the staged jaxprs collects every primitive that holds a jaxpr;
each must be handled by the token-threading pass (the program gives the same
effects, in the same order, as the same program run op by op under
``jax.disable_jit()``) or refused with an error naming the effect, the
primitive and why.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

import jax_effects as je
from helpers import Recorder
from jax_effects import _compat
from jax_effects._pass import token_pass as _token_pass


# rec(tag, *values) in traced code records (tag, *values) when it runs;
# take() waits for effects and returns the records so far.
rec = Recorder()
take = rec.take


def around(inner):
  """``before``, the construct with effects inside, ``after``."""
  def f(x):
    rec("before", x)
    y = inner(x)
    rec("after", y)
    return y
  return f


def _custom_jvp(x):
  @jax.custom_jvp
  def g(x):
    rec("g", x)
    return jnp.sin(x)
  g.defjvp(lambda p, t: (g(p[0]), jnp.cos(p[0]) * t[0]))
  return g(x)


def _custom_vjp(x):
  @jax.custom_vjp
  def g(x):
    rec("g", x)
    return jnp.sin(x)
  g.defvjp(lambda x: (g(x), x), lambda x, ct: (jnp.cos(x) * ct,))
  return g(x)


def _cg(x):
  def matvec(v):
    rec("matvec", v)
    return 2.0 * v
  return jax.scipy.sparse.linalg.cg(matvec, jnp.full(2, x), maxiter=3)[0].sum()


def _custom_root(x):
  def f(y):
    rec("f", y)
    return y - x
  return lax.custom_root(f, 0.0, lambda f, g: g - f(g), lambda g, y: y)


def _custom_vmap(x):
  @jax.custom_batching.custom_vmap
  def g(x):
    rec("g", x)
    return x + 1
  g.def_vmap(lambda size, batched, x: (x + 1, batched[0]))
  return g(x)


def _composite(x):
  return lax.composite(lambda x: (rec("c", x), x * 2)[1], name="my.double")(x)


def _linear_call(x):
  def callee(_, t):
    rec("callee", t)
    return 2 * t
  return jax.custom_derivatives.linear_call(callee, lambda _, t: 2 * t, None, x)


def _shard_map(x):
  mesh = jax.make_mesh((2,), ("i",))

  def body(v):
    rec("shard", v)
    return v + 1
  return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                       check_vma=False)(x)


def _pmap(x):
  return jax.pmap(lambda v: (rec("pmap", v), v + 1)[1],
                  devices=jax.devices()[:2])(jnp.full(2, x)).sum()


def _platform_dependent(x):
  return lax.platform_dependent(x, cpu=lambda x: (rec("cpu", x), x + 1)[1],
                                default=lambda x: (rec("other", x), x - 1)[1])


def _custom_gradient(x):
  @jax.custom_gradient
  def g(x):
    rec("g", x)
    return jnp.sin(x), lambda ct: (rec("ct", ct), ct * jnp.cos(x))[1]
  return g(x)


#: JAX 0.8/0.9's compute_on stages a jit; 0.10's compute_on2 and 0.11+'s
#: compute_on, the compute_on primitive.
def _old_compute_on():
  from jax.experimental import compute_on as co
  import inspect
  kind = inspect.signature(co.compute_on).parameters["compute_type"].kind
  return (not hasattr(co, "compute_on2")
          and kind is not inspect.Parameter.KEYWORD_ONLY)


_OLD_COMPUTE_ON = _old_compute_on()


def _compute_on(x):
  from jax.experimental import compute_on as co
  f = jax.jit(lambda x: (rec("host", x), x * 2)[1])
  if hasattr(co, "compute_on2"):   # JAX 0.10: compute_on2 stages compute_on
    return co.compute_on2(compute_type="device_host",
                          out_memory_spaces=jax.memory.Space.Device)(f)(x)
  try:   # JAX 0.11+: one form, the compute_on primitive
    return co.compute_on(compute_type="device_host",
                         out_memory_spaces=jax.memory.Space.Device)(f)(x)
  except TypeError:   # JAX 0.8, 0.9: a jit with the compute type set
    return co.compute_on("device_host")(f)(x)


#: name -> (program, the primitives it stages that hold jaxprs)
HANDLED = {
    "cond": (lambda x: lax.cond(x > 0, lambda x: (rec("T", x), x)[1],
                                lambda x: (rec("F", x), -x)[1], x), {"cond"}),
    "switch": (lambda x: lax.switch(1, [lambda x: (rec("0", x), x)[1],
                                        lambda x: (rec("1", x), x)[1]], x),
               {"cond"}),
    "while": (lambda x: lax.while_loop(
        lambda c: (rec("c", c), c < x + 2)[1],
        lambda c: (rec("b", c), c + 1)[1], x), {"while"}),
    "scan": (lambda x: lax.scan(lambda c, y: ((rec("s", c, y), c + y)[1], None),
                                x, jnp.arange(2.0))[0], {"scan"}),
    "jit": (jax.jit(lambda x: (rec("j", x), x + 1)[1]), {"jit"}),
    "checkpoint": (jax.checkpoint(lambda x: (rec("r", x), jnp.sin(x))[1]),
                   {"remat2"}),
    "custom_jvp": (_custom_jvp, {"custom_jvp_call"}),
    "custom_vjp": (_custom_vjp, {"custom_vjp_call"}),
    "custom_linear_solve": (_cg, {"custom_linear_solve", "while", "jit"}),
    "custom_root": (_custom_root, {"custom_jvp_call"}),
    "custom_vmap": (_custom_vmap, {"custom_vmap_call"}),
    "composite": (_composite, {"composite"}),
    "linear_call": (_linear_call, {"linear_call"}),
    "shard_map": (_shard_map, {"shard_map"}),
    "platform_dependent": (_platform_dependent, {"cond"}),
    "custom_gradient": (_custom_gradient, {"custom_vjp_call"}),
    "compute_on": (_compute_on, {"jit"} if _OLD_COMPUTE_ON else {"compute_on"}),
    "map": (lambda x: lax.map(lambda y: (rec("m", y), y + 1)[1],
                              jnp.arange(2.0) + x).sum(), {"scan"}),
    "fori_loop": (lambda x: lax.fori_loop(0, 2, lambda i, c: (rec("i", i, c),
                                                              c + i)[1], x),
                  {"scan"}),
    "pmap": (_pmap, {"jit", "shard_map"}),
}


def _reduce(x):
  return lax.reduce(jnp.full(3, x), 0.0,
                    lambda a, b: (rec("r", a), a + b)[1], (0,))


def _reduce_window(x):
  return lax.reduce_window(jnp.full(3, x), 0.0,
                           lambda a, b: (rec("w", a), a + b)[1], (2,), (1,),
                           "VALID").sum()


def _pallas(x):
  def kernel(x_ref, o_ref):
    rec("k")
    o_ref[...] = x_ref[...] + 1
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                        interpret=True)(jnp.full(8, x)).sum()


#: name -> (program, the refused primitive)
REFUSED = {
    "reduce": (_reduce, "reduce"),
    "reduce_window": (_reduce_window, "reduce_window"),
    "pallas_call": (_pallas, "pallas_call"),
}


def _higher_order(jaxpr, found):
  for eqn in jaxpr.eqns:
    subs = list(_compat.jaxprs_in_params(eqn.params))
    if eqn.primitive is _compat.call_hi_primitive_p:
      # (JAX 0.11+: a high-level primitive, e.g. custom_root; its
      # sub-computations are in its expansion)
      subs.append(_compat.hi_primitive_expansion(eqn).jaxpr)
    if subs:
      found.add(eqn.primitive.name)
    for sub in subs:
      _higher_order(sub, found)
  return found


def _census():
  found = {}
  for name, (prog, _) in {**HANDLED, **REFUSED}.items():
    jaxpr = jax.make_jaxpr(around(prog))(1.0)
    for prim in _higher_order(jaxpr.jaxpr, set()):
      found.setdefault(prim, []).append(name)
  return found


def test_every_higher_order_primitive_is_handled_or_refused_with_a_reason():
  found = _census()
  take()
  # (JAX's primitives: the pass also has rules for its own, e.g. counters)
  handled = {p.name for p in _token_pass.RULES
             if not p.name.startswith("jax_effects_")}
  refused = set(_token_pass.REFUSED)
  unclassified = set(found) - handled - refused
  assert not unclassified, f"no rule and no reason for {unclassified}"
  # every primitive of the tables is exercised by a program here
  # (closed_call/call, eval_jaxpr on JAX 0.12: JAX-internal call primitives
  # no public API stages)
  # (call_exported: the call of an exported function, no sub-computation;
  # tests/api/test_export.py)
  # (compute_on: JAX 0.8/0.9's compute_on stages a jit, no such primitive)
  assert handled <= set(found) | {"call", "closed_call", "eval_jaxpr",
                                  "call_exported"} | (
                                      {"compute_on"} if _OLD_COMPUTE_ON
                                      else set()), (
      handled - set(found))
  assert refused <= set(found), refused - set(found)
  for name, (_, prims) in HANDLED.items():
    assert prims <= set(found), name
  # the census covers JAX's own primitive objects of these names
  import gc
  live = {o.name for o in gc.get_objects() if isinstance(o, jex_core.Primitive)}
  assert set(found) <= live


@pytest.mark.parametrize("name", sorted(HANDLED))
def test_effects_inside_run_in_program_order(name):
  take()
  prog, _ = HANDLED[name]
  f = around(prog)
  with jax.disable_jit():
    expected_out = f(1.0)
  expected = take()
  assert ("before", 1.0) in expected and len(expected) >= 3
  out = je.jit(f)(1.0)
  assert take() == expected
  np.testing.assert_allclose(out, expected_out, rtol=1e-6)
  # and called again (cached executable, runtime tokens carried over)
  je.jit(f)(1.0)
  je.jit(f)(1.0)
  assert take() == expected * 2


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_effects_inside_are_refused_with_a_reason(name):
  take()
  prog, prim = REFUSED[name]
  with pytest.raises(NotImplementedError) as info:
    je.jit(around(prog))(1.0)
  msg = str(info.value)
  assert f"inside JAX's higher-order primitive '{prim}'" in msg
  assert "jax_effects.callback(" in msg             # names the effect
  assert _token_pass.REFUSED[prim] in msg         # says why
  assert "Move the effect out of it" in msg          # and what to do
  for private in ("RULES", "_token_pass", "jax_effects._", "add a rule"):
    assert private not in msg
  assert take() == []
  # the runtime keeps working
  assert je.jit(around(lambda x: x + 1))(1.0) == 2.0
  assert take() == [("before", 1.0), ("after", 2.0)]


def test_cg_with_a_print_in_its_matvec_matches_jax_debug_print(effects_capture):
  seen = []

  def solve(print_fn, b):
    def matvec(v):
      print_fn(v)
      return jnp.array([[3.0, 1.0], [1.0, 2.0]]) @ v
    return jax.scipy.sparse.linalg.cg(matvec, b, maxiter=5)[0]

  b = jnp.array([1.0, 2.0])
  want = jax.jit(functools.partial(solve, lambda v: jax.debug.callback(
      lambda v: seen.append(str(v)), v, ordered=True)))(b)
  jax.effects_barrier()
  got = je.jit(functools.partial(solve, lambda v: je.print("{}", v)))(b)
  je.effects_barrier()
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert len(seen) >= 2
  assert effects_capture.printed == seen
  # and under grad: the matvec's effects run where the differentiated
  # program calls it, in the same order as JAX's ordered callbacks
  seen.clear()
  n = len(effects_capture.printed)
  g_want = jax.jit(jax.grad(lambda b: solve(lambda v: jax.debug.callback(
      lambda v: seen.append("m"), v, ordered=True), b).sum()))(b)
  jax.effects_barrier()
  g_got = je.jit(jax.grad(lambda b: solve(lambda v: je.print("m"), b).sum()))(b)
  je.effects_barrier()
  np.testing.assert_allclose(g_got, g_want, rtol=1e-5)
  assert effects_capture.printed[n:] == seen


#: Programs JAX can differentiate in reverse mode (no while_loop; composite
#: and custom_vmap have no JVP rule in JAX; shard_map/pmap run per device).
DIFFERENTIABLE = sorted(set(HANDLED) - {"while", "composite", "custom_vmap",
                                        "shard_map", "pmap"})


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_effects_inside_under_grad_match_the_op_by_op_run(name):
  take()
  f = jax.grad(around(HANDLED[name][0]))
  with jax.disable_jit():
    expected_out = f(1.0)
  expected = take()
  out = je.jit(f)(1.0)
  assert take() == expected
  np.testing.assert_allclose(out, expected_out, rtol=1e-5)
