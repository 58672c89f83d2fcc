"""Ctrl-C in a compiled loop raises ``KeyboardInterrupt`` (issue 31, case 10).

The contract (C10, and the README's promise): SIGINT while a call runs a
compiled loop with per-step effects (``print``, ``callback``, an adopted
``jax.debug.callback``, a bar updated every step or counted on the device
with ``every=100``/``1000``) raises ``KeyboardInterrupt`` from that call
(never XLA's ``CpuCallback error ... KeyboardInterrupt``, so ``except
KeyboardInterrupt: save_checkpoint()`` runs), reported once; open bars
close; the runtime keeps working (the next call runs and prints).

The signal comes from a timer thread once the loop is known to run (its
first effect was seen), in a fresh process (``helpers.run_scenario``); the
loop has 2**31 - 1 steps, so a call that is not interrupted runs until the
scenario's time limit (a hang, named).
"""
import io
import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jax_effects as je

import helpers
from helpers import run_scenario

STEPS = 2**31 - 1


class _Seen(io.StringIO):
  """A stream that notes that something was written to it."""

  def __init__(self, seen: threading.Event):
    super().__init__()
    self.seen = seen

  def write(self, text):
    # (the Event's lock only at the first write, before the SIGINT is sent:
    # a SIGINT landing inside a later set() left its lock held, and the
    # bar's close, writing here after the interrupt, waited for it forever)
    if not self.seen.is_set():
      self.seen.set()
    return super().write(text)


def scenario_interrupt_a_compiled_loop(kind: str) -> dict:
  started = threading.Event()
  sink = _Seen(started)

  def step(i):
    started.set()

  @je.jit
  def f(x, n):
    def body(i, c):
      if kind == "print":
        je.print("step {}", i)
      elif kind == "callback":
        je.callback(step, None, i)
      elif kind == "jax.debug.callback":
        jax.debug.callback(step, i)
      else:
        bar.update()
      return c + 1
    if kind.startswith("progress"):
      every = int(kind.split("=")[1])
      with je.progress(n, file=sink, every=every, mininterval=0) as bar:
        return lax.fori_loop(0, n, body, x)
    return lax.fori_loop(0, n, body, x)

  @je.jit
  def after(x):
    je.print("after {}", x)
    return x + 1

  real_stdout = sys.stdout
  sys.stdout = _Seen(started) if kind == "print" else sys.stdout
  jax.block_until_ready(f(jnp.int32(0), 3))    # compiled
  after(jnp.int32(0))
  je.effects_barrier()
  started.clear()

  def interrupt():
    if started.wait(30):
      os.kill(os.getpid(), signal.SIGINT)

  timer = threading.Thread(target=interrupt, daemon=True)
  timer.start()
  try:
    jax.block_until_ready(f(jnp.int32(0), STEPS))
    outcome = "returned"
  except KeyboardInterrupt:
    outcome = "KeyboardInterrupt"
  except BaseException as exc:  # noqa: BLE001 - the observation
    outcome = f"{type(exc).__name__}: {str(exc)[:200]}"
  timer.join(30)
  sys.stdout = real_stdout
  try:
    je.effects_barrier()
    barrier = None
  except BaseException as exc:  # noqa: BLE001 - the observation
    barrier = f"{type(exc).__name__}: {str(exc)[:200]}"
  rec = helpers.FlakyStream(sys.stdout)
  sys.stdout = rec
  try:
    next_call = int(after(jnp.int32(41)))
    je.effects_barrier()
  except BaseException as exc:  # noqa: BLE001 - the observation
    next_call = f"{type(exc).__name__}: {str(exc)[:200]}"
  sys.stdout = rec.target
  return dict(outcome=outcome, barrier=barrier, next_call=next_call,
              after_lines=[t[:-1] for t in rec.written],
              left=helpers.leftovers(helpers.runtime_inventory()))


@pytest.mark.parametrize("kind", [
    "print", "callback", "jax.debug.callback", "progress every=1",
    "progress every=100", "progress every=1000"])
def test_ctrl_c_in_a_compiled_loop_raises_keyboard_interrupt(kind):
  # Before the fix, every kind: "JaxRuntimeError: INTERNAL: CpuCallback
  # error calling callback: ... KeyboardInterrupt" from the call.
  got = run_scenario(__file__, "scenario_interrupt_a_compiled_loop", kind,
                     bound=90)
  r = got.result
  assert r["outcome"] == "KeyboardInterrupt", r["outcome"]
  assert r["barrier"] is None, r["barrier"]     # reported once
  assert r["next_call"] == 42 and r["after_lines"] == ["after 41"], r
  assert r["left"] == {}, r["left"]             # bars closed
  assert got.returncode == 0, got.stderr[-3000:]
  assert "jax_effects:" not in got.stderr, got.stderr[-3000:]
