"""Launches over several CPU devices, one at a time; waits for user code.

XLA's CPU client (jaxlib 0.8 to 0.10) deadlocks when executables that span
several devices are launched from several threads at once, so dispatches
of such a computation take :data:`launch_lock` around the launch (not
inside a host callback: the holder may be waiting for the callback's own
computation). ``design/errors.md``, "Several threads launching
computations over several CPU devices".

The same client bounds the computations in flight per device, so a launch
inside a host callback (JAX issue 25861) can wait for a place held by
computations that wait for the one running the callback: a computation that
runs user code on the host is waited for by its call, at most
:data:`FINISH_WAIT_S` (:func:`finish`; waiting for the previous call's
instead deadlocked). ``design/errors.md``, "No unbounded wait".
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
  global launch_lock
  launch_lock = threading.Lock()


class LaunchSite:
  """What a dispatch site last launched: ``serialize`` is None before its
  first launch (not serialized), then whether its last computation spanned
  several CPU devices, whose token sharding is ``sharding``. ``finish``:
  :func:`finish` once its program is known to run user code, else None."""
  __slots__ = ("serialize", "sharding", "finish")

  def __init__(self):
    self.serialize: bool | None = None
    self.sharding: Any = None
    self.finish = None


def launched(site: LaunchSite, sharding) -> None:
  """Records the token sharding of the computation ``site`` just launched."""
  if sharding is not site.sharding:
    site.sharding = sharding
    devices = sharding.device_set
    site.serialize = len(devices) > 1 and next(iter(devices)).platform == "cpu"


def serialize_launch(site: LaunchSite, outside_callback: bool = False) -> bool:
  """Whether ``site``'s next launch takes ``launch_lock``: not from inside
  a host callback, which ``outside_callback`` (a thread Python started, not
  inside a call of its own: ``design/errors.md``) rules out without
  looking at the stack."""
  return site.serialize is True and (outside_callback
                                     or _placement.current() is None)


#: How long (seconds) a call waits for its computation that runs the user's
#: own function on the host (:func:`finish`) before it returns anyway.
FINISH_WAIT_S = 1.0


def finish(token, outside_callback: bool = False) -> bool:
  """Waits until the computation that returned ``token`` has ended, at most
  :data:`FINISH_WAIT_S`: True if it ended without failing; False if it
  failed, still runs, or this is a host callback (which never waits;
  ``outside_callback`` rules it out as in :func:`serialize_launch`)."""
  try:
    if token.is_ready():
      token.block_until_ready()
      return True
    if not outside_callback and _placement.current() is not None:
      return False
    start = time.monotonic()
    deadline = start + FINISH_WAIT_S
    # The pause is a tenth of the time waited so far: a computation is
    # noticed within ~10% of its length (a doubling one overshot by 2x).
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
  """``site``'s program runs user code: its calls wait (:func:`finish`)."""
  site.finish = finish
