"""``runtime_tokens()`` in global ordering mode: exactly one stream
(``design/transformations.md``, "Ordering modes"; ``design/tokens.md``,
"Between computations").

Runs in fresh threads: runtime tokens (and the ordering context) are
thread-local.
"""
import time

import jax
import numpy as np

import jax_effects as je
import helpers
from helpers import in_thread


def _two_effects():
  return helpers.two_effects("snapshot")


def test_global_block_snapshot_has_exactly_the_global_entry(effects_capture):
  f, a, b = _two_effects()

  def go():
    f(1)   # per-effect streams a and b now exist on this thread
    before = dict(je.runtime_tokens().effects)
    with je.ordering("global"):
      at_entry = dict(je.runtime_tokens().effects)
      f(2)
      after_call = dict(je.runtime_tokens().effects)
    outside = dict(je.runtime_tokens().effects)
    return before, at_entry, after_call, outside

  before, at_entry, after_call, outside = in_thread(go)
  assert set(before) == {a, b}
  assert list(at_entry) == [je.GLOBAL]
  assert list(after_call) == [je.GLOBAL]
  # the global stream's token is the one the global-mode call returned
  assert at_entry[je.GLOBAL] is not after_call[je.GLOBAL]
  assert after_call[je.GLOBAL] is outside[je.GLOBAL]
  # back in per-effect mode every stream used is listed again
  assert set(outside) == {a, b, je.GLOBAL}
  assert effects_capture.printed == ["a1", "b1", "a2", "b2"]


def test_global_snapshot_token_orders_the_next_call():
  # The listed token is the thread's real global stream: waiting on it waits
  # for every effect dispatched in the block (dispatched on an input that is
  # not ready yet, so none of them ran when the token is read).
  ran = []

  def slow(v):
    time.sleep(0.1)
    ran.append(int(v[0]))

  @je.jit
  def f(x):
    je.callback(slow, None, x, effect=je.Effect("snapshot-c"))
    return x

  def go():
    # (the gate inside the block: entering it waits for dispatched effects)
    with je.ordering("global"), helpers.NotReadyYet(jax.devices()[:2]) as gate:
      for i in range(3):
        f(gate.array + i)
      (token,) = je.runtime_tokens().effects.values()
      assert ran == []           # dispatched; nothing ran yet
      gate.release()
      token.block_until_ready()
      return list(ran)

  assert in_thread(go) == [0, 1, 2]
  np.testing.assert_array_equal(ran, [0, 1, 2])


