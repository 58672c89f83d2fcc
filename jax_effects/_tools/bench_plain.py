"""``bench`` row (p): effects of ours under a jit the user did not write
(issue 46; ``design/errors.md``, "Plain ``jax.jit``").

* ``p_ours_plain``: a step with one ``jax_effects.print`` per call, under
  plain ``jax.jit`` (JAX's Python dispatch path, with JAX's token of
  ``PLAIN_JIT_ORDER``);
* ``p_jax_print``: the same step with ``jax.debug.print(...,
  ordered=True)`` under ``jax.jit``;
* ``p_import``: a plain ``jax.jit`` step with no effect of ours, timed in
  two processes, one with ``import jax_effects`` and one without, taking
  turns block by block (``_import_ratios``; several such pairs, the median
  of all the rounds' ratios): importing must cost it nothing.

Targets: JAX's / ours >= 2.5; with / without the import <= 1.02.

Issue 46 asked for JAX's / ours >= 5. No effect of ours under plain
``jax.jit`` can reach it: JAX's own part of such a step (its Python
dispatch path for an executable with an effect, its argument and token
handling, the computation) costs more than a fifth of JAX's whole
ordered-print step, so the ratio stays below 4.1-4.9 even if our host call
were free (``tests/tools/measure_plain_dispatch.py``; ``design/errors.md``,
"C++ dispatch"). The bound is what ours keeps today (2.6-3.2 in twelve idle
runs, two rounds of six) less a margin for the machine's noise: a regression guard, not that
goal.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

TARGETS = {
    "p_jax/ours": (">=", 2.5, "plain jax.jit step with one print: "
                   "jax.debug.print(ordered=True) / jax_effects.print "
                   "(below 5 under JAX's dispatch: bench_plain)"),
    "p_import": ("<=", 1.02, "plain jax.jit step without effects: with / "
                 "without import jax_effects (two processes taking turns)"),
}

# A child times blocks of a plain jax.jit step, one block per line it reads
# from its parent (its first line: the step compiled and warm).
_CHILD = """
import sys, time
if sys.argv[1] == "1":
    import jax_effects
import jax, jax.numpy as jnp
calls = int(sys.argv[2])
f = jax.jit(lambda v: v * 2.0 + 1.0)
x = jnp.arange(8, dtype=jnp.float32)
f(x).block_until_ready()
print("ready", flush=True)
for _ in sys.stdin:
    t = time.perf_counter()
    for _ in range(calls):
        y = f(x)
    y.block_until_ready()
    print((time.perf_counter() - t) / calls, flush=True)
"""


def _import_ratios(calls: int, rounds: int) -> list[float]:
  """Per round, a block in a process with ``import jax_effects`` / the
  next block in one without, the two alternating.

  Both processes live through all the rounds and take turns, so each
  round's two blocks see the same state of the machine. This VM's dispatch
  speed switches between two levels (about 6.7 and 10 us a call of this
  step here) for tenths of a second at a time, whatever the import: timed
  one process after the other, the ratio of two fresh processes' fastest
  blocks read 0.6-1.6."""
  children = [subprocess.Popen(
      [sys.executable, "-c", _CHILD, flag, str(calls)], stdin=subprocess.PIPE,
      stdout=subprocess.PIPE, text=True) for flag in ("1", "0")]
  try:
    for child in children:
      assert child.stdout.readline().strip() == "ready"

    def block(child) -> float:
      child.stdin.write("\n")
      child.stdin.flush()
      return float(child.stdout.readline())

    ratios = []
    for r in range(rounds):
      if r % 2:
        without = block(children[1])
        ratios.append(block(children[0]) / without)
      else:
        with_import = block(children[0])
        ratios.append(with_import / block(children[1]))
    return ratios
  finally:
    for child in children:
      child.stdin.close()
      child.wait()


def steps():
  """``(x, ours, theirs)``: the row's argument and its two steps under
  JAX's own ``jit`` (also ``tests/tools/measure_plain_dispatch.py``'s)."""
  import jax
  import jax.numpy as jnp

  import jax_effects
  from jax_effects import _jax_api

  def ours(v):
    jax_effects.print("v {}", v[0])
    return v * 2.0 + 1.0

  def theirs(v):
    jax.debug.print("v {}", v[0], ordered=True)
    return v * 2.0 + 1.0

  return (jnp.arange(8, dtype=jnp.float32), _jax_api.jit(ours),
          _jax_api.jit(theirs))


def bench_plain(interleave, quiet_output, ratio, summary, rounds: int,
                calls: int, pairs: int) -> tuple[dict, dict]:
  x, fo, ft = steps()
  with quiet_output():
    samples = interleave({"p_ours_plain": (lambda: fo(x), calls),
                          "p_jax_print": (lambda: ft(x), calls)}, rounds)
  results = {k: summary(v) for k, v in samples.items()}
  imports = [q for _ in range(pairs) for q in _import_ratios(calls * 10, 20)]
  results["p_import_ratios"] = {"median": statistics.median(imports),
                                "min": min(imports), "max": max(imports),
                                "rounds": len(imports)}
  return results, {"p_jax/ours": ratio(samples, "p_jax_print", "p_ours_plain"),
                   "p_import": statistics.median(imports)}
