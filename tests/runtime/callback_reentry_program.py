"""JAX's regression program for JAX issue 25861 under ``jax_effects.jit``
(``tests/runtime/test_callback_reentry.py`` runs it in a fresh process).

A ``while_loop`` whose host callback uses JAX on its operands (``i ==
maxiter``: a ``jnp`` operation dispatched from the callback), called on
``N`` inputs by the main thread and summed there, as JAX's
``debugging_primitives_test.test_async_deadlock``. ``argv[1]``: which
callback (``debug``: ``jax.debug.callback``; ``io``:
``jax.experimental.io_callback`` returning a value; ``ours``:
``jax_effects.callback``). Prints ``done <sum> <calls>`` when it finishes.
"""
import functools
import sys

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np

import jax_effects as je

KIND = sys.argv[1]
N, MAXITER = 40, 200
calls = []


def uses_jax(i, maxiter):
  calls.append(1)
  return jnp.asarray(i) == maxiter   # a computation launched from the callback


@je.jit
def run(pos):
  def cond(v):
    return v[0] < MAXITER

  def step(v):
    i, pos = v
    if KIND == "debug":
      jax.debug.callback(uses_jax, i + 1, MAXITER)
    elif KIND == "io":
      flag = io_callback(lambda i: np.asarray(uses_jax(i, MAXITER)),
                         jax.ShapeDtypeStruct((), jnp.bool_), i + 1,
                         ordered=True)
      pos = pos + flag.astype(pos.dtype) * 0
    else:
      je.callback(lambda i: (uses_jax(i, MAXITER), None)[1], None, i + 1)
    return i + 1, pos + 1

  return jax.lax.while_loop(cond, step, (jnp.array(0), pos))[1]


inputs = 10 * jax.random.normal(jax.random.key(42), shape=(N, 128, 128))
outs = tuple(run(x) for x in inputs)
mean = (1.0 / len(outs)) * functools.reduce(lambda a, b: a + b, outs)
jax.block_until_ready(mean)
je.effects_barrier()
print("done", round(float(mean.sum())), len(calls))   # (float32 sums
#   differ in the last digit between JAX lines)
