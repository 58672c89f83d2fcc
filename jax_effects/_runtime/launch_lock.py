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

The same client bounds the computations in flight on each device (a
semaphore every launch takes, released when the computation ends), so a
launch *inside* a host callback (the user's function dispatching a ``jnp``
operation: JAX issue 25861) waits for a place while the device's places are
held by computations that wait, through the thread's token chain or their
inputs, for the one running the callback: a deadlock, every time a thread
dispatches more than the limit ahead. So a computation that runs the user's
own function on the host (``HostCallback.user_code``) is waited for by the
call that launched it (:func:`finish`, ``LaunchSite.finish``): the thread
never has one in flight while it dispatches more, and the callback's own
launches find a place. (Waiting instead for the *previous* call's
computation, after this call's launch, kept a ``shard_map`` step
asynchronous, bench (g), but deadlocked the issue-25861 program in 3 of 6
runs: the client does not let the callback's launch pass the computation
queued behind it.) The wait is bounded (:data:`FINISH_WAIT_S`): a
callback that waits for what its caller does after the call returns (a
queue, an event) gets it then.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from jax_effects._runtime import fork as _fork
from jax_effects._runtime import placement as _placement

launch_lock = threading.Lock()


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child has none of the parent's launches in progress (``fork``)."""
  global launch_lock
  launch_lock = threading.Lock()


class LaunchSite:
  """What a dispatch site (a function in one mode, a compiled function) last
  launched: ``serialize`` is None before its first launch (not serialized:
  the devices are not known yet, and the first launch also traces and
  compiles, and may run its computation inline, whose callbacks may wait for
  other threads' calls), then whether its last computation spanned several
  CPU devices; ``sharding`` is that computation's token sharding.
  ``finish``: None, or :func:`finish` once the site's program is known to
  run the user's own function on the host (the call waits for it)."""
  __slots__ = ("serialize", "sharding", "finish")

  def __init__(self):
    self.serialize: bool | None = None
    self.sharding: Any = None
    self.finish = None


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




#: How long (seconds) a call waits for its computation that runs the user's
#: own function on the host (:func:`finish`) before it returns anyway.
FINISH_WAIT_S = 1.0


def finish(token) -> bool:
  """Waits until the computation that returned ``token`` has ended, at most
  :data:`FINISH_WAIT_S` (the module docstring): True if it ended without
  failing (the token is verified: ``TokenStore.verified``), False if it
  failed (the next call learns it), is still running, or if this is a host
  callback (which never waits here: the computation may be its own)."""
  try:
    if token.is_ready():
      token.block_until_ready()
      return True
    if _placement.current() is not None:
      return False
    start = time.monotonic()
    deadline = start + FINISH_WAIT_S
    # (the GIL is released while asleep: the callback runs.) The pause is a
    # tenth of the time waited so far: a computation is noticed within ~10%
    # of its length (a doubling pause overshot a step by up to 2x).
    while not token.is_ready():
      now = time.monotonic()
      if now >= deadline:
        return False
      time.sleep(min((now - start) * 0.1, 1e-3))
    token.block_until_ready()
  except Exception:  # noqa: BLE001 - a failed computation: the call's, later
    return False
  return True


def wait_for_user_code(site: LaunchSite) -> None:
  """``site``'s program runs the user's own function on the host: its calls
  wait for their computations (:func:`finish`)."""
  site.finish = finish
