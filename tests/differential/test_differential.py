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

#: Programs per compiled function: a test runs its seeds' programs one
#: after another in one ``jax_effects.jit`` function
#: (``pg.run_jitted_together``: each at its top level, as alone), compiled
#: once, and checks each seed on its own.
GROUP = 10


def _groups(seeds) -> list:
  seeds = list(seeds)
  return [pytest.param(seeds[i:i + GROUP],
                       id=f"seeds{seeds[i]}-{seeds[i:i + GROUP][-1]}")
          for i in range(0, len(seeds), GROUP)]


def _check(seeds, **gen_kwargs):
  programs = [pg.Generator(seed, **gen_kwargs).program() for seed in seeds]
  xs = [seed % 17 for seed in seeds]
  failed = []
  for seed, program, x, (jit_out, jitted) in zip(
      seeds, programs, xs, pg.run_jitted_together(programs, xs)):
    want_out, want = pg.run_python(program, x)
    eager_out, eager = pg.run_eager(program, x)
    failed += [f"seed {seed}, x={x}: {what}:\n{program.describe()}"
               for what, ok in [
                   ("eager output", eager_out == want_out),
                   ("jitted output", jit_out == want_out),
                   ("eager streams", pg.per_effect(eager) == pg.per_effect(want)),
                   ("jitted streams",
                    pg.per_effect(jitted) == pg.per_effect(want))]
               if not ok]
  assert not failed, "\n".join(failed)


@pytest.mark.parametrize("seeds", _groups(range(N_DEFAULT)))
def test_random_program(seeds):
  _check(seeds)


@pytest.mark.parametrize("seeds", _groups(range(10)))
def test_random_program_single_effect_total_order(seeds):
  # one effect: the whole sequence (prints and callbacks) is one stream
  programs = [pg.Generator(1000 + seed, effects=("default",)).program()
              for seed in seeds]
  failed = [f"seed {seed}:\n{program.describe()}"
            for seed, program, (_, jitted) in zip(
                seeds, programs, pg.run_jitted_together(programs, seeds))
            if jitted != pg.run_python(program, seed)[1]]
  assert not failed, "\n".join(failed)


@pytest.mark.parametrize("seeds", _groups(range(5)))
def test_random_program_across_dispatches(seeds):
  # several calls before a barrier: each stream is the calls' streams in order
  programs = [pg.Generator(2000 + seed).program() for seed in seeds]
  failed = []
  for seed, program, (outs, jitted) in zip(
      seeds, programs, pg.run_jitted_together(programs, seeds, calls=3)):
    want_outs, want = [], []
    for i in range(3):
      out, events = pg.run_python(program, seed + i)
      want_outs.append(out)
      want += events
    if outs != want_outs:
      failed.append(f"seed {seed}: outputs {outs}, want {want_outs}")
    if pg.per_effect(jitted) != pg.per_effect(want):
      failed.append(f"seed {seed}: streams:\n{program.describe()}")
  assert not failed, "\n".join(failed)


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
    "seeds", _groups(range(N_DEFAULT, N_DEFAULT + helpers.scale(2, N_SLOW))))
def test_random_program_deeper(seeds):
  _check(seeds, max_depth=4, max_block=5)
