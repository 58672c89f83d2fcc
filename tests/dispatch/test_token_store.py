"""The fast hook stores each call's returned token, once (``design/tokens.md``).

A function's warm calls take its fast hook (``call_path.fast_dispatch``),
which stores the token its computation returned with
``TokenStore.store``: for a scalar token, and for one kept on the
function's devices (a ``shard_map`` program, or effects run once over
several devices). After every call the thread's runtime token must be the
one that call returned, the host's sequence number of the chain
(``ThreadTokens.seqs``, the execution's identity: ``token_value``) must be
what the devices computed into it, one more per call, and nothing may be
kept per call (the calls' tokens go once the next call replaced them).
"""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import helpers
import jax_effects as je
from jax_effects._core import effects as _effects
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import token_store as _token_store
from jax_effects._runtime import token_value as _token_value

KINDS = ["scalar", "per-device", "once-over-devices"]


def _program(kind: str, devices, seen: list):
  """A ``jax_effects.jit`` function of ``kind``'s token with one ordered
  callback that appends its value to ``seen``, and its argument."""
  def note(v):
    seen.append(int(np.asarray(v).reshape(-1)[0]))

  if kind == "scalar":
    @je.jit
    def f(x):
      je.callback(note, None, x)
      return x + 1
    return f, jnp.int32(0), lambda x: x + 1
  mesh = Mesh(np.array(devices[:4]), ("i",))
  sharded = NamedSharding(mesh, P("i"))
  x = jax.device_put(np.zeros((4,), np.int32), sharded)
  if kind == "per-device":
    @je.jit
    def g(x):
      def body(b):
        je.callback(note, None, b)
        return b + 1
      return jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                           out_specs=P("i"))(x)
  else:   # (automatic partitioning: the callback runs once)
    @je.jit
    def g(x):
      je.callback(note, None, x[0])
      return x + 1
  return g, x, lambda x: x + 1


def _device_seqs(token) -> set:
  """The sequence numbers the devices hold in ``token`` (one per device
  for a per-device token; a scalar's first copy, the chain's)."""
  if token.ndim:
    values = np.asarray(token).reshape(-1).tolist()
  else:
    values = [int(np.asarray(token.addressable_shards[0].data))]
  return {_token_value.seq_of(int(v)) for v in values}


@pytest.mark.parametrize("kind", KINDS)
def test_each_warm_call_stores_its_token_and_advances_the_sequence(
    kind, devices):
  # Mutations this catches: the hook not storing the returned token (the
  # thread's token stays the first one, its devices' number behind), and
  # not advancing the host's sequence number (after n calls the devices
  # say execution n, the host an earlier one).
  seen = []
  f, x, step = _program(kind, devices, seen)

  def run():
    y = x
    for _ in range(3):   # (the first calls trace; then the hook)
      y = f(y)
    je.effects_barrier()
    state = _threads.thread_state()
    if kind != "scalar":
      assert state.fast_mode == _token_store.devices_mode(state.mode)
    assert f._core.state == "fast"
    history = []
    for _ in range(6):
      before = state.runtime[_effects.DEFAULT]
      y = f(y)
      token = state.runtime[_effects.DEFAULT]
      assert token is not before   # (stored: the call's own token)
      token.block_until_ready()
      history.append((state.seqs[_effects.DEFAULT], _device_seqs(token)))
    je.effects_barrier()
    return history, np.asarray(y).reshape(-1)[0]

  history, last = helpers.in_thread(run)
  first = history[0][0]
  for n, (host, on_devices) in enumerate(history):
    assert on_devices == {host}, (n, host, on_devices)
    assert host == (first + n) & _token_value.SEQ_MASK, history
  assert int(last) == 9
  per_call = 4 if kind == "per-device" else 1   # (one callback per device)
  assert sorted(seen[-6 * per_call:]) == sorted(list(range(3, 9)) * per_call)


@pytest.mark.parametrize("kind", KINDS)
def test_warm_calls_keep_no_token_per_call(kind, devices):
  # A hook that kept a reference to each call's token (a leak) grows the
  # live arrays by one per call; the calls' outputs are dropped, so only
  # the thread's latest tokens stay.
  seen = []
  f, x, _ = _program(kind, devices, seen)

  def live_after(n: int) -> int:
    for _ in range(n):
      f(x)
    je.effects_barrier()
    gc.collect()
    return len(jax.live_arrays())

  def run():
    live_after(10)   # (traced, the hook installed, the state settled)
    assert f._core.state == "fast"
    first = live_after(10)
    return first, live_after(300)

  first, later = helpers.in_thread(run)
  assert later - first < 10, (first, later)
  assert len(seen) == 320 * (4 if kind == "per-device" else 1)
