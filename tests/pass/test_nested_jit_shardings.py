"""A nested ``jit``'s ``in_shardings``/``out_shardings`` hold when jax_effects
inlines it (``jax_effects/_pass/control_flow_rules.py``).

The token-threading pass inlines a jit that holds effects (a ``jax.jit``
equation inside a ``jax_effects.jit`` function, or the one a
``jax_effects.jit`` function called inside binds). JAX's nested jit lays its arguments and
results out as its shardings say; so must the inlined one. Oracle: the same
nesting with JAX's ``jax.jit`` and ``jax.debug.print`` (the effect).
Contract: ``design/architecture.md``, the ``_pass/token_pass`` entry (a
``jit``'s shardings kept as sharding constraints).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_effects as je

JAX_JIT = jax.jit


def _body(x):
  jax.debug.print("sum {}", x.sum())
  return x * 2


def _outer(jit_inner, jit_outer, **inner_kwargs):
  inner = jit_inner(_body, **inner_kwargs)
  return jit_outer(lambda x: inner(x) + 1)


@pytest.mark.parametrize("inner_jit", [JAX_JIT, je.jit],
                         ids=["jax.jit", "je.jit"])
@pytest.mark.parametrize("where", ["out_shardings", "in_shardings"])
def test_inner_shardings_under_an_outer_jax_effects_jit(mesh, capsys,
                                                         inner_jit, where):
  sharded = NamedSharding(mesh, P("i"))
  x = jnp.arange(16.0)
  expected = _outer(JAX_JIT, JAX_JIT, **{where: sharded})(x)
  assert expected.sharding.spec == P("i")
  got = _outer(inner_jit, je.jit, **{where: sharded})(x)
  je.effects_barrier()
  assert got.sharding.is_equivalent_to(expected.sharding, 1)
  np.testing.assert_array_equal(got, expected)
  assert capsys.readouterr().out.splitlines() == ["sum 120.0"] * 2


def test_tree_prefix_shardings_of_a_jax_effects_jit_nested(mesh, capsys):
  # in_shardings a prefix per argument (a dict's leaves share one), None for
  # an argument left as it comes, a static argument skipped; out_shardings
  # a prefix of the result.
  sharded = NamedSharding(mesh, P("i"))
  replicated = NamedSharding(mesh, P())

  def f(d, n, y):
    jax.debug.print("n {}", n)
    return {"a": d["a"] * n, "b": d["b"] + y}, y

  kwargs = dict(static_argnums=1, in_shardings=({"a": sharded, "b": None},
                                                replicated),
                out_shardings=({"a": sharded, "b": replicated}, sharded))
  d = {"a": jnp.arange(8.0), "b": jnp.ones(8)}
  y = jnp.arange(8.0)

  def run(jit):
    inner = jit(f, **kwargs)
    return JAX_JIT(lambda d, y: inner(d, 3, y))(d, y)

  expected = run(JAX_JIT)
  got = run(je.jit)
  je.effects_barrier()
  for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    assert g.sharding.is_equivalent_to(e.sharding, 1)
    np.testing.assert_array_equal(g, e)
  assert capsys.readouterr().out.splitlines() == ["n 3"] * 2
