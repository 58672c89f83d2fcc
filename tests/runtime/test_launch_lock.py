"""Launches over several CPU devices one at a time, and the bounded wait for
a computation that runs user code (``_runtime/launch_lock``;
``design/errors.md``, "Several threads launching computations over several
CPU devices" and "No unbounded wait").

Observed without timing: the launch lock is replaced by one that counts
the launches it serialized, and a computation kept running is one whose
input a test holds back (``helpers.NotReadyYet``).
"""
import threading

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import pytest

import helpers
import jax_effects as je
from jax_effects._runtime import launch_lock


class CountingLock:
  """A lock that counts how often it was taken."""

  def __init__(self):
    self._lock = threading.Lock()
    self.taken = 0

  def __enter__(self):
    self._lock.acquire()
    self.taken += 1
    return self

  def __exit__(self, *exc):
    self._lock.release()


@pytest.fixture
def counting_lock(monkeypatch):
  lock = CountingLock()
  monkeypatch.setattr(launch_lock, "launch_lock", lock)
  return lock


def test_each_launch_over_several_cpu_devices_takes_the_launch_lock(
    mesh, counting_lock, effects_capture):
  # A first launch is not serialized (its devices are not known before it:
  # test_launch_deadlock.py), every later one is, through the general path
  # and the fast hook alike; a function on one device never takes it.
  # Mutation this catches: no launch serialized (serialize_launch always
  # False): the counts stay 0.
  @je.jit
  def over_8(x):
    def body(b):
      je.print("block {}", b)
      return b + 1
    return jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                         out_specs=P("i"))(x)

  @je.jit
  def on_one(x):
    je.print("one {}", x)
    return x + 1

  x = helpers.sharded(mesh, jnp.arange(8, dtype=jnp.int32))
  taken = []
  for _ in range(4):
    x = over_8(x)
    taken.append(counting_lock.taken)
  y = jnp.int32(0)
  for _ in range(4):
    y = on_one(y)
    taken.append(counting_lock.taken)
  je.effects_barrier()
  assert taken == [0, 1, 2, 3, 3, 3, 3, 3]
  # (every launch ran: a line per device and call, each device's prefixed)
  lines = [line.split("] ")[-1] for line in effects_capture.printed]
  assert sorted(lines) == sorted(
      [f"block [{v + k}]" for k in range(4) for v in range(8)]
      + [f"one {v}" for v in range(4)])


def test_finish_says_a_computation_running_past_the_wait_has_not_ended(
    devices, monkeypatch):
  # finish's answer lets the fast hook hand the token on unchecked
  # (TokenStore.verified): a computation still running when the wait ends
  # has not ended, whatever the wait's length. Mutation this catches:
  # finish answering True at its deadline.
  monkeypatch.setattr(launch_lock, "FINISH_WAIT_S", 0.05)
  with helpers.NotReadyYet(devices[:2]) as held:
    running = launch_lock.finish(held.array, outside_callback=True)
    held.release()
    held.array.block_until_ready()
    ended = launch_lock.finish(held.array, outside_callback=True)
  assert (running, ended) == (False, True)
