"""Differential fuzz: generated effectful programs, jit vs eager
(``design/transformations.md``: "Ordering modes", "vmap", "Differentiation:
jvp, grad, linearize, vjp, checkpoint").

Each generated program (``fuzz_programs.py``: cond/while/scan/fori,
inner jit, checkpoint, grad, vmap, named/default/unordered effects, print and
callback) runs eagerly under ``jax.disable_jit()`` and under
``jax_effects.jit``, in the per-effect and the global ordering mode. The
effects each mode promises to order must come out identically (one total
order in global mode, one per effect otherwise), and the jit run must match
a plain-Python oracle of the ``(effect, tag, k)`` sequence. Where the eager
reference itself disagrees with the oracle (a bug of the eager path, see
``fuzz_programs``), or where JAX hoists a loop-invariant effect out of a loop
under ``grad`` (read off the traced program, ``fuzz_programs.hoisted_effects``),
the case is an expected failure, raised only after the jit run matched the
oracle exactly (with that hoisting). jax_effects keeps its effects in their
loops (``_compat.keep_effects_in_loops``), so no generated program is hoisted;
the check is kept, and tested with JAX's hoisting turned back on
(:func:`jax_hoisting`).

A default run collects ``N_SEEDS`` seeds per mode; ``--run-slow`` collects
``SLOW_SEEDS`` more (``JAX_EFFECTS_FUZZ_SEEDS=N`` sets that count).
"""
import os

import jax
import pytest

import helpers
import jax_effects as je

import fuzz_programs as fp

N_SEEDS = 10
SLOW_SEEDS = int(os.environ.get("JAX_EFFECTS_FUZZ_SEEDS", "300"))
MODES = ["per_effect", "global"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(N_SEEDS + helpers.scale(0, SLOW_SEEDS)))
def test_generated_program(seed, mode):
  check_program(seed, mode)


def check_program(seed, mode):
  program = fp.Generator(seed).program()
  try:
    stats = fp.compare(program, mode)
  except (fp.KnownEagerBug, fp.LoopInvariantHoisting) as known:
    # raised only after jit was checked against the oracle (with JAX's
    # hoisting, where the traced program shows it)
    pytest.xfail(str(known))
  assert stats["error"] is None, f"{program} failed: {stats['error']}"


def test_generator_covers_every_statement_kind():
  # The CI seeds together use every statement kind, in both effect kinds.
  kinds, hows, names = set(), set(), set()
  for seed in range(N_SEEDS):
    for s in fp.walk(fp.Generator(seed).program()):
      kinds.add(s.kind)
      if s.kind == "effect":
        hows.add(s.args["how"])
        names.add(s.args["name"])
  assert kinds == set(fp.GenOptions().kinds), kinds
  assert hows == {"callback", "print", "unordered"}
  assert names == set(fp.EFFECT_NAMES)


def test_oracle_matches_hand_computed_sequence():
  # The oracle itself: while (with an effect in cond_fun) inside grad-free
  # code, scan in reverse, cond on k.
  S = fp.Stmt
  e = lambda tag, name=None: S("effect", tag, {"name": name, "how": "callback"})
  program = [
      e(1),
      S("while", 2, {"n": 1, "cond_effect": e(3, "fz_a")}, ([e(4)],)),
      S("scan", 5, {"length": 2, "reverse": True}, ([e(6, "fz_b")],)),
      S("cond", 7, {"m": 2, "r": 0}, ([e(8)], [e(9)])),
  ]
  # k0 = 7: while runs 1 + 7 % 2 = 2 iterations, cond_fun 3 times.
  # scan: i = 1 then 0 -> k = 8, then 8; result (8 + 16) % 1009 = 24 -> even.
  assert fp.oracle(program, 7) == [
      ("default", 1, 7), ("fz_a", 3, 7), ("default", 4, 7), ("fz_a", 3, 7),
      ("default", 4, 7), ("fz_a", 3, 7), ("fz_b", 6, 8), ("fz_b", 6, 8),
      ("default", 8, 24)]
  for mode in MODES:
    fp.compare(program, mode)


def test_oracle_vmap_lanes():
  # Under vmap an effect happens once per batch element of the vmaps that
  # batch its operands, in batch order (outer vmap first): a callback of
  # sum(x) per element, a print of a k that no vmap batches once.
  S = fp.Stmt
  cb = lambda tag: S("effect", tag, {"name": None, "how": "callback"})
  pr = lambda tag: S("effect", tag, {"name": None, "how": "print"})
  program = [
      S("vmap", 20, {"B": 2, "batch_k": True}, ([cb(21), pr(22)],)),
      S("vmap", 23, {"B": 3, "batch_k": False}, ([pr(24), cb(25)],)),
      S("vmap", 26, {"B": 2, "batch_k": True}, (
          [S("vmap", 27, {"B": 2, "batch_k": False}, ([pr(28), cb(29)],))],)),
  ]
  d = "default"
  assert fp.oracle(program, 7) == [
      (d, 21, 7), (d, 21, 8), (d, 22, 7), (d, 22, 8),          # k: 7+8 = 15
      (d, 24, 15), (d, 25, 15), (d, 25, 15), (d, 25, 15),
      (d, 28, 15), (d, 28, 16),
      (d, 29, 15), (d, 29, 15), (d, 29, 16), (d, 29, 16)]
  for mode in MODES:
    fp.compare(program, mode)


@pytest.mark.parametrize("seed", range(6))
def test_program_generator_programs_in_global_mode(seed):
  # The control-flow programs of program_generator.py (test_differential) in
  # the global ordering mode: one total order across all their named effects,
  # equal to the plain-Python interpretation's, event for event.
  import program_generator as pg
  program = pg.Generator(seed).program()
  x = seed % 17
  want_out, want = pg.run_python(program, x)
  with je.ordering("global"):
    jit_out, jitted = pg.run_jitted(program, x)
  assert jit_out == want_out
  assert jitted == want, f"seed {seed}:\n{program.describe()}"


@pytest.fixture
def jax_hoisting(monkeypatch):
  """JAX's loop-invariant hoisting of scan bodies under grad, as JAX does
  it: also for bodies with our effects (which jax_effects keeps in the loop,
  ``_compat.keep_effects_in_loops``)."""
  from jax_effects import _compat
  monkeypatch.setattr(_compat.jaxprs, "_unhoisted_effect_types", set())


def _loop_invariant_program():
  S = fp.Stmt
  return [S("grad", 1, {}, ([S("fori", 2, {"n": 2}, (
      [S("effect", 3, {"name": None, "how": "print"})],))],))]


def test_grad_of_loop_with_loop_invariant_effect_stays_in_the_loop():
  # Under grad, an effect that depends on no loop-carried value runs once per
  # iteration (JAX's scan partial evaluation would hoist it out of the loop).
  program = _loop_invariant_program()
  assert fp.oracle(program, 7) == [("default", 3, 7), ("default", 3, 7)]
  assert fp.hoisted_effects(program) == {}
  for mode in MODES:
    assert fp.compare(program, mode)["records"] == 2


def test_grad_of_loop_with_loop_invariant_effect_hoisted_by_jax(jax_hoisting):
  # With JAX's hoisting the effect runs once; the fuzz check must recognise
  # exactly that, from the traced program.
  program = _loop_invariant_program()
  assert fp.hoisted_effects(program) == {3: 1}
  assert fp.oracle(program, 7, {3: 1}) == [("default", 3, 7)]
  for mode in MODES:
    with pytest.raises(fp.LoopInvariantHoisting):
      fp.compare(program, mode)


def test_jax_debug_print_is_hoisted_alike(capfd):
  # The same hoisting with JAX's own ordered print under jax.jit: once.
  def loss(x):
    def body(i, x):
      jax.debug.print("tick", ordered=True)
      return x * 2.0
    return jax.lax.fori_loop(0, 3, body, x)

  jax.jit(jax.grad(loss))(1.0)
  jax.effects_barrier()
  assert capfd.readouterr().out.splitlines() == ["tick"]


@pytest.mark.parametrize("hoist", [False, True])
def test_fuzz_check_fails_on_reversed_records(monkeypatch, hoist):
  # The differential check can fail: jit records in reverse order are caught,
  # also in a program where JAX hoists an effect (not excused as hoisting).
  S = fp.Stmt
  e = lambda tag: S("effect", tag, {"name": None, "how": "callback"})
  body = [e(3), S("fori", 4, {"n": 2}, ([e(5)],)), S("arith", 6, {"c": 1})]
  program = [S("grad", 1, {}, (body,))] if hoist else body
  if hoist:   # (JAX's hoisting, which jax_effects turns off for its effects)
    from jax_effects import _compat
    monkeypatch.setattr(_compat.jaxprs, "_unhoisted_effect_types", set())
  assert bool(fp.hoisted_effects(program)) == hoist
  run = fp.run

  def reversed_jit(program, mode, *, jit, k0=7):
    out = run(program, mode, jit=jit, k0=k0)
    if jit:
      out.records.reverse()
    return out

  if hoist:
    with pytest.raises(fp.LoopInvariantHoisting):  # as it is: known, exact
      fp.compare(program, "per_effect")
  else:
    fp.compare(program, "per_effect")   # passes as it is
  monkeypatch.setattr(fp, "run", reversed_jit)
  with pytest.raises(AssertionError):
    fp.compare(program, "per_effect")
