"""Differential tests: random programs (``program_generator.py``) with
ordered prints and callbacks on several named effects, nested in
cond/switch/while (effects in body and cond_fun)/scan/fori_loop/nested
jit/checkpoint. Under ``jax_effects.jit`` each effect stream must equal the
one under ``jax.disable_jit()`` and the plain-Python interpretation
(``design/tokens.md``, "Inside a computation"; ``design/transformations.md``,
"Higher-order primitives").
"""
import pytest

import helpers
import program_generator as pg

N_DEFAULT = 30
N_SLOW = 200


def _check(seed, **gen_kwargs):
  program = pg.Generator(seed, **gen_kwargs).program()
  x = seed % 17
  want_out, want = pg.run_python(program, x)
  eager_out, eager = pg.run_eager(program, x)
  jit_out, jitted = pg.run_jitted(program, x)
  text = f"seed {seed}, x={x}:\n{program.describe()}"
  assert eager_out == want_out, text
  assert jit_out == want_out, text
  assert pg.per_effect(eager) == pg.per_effect(want), text
  assert pg.per_effect(jitted) == pg.per_effect(want), text
  return want


@pytest.mark.parametrize("seed", range(N_DEFAULT))
def test_random_program(seed):
  _check(seed)


@pytest.mark.parametrize("seed", range(10))
def test_random_program_single_effect_total_order(seed):
  # one effect: the whole sequence (prints and callbacks) is one stream
  program = pg.Generator(1000 + seed, effects=("default",)).program()
  x = seed
  _, want = pg.run_python(program, x)
  _, jitted = pg.run_jitted(program, x)
  assert jitted == want, program.describe()


@pytest.mark.parametrize("seed", range(5))
def test_random_program_across_dispatches(seed):
  # several calls before a barrier: each stream is the calls' streams in order
  program = pg.Generator(2000 + seed).program()
  outs, jitted = pg.run_jitted(program, seed, calls=3)
  want = []
  for i in range(3):
    out, events = pg.run_python(program, seed + i)
    assert outs[i] == out
    want += events
  assert pg.per_effect(jitted) == pg.per_effect(want), program.describe()


def test_generator_is_deterministic_and_covers_every_kind():
  a = pg.Generator(7).program().describe()
  assert a == pg.Generator(7).program().describe()
  seen = set()

  def walk(node):
    seen.add(type(node).__name__)
    for value in vars(node).values():
      items = value if isinstance(value, list) else [value]
      for v in items:
        if isinstance(v, (pg.Node, pg.Block)):
          walk(v)

  for seed in range(N_DEFAULT):
    walk(pg.Generator(seed).program())
  # (the kinds drawn by default; test_entries draws and checks the others)
  assert {k.cls.__name__ for k in pg.KINDS.values() if k.default} <= seen
  # effects in while cond_fun are exercised too
  assert any("cond-callback" in pg.Generator(s).program().describe()
             for s in range(N_DEFAULT))


@pytest.mark.parametrize(
    "seed", range(N_DEFAULT, N_DEFAULT + helpers.scale(2, N_SLOW)))
def test_random_program_deeper(seed):
  _check(seed, max_depth=4, max_block=5)
