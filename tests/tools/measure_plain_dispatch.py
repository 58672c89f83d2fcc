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
* ``none``: the step without a print (JAX's C++ dispatch path);
* ``bare_execute``: that step's computation alone (``execute_sharded``).

``ours - ours_raw`` is JAX's Python dispatch path alone (``pjit``'s cache
miss, argument inference, lowering and executable lookups), which JAX takes
for every executable with an ordered or unordered effect
(``pjit._get_fastpath_data``). Add JAX's parts of ``ours_raw`` (its
argument, token-result and output handling, timed per call) and the
computation without a print: that is JAX's part of our step, whatever our
effect costs. ``theirs`` over it is the ratio bench (p) would read were our
token, host call and print free. Reads the private attributes of JAX's
compiled object (``_executable.unsafe_call``; JAX 0.8-0.12).
"""
import contextlib
import io
import statistics
import sys
import time

import jax

from jax_effects import _jax_api
from jax_effects._tools import bench_plain


def main(rounds: int) -> None:
  x, fo, ft = bench_plain.steps()   # (the bench row's steps)
  fn = _jax_api.jit(lambda v: v * 2.0 + 1.0)
  ex = fo.lower(x).compile()._executable.unsafe_call
  bare = fn.lower(x).compile()._executable.unsafe_call.xla_executable
  n_effects = len(ex.ordered_effects)
  clock = time.perf_counter
  parts = {k: [] for k in PARTS}

  def raw(v):
    t0 = clock()
    bufs = ex.in_handler([v])
    t1 = clock()
    bufs = ex._add_tokens_to_inputs(bufs)
    t2 = clock()
    results = ex.xla_executable.execute_sharded(bufs, with_tokens=True)
    t3 = clock()
    tokens = results.consume_with_handlers([lambda xs: xs] * n_effects,
                                           strict=False)
    token = results.consume_token()
    t4 = clock()
    ex._handle_token_bufs(tokens, token)
    t5 = clock()
    out = results.consume_with_handlers(ex.out_handler.handlers)
    t6 = clock()
    for name, a, b in zip(PARTS, (t0, t1, t2, t3, t4, t5),
                          (t1, t2, t3, t4, t5, t6)):
      parts[name].append(b - a)
    return out

  def bare_execute(v):
    return bare.execute_sharded(ex.in_handler([v]))

  def block(f, n):
    start = clock()
    for _ in range(n):
      f(x)
    jax.effects_barrier()
    return (clock() - start) / n * 1e6

  steps = {"theirs": (ft, 300), "ours": (fo, 1000), "ours_raw": (raw, 1000),
           "none": (fn, 1000), "bare_execute": (bare_execute, 1000)}
  times = {k: [] for k in steps}
  with contextlib.redirect_stdout(io.StringIO()):
    for f, _ in steps.values():
      f(x)
    jax.effects_barrier()
    for _ in range(rounds):
      for name, (f, n) in steps.items():
        times[name].append(block(f, n))
  m = {k: statistics.median(v) for k, v in times.items()}
  part = {k: statistics.median(v) * 1e6 for k, v in parts.items()}
  path = m["ours"] - m["ours_raw"]
  # JAX's own, whatever the effect: its dispatch path, its token results
  # and outputs (our hooks are in "token in" and "tokens set": left out),
  # and its argument handling with the computation without a print
  # (bare_execute: in_handler, then the execution).
  floor = path + part["tokens out"] + part["outputs"] + m["bare_execute"]
  print(f"JAX {jax.__version__}, per call (us): " + ", ".join(
      f"{k} {v:.1f}" for k, v in m.items()))
  print("ours_raw's parts (us, medians): " + ", ".join(
      f"{k} {v:.1f}" for k, v in part.items()))
  print(f"JAX's Python dispatch path alone (ours - ours_raw): {path:.1f} us")
  print(f"JAX's part of our step, whatever our effect costs: {floor:.1f} us")
  print(f"theirs / ours: {m['theirs'] / m['ours']:.2f}")
  print(f"theirs / JAX's part (the ratio were our token, host call and "
        f"print free): {m['theirs'] / floor:.2f}")


#: ``ours_raw``'s parts: JAX's argument handling; the token in (our hook on
#: JAX's ``get_token_input``); the execution (the computation, our host
#: call and print inline); JAX's token results; JAX's setting of them (our
#: hooks on ``set_token_result``/``set_output_runtime_token`` inside);
#: JAX's output arrays.
PARTS = ("in_handler", "token in", "execute", "tokens out", "tokens set",
         "outputs")


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
