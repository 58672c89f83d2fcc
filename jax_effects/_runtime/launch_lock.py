"""Launches over several CPU devices, one at a time.

XLA's CPU client (jaxlib 0.8 to 0.10) deadlocks when executables that span
several devices are launched from several threads at once: the launch of
each device's part runs on the client's small thread pool and blocks there
while that device has its maximum of computations in flight, and the
computations that would free a place wait for a thread of the same pool.
Plain JAX hangs the same way (8 threads calling a jitted shard_map over 8 CPU
devices; no callback needed). One such launch at a time never did: threaded
dispatches of a computation that spans several CPU devices take
:data:`launch_lock` around the launch (waiting for it releases the GIL).
Not inside a host callback (the lock holder may be waiting for the
callback's own computation). See ``design/errors.md``.
"""
from __future__ import annotations

import threading
from typing import Any

from jax_effects._runtime import placement as _placement

launch_lock = threading.Lock()


class LaunchSite:
  """What a dispatch site (a function in one mode, a compiled function) last
  launched: ``serialize`` is None before its first launch (not serialized:
  the devices are not known yet, and the first launch also traces and
  compiles, and may run its computation inline, whose callbacks may wait for
  other threads' calls), then whether its last computation spanned several
  CPU devices; ``sharding`` is that computation's token sharding."""
  __slots__ = ("serialize", "sharding")

  def __init__(self):
    self.serialize: bool | None = None
    self.sharding: Any = None


def spans_cpu_devices(sharding) -> bool:
  devices = sharding.device_set
  return len(devices) > 1 and next(iter(devices)).platform == "cpu"


def launched(site: LaunchSite, sharding) -> None:
  """Records the device set of the computation ``site`` just launched (the
  sharding of its token)."""
  if sharding is not site.sharding:
    site.sharding = sharding
    site.serialize = spans_cpu_devices(sharding)


def serialize_launch(site: LaunchSite) -> bool:
  """Whether ``site``'s next launch takes ``launch_lock``: not inside a host
  callback (a computation's callback may dispatch a computation: the lock
  holder can be waiting for the callback's own computation)."""
  return site.serialize is True and _placement.current() is None


