"""``bench`` row (p): effects of ours under a jit the user did not write
(issue 46; ``design/errors.md``, "Plain ``jax.jit``").

* ``p_ours_plain``: a step with one ``jax_effects.print`` per call, under
  plain ``jax.jit`` (JAX's Python dispatch path, with JAX's token of
  ``PLAIN_JIT_ORDER``);
* ``p_jax_print``: the same step with ``jax.debug.print(...,
  ordered=True)`` under ``jax.jit``;
* ``p_import``: a plain ``jax.jit`` step with no effect of ours, timed in
  one process before and after ``import jax_effects``, over the same in a
  process that imports nothing (``_import_cost``): importing must cost it
  nothing.

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
                 "without import jax_effects (after / before it, one process)"),
}

# A child times blocks of a plain jax.jit step, runs its first argument
# (``import jax_effects``, or nothing), and times as many blocks again. Each
# block's time is divided by that of a reference workload in C (SHA-256 of
# zeros) run right after it, so that a change in the machine's speed
# between the blocks before and after (another process, the VM) cancels.
_CHILD = """
import hashlib, json, statistics, sys, time
import jax, jax.numpy as jnp
calls = int(sys.argv[2])
f = jax.jit(lambda v: v * 2.0 + 1.0)
x = jnp.arange(8, dtype=jnp.float32)
f(x).block_until_ready()
zeros = bytes(4096)

def blocks(n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        for _ in range(calls):
            y = f(x)
        y.block_until_ready()
        t1 = time.perf_counter()
        h = hashlib.sha256()
        for _ in range(calls // 4):
            h.update(zeros)
        times.append((t1 - t) / (time.perf_counter() - t1))
    return statistics.median(times)

before = blocks(40)
exec(sys.argv[1])
print(json.dumps(blocks(40) / before))
"""


def _after_before(statement: str, calls: int) -> float:
  out = subprocess.run([sys.executable, "-c", _CHILD, statement, str(calls)],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout.splitlines()[-1])


def _import_cost(calls: int, processes: int) -> tuple[float, dict]:
  """The step's time after ``import jax_effects`` / before it, in one
  process, over the same in a process that imports nothing (medians over
  ``processes`` of each, alternated).

  Before and after are timed in one process because this VM's dispatch
  speed differs between processes (about 6.7 or 10 us a call of this step
  here, a process keeping its level for tenths of a second or longer):
  timed in two processes, even taking turns block by block, the ratio of
  two processes that both import nothing read 0.93-1.03 over four runs.
  Within a process the speed shifts too, which the reference workload
  after each block cancels: on a loaded machine, medians of five processes
  that import nothing read 0.93-1.02 raw, 0.97-1.005 so normalized."""
  ours, control = [], []
  for _ in range(processes):
    ours.append(_after_before("import jax_effects", calls))
    control.append(_after_before("pass", calls))
  ratio = statistics.median(ours) / statistics.median(control)
  return ratio, {"with_import": statistics.median(ours),
                 "without": statistics.median(control),
                 "processes": processes}


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
  imports, results["p_import_after/before"] = _import_cost(calls * 10, pairs)
  return results, {"p_jax/ours": ratio(samples, "p_jax_print", "p_ours_plain"),
                   "p_import": imports}
