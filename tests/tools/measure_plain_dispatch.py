"""Where a plain-``jax.jit`` step with one ``jax_effects.print`` spends its
time, against the same step with ``jax.debug.print(ordered=True)``.

A developer's measurement (issue 46's cost bar, bench row (p);
``design/errors.md``, "Plain ``jax.jit``"), not a test: it prints numbers
and asserts nothing. Run it from the root of a checkout, on an idle
machine::

    PYTHONPATH=$PWD python tests/tools/measure_plain_dispatch.py [ROUNDS]

Per call, medians of ``ROUNDS`` (default 15) interleaved blocks:

* ``theirs``: the step with ``jax.debug.print(..., ordered=True)``;
* ``ours``: the step with ``jax_effects.print``, under JAX's own ``jit``;
* ``ours_raw``: what ``ExecuteReplicated.__call__`` must do for our step
  and nothing more: take JAX's token of ``PLAIN_JIT_ORDER``, shard the
  argument, ``execute_sharded(with_tokens=True)`` (the computation and its
  host call run inline here), hand the tokens back, wrap the output;
* ``none``: the step without a print (JAX's C++ dispatch path).

``ours - ours_raw`` is JAX's Python dispatch path alone (``pjit``'s cache
miss, argument inference, lowering and executable lookups), which JAX takes
for every executable with an ordered or unordered effect
(``pjit._get_fastpath_data``). ``theirs / (ours - ours_raw)`` is the ratio
the row would read if our computation, its token and its print cost
nothing. Reads the private attributes of JAX's compiled object
(``_executable.unsafe_call``; JAX 0.8-0.12).
"""
import contextlib
import io
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jax_effects
from jax_effects import _jax_api


def main(rounds: int) -> None:
  x = jnp.arange(8, dtype=jnp.float32)

  def ours(v):
    jax_effects.print("v {}", v[0])
    return v * 2.0 + 1.0

  def theirs(v):
    jax.debug.print("v {}", v[0], ordered=True)
    return v * 2.0 + 1.0

  fo, ft = _jax_api.jit(ours), _jax_api.jit(theirs)
  fn = _jax_api.jit(lambda v: v * 2.0 + 1.0)
  ex = fo.lower(x).compile()._executable.unsafe_call
  n_effects = len(ex.ordered_effects)

  def raw(v):
    bufs = ex._add_tokens_to_inputs(ex.in_handler([v]))
    results = ex.xla_executable.execute_sharded(bufs, with_tokens=True)
    tokens = results.consume_with_handlers([lambda xs: xs] * n_effects,
                                           strict=False)
    ex._handle_token_bufs(tokens, results.consume_token())
    return results.consume_with_handlers(ex.out_handler.handlers)

  def block(f, n):
    start = time.perf_counter()
    for _ in range(n):
      f(x)
    jax.effects_barrier()
    return (time.perf_counter() - start) / n * 1e6

  steps = {"theirs": (ft, 300), "ours": (fo, 1000), "ours_raw": (raw, 1000),
           "none": (fn, 1000)}
  times = {k: [] for k in steps}
  with contextlib.redirect_stdout(io.StringIO()):
    for f, _ in steps.values():
      f(x)
    jax.effects_barrier()
    for _ in range(rounds):
      for name, (f, n) in steps.items():
        times[name].append(block(f, n))
  m = {k: statistics.median(v) for k, v in times.items()}
  path = m["ours"] - m["ours_raw"]
  print(f"JAX {jax.__version__}, per call (us): " + ", ".join(
      f"{k} {v:.1f}" for k, v in m.items()))
  print(f"JAX's Python dispatch path alone: {path:.1f} us")
  print(f"theirs / ours: {m['theirs'] / m['ours']:.2f}")
  print(f"theirs / JAX's path alone (ours, were its computation, token and "
        f"print free): {m['theirs'] / path:.2f}")


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
