"""A call made from inside a host callback keeps its place (issue 31, case 6).

The contract (C7): a ``jax_effects.jit`` call that a host callback makes
(the *inner* call, inside the *outer* call's execution) has its effects
before those of any call its thread makes after the outer call returns,
however the inner call runs (inline, or asynchronously over several
devices). Its place relative to the outer call's own later effects is not
fixed: the callback returns once the inner call is dispatched.
"""
import time

import jax.numpy as jnp
import pytest

import jax_effects as je

from helpers import per_device_stage, sharded

ROUNDS = 3   # the first call compiles; the later ones take the fast path


@pytest.mark.parametrize("inner_runs", ["asynchronously", "inline"])
def test_a_call_made_in_a_callback_keeps_its_place(mesh, effects_capture,
                                                   inner_runs):
  # Before the fix (asynchronous inner call, every round):
  #   outer before / outer after / later / inner
  # the outer call stored its returned token over the inner call's, so
  # `later` did not wait for `inner`.
  def slow(block):
    time.sleep(0.3)   # (one device slow: the inner call's print waits)
    return block

  stage = per_device_stage(mesh, slow)

  if inner_runs == "asynchronously":   # over 8 devices: launched, not run
    @je.jit
    def inner(x, r):
      je.print("inner {} {}", r, stage(x).sum())
      return x
    x = sharded(mesh, jnp.arange(8, dtype=jnp.int32))
  else:                                # one device, ready: runs inline
    @je.jit
    def inner(x, r):
      je.print("inner {} {}", r, x)
      return x
    x = jnp.int32(28)

  def call_inner(r):
    inner(x, r)

  @je.jit
  def outer(r):
    je.print("outer before {}", r)
    je.callback(call_inner, None, r)
    je.print("outer after {}", r)
    return r

  @je.jit
  def later(r):
    je.print("later {}", r)
    return r

  for r in range(ROUNDS):
    outer(jnp.int32(r))
    later(jnp.int32(r))
  je.effects_barrier()
  lines = effects_capture.printed
  assert sorted(lines) == sorted(
      line for r in range(ROUNDS) for line in
      (f"outer before {r}", f"inner {r} 28", f"outer after {r}",
       f"later {r}")), lines
  at = {line: i for i, line in enumerate(lines)}
  for r in range(ROUNDS):
    # the inner call's effects before the thread's next call's
    assert at[f"inner {r} 28"] < at[f"later {r}"], (
        f"round {r}: `later` ran before the inner call's effects: {lines}")
    # and the outer call's in their program order, the rounds in turn
    assert (at[f"outer before {r}"] < at[f"inner {r} 28"]
            and at[f"outer before {r}"] < at[f"outer after {r}"]
            < at[f"later {r}"]), lines
    assert r == 0 or at[f"later {r - 1}"] < at[f"outer before {r}"], lines
