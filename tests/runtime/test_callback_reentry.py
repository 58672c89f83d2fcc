"""Callbacks that re-enter JAX or block never make a program wait without
end (issue 37, "Nothing waits without end"; ``design/errors.md``, "No
unbounded wait"; ``_runtime/launch_lock.finish``).

XLA's CPU client bounds the computations in flight on each device; a host
callback that launches a JAX computation (``jnp`` on its operands) waits
for a place, which computations waiting for the one running the callback
held: JAX's regression program for JAX issue 25861 hung every time under
``jax_effects.jit`` (every kind of callback). Each program
runs in a fresh process, bounded: a hang fails the test.
"""
import os
import subprocess

import pytest

from helpers import run_python, run_script

PROGRAM = os.path.join(os.path.dirname(__file__),
                       "callback_reentry_program.py")
TIMEOUT_S = 120


@pytest.mark.parametrize("kind", ["debug", "io", "ours"])
def test_jax_issue_25861_program_finishes(kind):
  try:
    proc = run_python(PROGRAM, kind, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pytest.fail(f"the issue-25861 program ({kind} callback) did not finish "
                f"in {TIMEOUT_S} s: a deadlock")
  assert proc.returncode == 0, proc.stderr
  # 40 inputs x 200 loop steps, each callback ran (and used JAX) once
  assert proc.stdout.split() == ["done", "3276794", "8000"], proc.stdout


def test_block_until_ready_and_jnp_inside_a_callback_work():
  """A callback that computes with JAX and waits for its own result, in
  computations dispatched far ahead of their inputs (asynchronously)."""
  proc = run_script("""
      import jax, jax.numpy as jnp
      import jax_effects as je
      seen = []

      def host(v):
        seen.append(float(jax.block_until_ready(jnp.sum(jnp.asarray(v)))))

      @je.jit
      def f(x):
        y = x @ x
        je.callback(host, None, y[0])
        return y

      x = jnp.eye(256)
      outs = [f(x * i) for i in range(60)]
      jax.block_until_ready(outs)
      je.effects_barrier()
      print(seen == [float(i * i) for i in range(60)])
  """, timeout=TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split() == ["True"]
