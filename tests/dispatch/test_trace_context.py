"""A ``jax_effects.jit`` function traces again where ``jax.jit``'s would.

``jax.jit`` keys its traces on JAX's trace context (the configuration a
trace depends on: NumPy rank and dtype promotion, default matmul precision,
x64, ...), so a function first called under one setting and then inside
``with jax.numpy_rank_promotion("raise"):`` is traced again and raises. A
``PjitFunction`` keeps traces of its own (``_dispatch.tracing.TraceCache``): they are
keyed on the same context (``design/architecture.md``, the
``_dispatch/function`` entry). Oracle: the same function under ``jax.jit``.
"""
import contextlib

import jax
import jax.numpy as jnp
import pytest

import jax_effects as je


def _add(x, y):
  return x + y


def _add_printing(x, y):
  je.print("adding")
  return x + y


def _outcome(f, context, *args):
  """What ``f(*args)`` gives under ``context`` after a call outside it."""
  f(*args)
  try:
    with context():
      out = f(*args)
    je.effects_barrier()
    return ("value", out.shape, out.dtype)
  except Exception as err:  # noqa: BLE001 - compared with jax.jit's
    je.effects_barrier()
    return ("raised", type(err))


CASES = {
    "rank promotion": (lambda: jax.numpy_rank_promotion("raise"),
                       (jnp.ones((2, 3)), jnp.ones(3))),
    "dtype promotion": (lambda: jax.numpy_dtype_promotion("strict"),
                        (jnp.float32(1), jnp.int32(1))),
    "no context": (contextlib.nullcontext, (jnp.ones((2, 3)), jnp.ones(3))),
}


@pytest.mark.parametrize("fun", [_add, _add_printing],
                         ids=["pure", "effectful"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_setting_changed_after_the_first_call_applies(case, fun):
  context, args = CASES[case]
  expected = _outcome(jax.jit(_add), context, *args)
  assert expected[0] == ("value" if case == "no context" else "raised")
  assert _outcome(je.jit(fun), context, *args) == expected


def test_matmul_precision_reaches_the_lowered_program():
  f = je.jit(lambda x: jnp.dot(x, x))
  x = jnp.ones((2, 2))
  f(x)
  with jax.default_matmul_precision("highest"):
    ours = f.lower(x).as_text()
    theirs = jax.jit(lambda x: jnp.dot(x, x)).lower(x).as_text()
  assert "HIGHEST" in theirs
  assert "HIGHEST" in ours
  assert "HIGHEST" not in f.lower(x).as_text()


def test_one_trace_per_context():
  traces = []

  @je.jit
  def f(x):
    traces.append(x.shape)
    je.print("x {}", x)
    return x * 2

  x = jnp.ones(2)
  f(x)
  f(x)
  with jax.numpy_rank_promotion("raise"):
    f(x)
    f(x)
  f(x)
  je.effects_barrier()
  assert traces == [(2,), (2,)]


@pytest.mark.parametrize("effects", [False, True])
def test_jax_clear_caches_drops_kept_traces(effects):
  # jax.clear_caches() drops every staging cache, so the next call traces
  # the function again, as jax.jit's does.
  def count_traces(jit):
    traces = []

    def f(x):
      traces.append(None)
      if effects:
        je.print("x {}", x)
      return x * 2

    g = jit(f)
    g(jnp.float32(1))
    g(jnp.float32(2))
    jax.clear_caches()
    g(jnp.float32(3))
    je.effects_barrier()
    return len(traces)

  assert count_traces(jax.jit) == 2
  assert count_traces(je.jit) == 2
