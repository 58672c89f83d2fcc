"""``bench`` row (q): a print or a log record per step of a compiled loop,
against Python's own (issue 48, point 1; ``design/formatting.md``, "In a
compiled loop").

A ``lax.scan`` of ``steps`` steps (20,000; 2,000 with ``--quick``) over a
``float32`` vector, one value per step, under ``jax_effects.jit``:

* ``q_print``: ``jax_effects.print("{}", x)`` per step;
* ``q_python_print``: a Python loop doing ``print("{}".format(v))`` of the
  same values (NumPy scalars) to the same stream (``sys.stdout``, one
  ``io.StringIO`` emptied before each block);
* ``q_log``: ``jax_effects.log("{}", x)`` per step, to the ``jax_effects``
  logger with one ``logging.StreamHandler`` on an ``io.StringIO``;
* ``q_python_log``: ``logger.info("{}".format(v))`` of the same values to
  the same logger and handler;
* ``q_callback`` (reported): ``jax_effects.callback`` of a no-op function
  per step, against the same Python print;
* ``q_batched128``, ``q_batched1024``: ``q_print``'s loop inside
  ``jax_effects.batched(k=128)`` and ``k=1024`` (issue 48, point 2: the
  lines staged on the device, flushed every K steps and at the exit).

Targets: ours / Python's <= 3 for print and for log, batched at K=128
<= 1, and the printed text byte-identical, batched or not (checked once). Interleaved as the other rows
(``bench.interleave``: one loop per block, a barrier ending it).
"""
from __future__ import annotations

import contextlib
import io
import logging

TARGETS = {
    "q_print/python": ("<=", 3.0, "jfx.print in a {loop_print_steps:,}-step "
                                  "scan / Python's print of the same values"),
    "q_log/python": ("<=", 3.0, "jfx.log in a {loop_print_steps:,}-step scan "
                                "/ logger.info of the same values, same "
                                "handler"),
    "q_same_text": (">=", 1.0, "loop print: ours prints Python's text "
                               "(1 = yes)"),
    "q_callback/python": ("=", None, "a no-op jfx.callback in the same scan "
                                     "/ Python's print of the values"),
    "q_batched128/python": ("<=", 1.0, "jfx.print in the same scan inside "
                                       "jfx.batched(k=128) / Python's print"),
    "q_batched1024/python": ("=", None, "the same at k=1024 / Python's "
                                        "print"),
}


def _noop(x):
  del x


@contextlib.contextmanager
def _streams():
  """``(out, handler)``: ``sys.stdout`` replaced by ``out``, and the
  ``jax_effects`` logger writing through ``handler`` only (INFO)."""
  out = io.StringIO()
  handler = logging.StreamHandler(io.StringIO())
  logger = logging.getLogger("jax_effects")
  saved = (logger.handlers[:], logger.level, logger.propagate)
  logger.handlers[:] = [handler]
  logger.setLevel(logging.INFO)
  logger.propagate = False
  try:
    with contextlib.redirect_stdout(out):
      yield out, handler
  finally:
    logger.handlers[:], logger.propagate = saved[0], saved[2]
    logger.setLevel(saved[1])


def _emptied(stream: io.StringIO) -> None:
  stream.seek(0)
  stream.truncate()


def bench_loop_print(interleave, ratio, summary, rounds: int,
                     steps: int) -> tuple[dict, dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_effects

  xs = jnp.arange(steps, dtype=jnp.float32) * 0.5
  values = list(np.asarray(xs))   # (NumPy float32 scalars: the same values)

  def scan(emit, k=None):
    def body(carry, x):
      emit(x)
      return carry, None

    def loop(v):
      if k is None:
        return jax.lax.scan(body, 0.0, v)[0]
      with jax_effects.batched(k=k):
        return jax.lax.scan(body, 0.0, v)[0]
    return jax_effects.jit(loop)

  f_print = scan(lambda x: jax_effects.print("{}", x))
  f_log = scan(lambda x: jax_effects.log("{}", x))
  f_callback = scan(lambda x: jax_effects.callback(_noop, None, x))
  f_batched = {k: scan(lambda x: jax_effects.print("{}", x), k)
               for k in (128, 1024)}
  logger = logging.getLogger("jax_effects")

  with _streams() as (out, handler):
    def ours_print():
      _emptied(out)
      return f_print(xs)

    def python_print():
      _emptied(out)
      for v in values:
        print("{}".format(v))

    def ours_log():
      _emptied(handler.stream)
      return f_log(xs)

    def python_log():
      _emptied(handler.stream)
      for v in values:
        logger.info("{}".format(v))

    def batched(k):
      def run():
        _emptied(out)
        return f_batched[k](xs)
      return run

    python_print()
    theirs = out.getvalue()
    same_text = 1.0
    for run in (ours_print, batched(128), batched(1024)):
      jax.block_until_ready(run())
      jax_effects.effects_barrier()
      same_text = min(same_text, float(out.getvalue() == theirs))
    samples = interleave({
        "q_print": (ours_print, 1), "q_python_print": (python_print, 1),
        "q_log": (ours_log, 1), "q_python_log": (python_log, 1),
        "q_callback": (lambda: f_callback(xs), 1),
        "q_batched128": (batched(128), 1),
        "q_batched1024": (batched(1024), 1)}, rounds)
  results = {k: summary([t / steps for t in v]) for k, v in samples.items()}
  results["q_setup"] = {"steps": steps}
  return results, {
      "q_print/python": ratio(samples, "q_print", "q_python_print"),
      "q_log/python": ratio(samples, "q_log", "q_python_log"),
      "q_same_text": same_text,
      "q_callback/python": ratio(samples, "q_callback", "q_python_print"),
      "q_batched128/python": ratio(samples, "q_batched128",
                                   "q_python_print"),
      "q_batched1024/python": ratio(samples, "q_batched1024",
                                    "q_python_print"),
  }
