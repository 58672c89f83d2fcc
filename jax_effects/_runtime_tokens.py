"""Runtime tokens and output tokens: ordering across dispatches.

Compiler tokens order side effects *inside* one computation. Between
computations, the order is carried by **runtime tokens**: tiny arrays (a
``uint8`` scalar) that every token-threaded executable takes as inputs, one per
ordered :class:`~jax_effects.Effect` it uses, and returns as outputs. Because
an executable starts only when all its inputs are ready ("strict execution"),
passing the token returned by the previous computation makes the next one wait
for it.

* Runtime tokens are **thread-local and per effect** (:class:`ThreadTokens`):
  each Python thread has its own streams, so threads never wait for each other.
* A runtime token is kept *uncommitted*: ``jax.jit``'s C++ dispatch copies it to
  the devices of the next computation when (and only when) they differ, and it
  never pins a computation to a device.
* Every executable also returns an **output token**, kept per device set (the
  latest per device is what :meth:`ThreadTokens.devices` shows).
  :func:`effects_barrier` blocks on the output tokens and runtime tokens.

Under strict execution all outputs of an executable become ready together, so
a threaded executable returns one token array that serves as the new runtime
token of every ordered effect it takes and as the output token of its devices.

Errors raised by a user's callback are recorded here (:func:`record_error`)
and replace the opaque XLA error that reaches the caller (:func:`reraise`).
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import re
import threading
import types
import weakref
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat

TOKEN_DTYPE = np.uint8


class ThreadTokens:
  """The token state of one Python thread."""
  __slots__ = ("runtime", "output", "thread", "__weakref__")

  def __init__(self, thread: threading.Thread):
    # chain key (Effect) -> uncommitted single-device runtime token
    self.runtime: dict[Any, jax.Array] = {}
    # sharding -> latest output token on that device set (insertion = recency)
    self.output: dict[Any, jax.Array] = {}
    self.thread = weakref.ref(thread)

  def devices(self) -> dict[Any, jax.Array]:
    """Device -> the latest output token covering that device."""
    out = {}
    for sharding, token in list(self.output.items()):
      for device in sharding.device_set:
        out[device] = token
    return out

  def pending(self) -> list[jax.Array]:
    return [*self.output.values(), *self.runtime.values()]

  def alive(self) -> bool:
    thread = self.thread()
    return thread is not None and thread.is_alive()

  def reset(self) -> None:
    self.runtime.clear()
    self.output.clear()


_local = threading.local()
_all_lock = threading.Lock()
_all_states: list[ThreadTokens] = []


def thread_tokens() -> ThreadTokens:
  """This thread's token state (created and registered on first use)."""
  try:
    return _local.state
  except AttributeError:
    state = _local.state = ThreadTokens(threading.current_thread())
    with _all_lock:
      _all_states.append(state)
    return state


_initial = None


def initial_token() -> jax.Array:
  """The token of a stream that has had no effect yet (ready, uncommitted)."""
  global _initial
  if _initial is None:
    _initial = jnp.zeros((), TOKEN_DTYPE)
  return _initial


def update(state: ThreadTokens, keys, token: jax.Array) -> None:
  """Records ``token`` (returned by one executable) for ``keys`` and devices."""
  output = state.output
  sharding = token.sharding
  output.pop(sharding, None)
  output[sharding] = token
  if keys:
    runtime = _compat.uncommitted(token) if token.committed else token
    for key in keys:
      state.runtime[key] = runtime


@dataclasses.dataclass(frozen=True)
class RuntimeTokens:
  """Read-only snapshot of one thread's tokens (see :func:`runtime_tokens`)."""
  effects: Mapping[Any, jax.Array]
  devices: Mapping[Any, jax.Array]


def runtime_tokens() -> RuntimeTokens:
  """Snapshot for the calling thread.

  ``.effects`` maps each :class:`~jax_effects.Effect` (or ``GLOBAL`` in global
  mode) to its current runtime token; ``.devices`` maps each device to the
  latest output token returned by a computation that ran on it.
  """
  state = thread_tokens()
  return RuntimeTokens(types.MappingProxyType(dict(state.runtime)),
                       types.MappingProxyType(state.devices()))


# --- callback errors -----------------------------------------------------------

_error_ids = itertools.count(1)
_errors_lock = threading.Lock()
_errors: dict[int, BaseException] = {}
_MARK = "jax_effects callback error #"
_MARK_RE = re.compile(re.escape(_MARK) + r"(\d+)")


class CallbackFailed(Exception):
  """Raised into XLA in place of a user's exception; carries its id."""


def record_error(exc: BaseException) -> CallbackFailed:
  """Stores a user callback's exception; returns the marker to raise to XLA."""
  n = next(_error_ids)
  with _errors_lock:
    _errors[n] = exc
  return CallbackFailed(f"{_MARK}{n}: {type(exc).__name__}: {exc}")


def original_error(err: BaseException) -> BaseException | None:
  """The user exception behind an XLA error, removed so it is reported once."""
  ids = _MARK_RE.findall(str(err))
  if not ids:
    return None
  found = None
  with _errors_lock:
    for n in ids:   # one XLA error may mention several; report the first
      exc = _errors.pop(int(n), None)
      found = found or exc
  return found


def reraise(err: BaseException, state: ThreadTokens | None) -> None:
  """Raises the user's exception behind ``err`` (or ``err`` itself).

  The thread's tokens are reset: a failed computation's tokens carry its error
  and must not be handed to the next computation.
  """
  orig = original_error(err)
  if state is not None:
    state.reset()
  if orig is None:
    raise err
  raise orig.with_traceback(orig.__traceback__) from None


# --- barrier -------------------------------------------------------------------

def effects_barrier(all_threads: bool = False) -> None:
  """Blocks until every effect dispatched so far has completed.

  With ``all_threads=False`` waits for the effects dispatched by the calling
  thread; with ``all_threads=True`` for those of every thread (including
  threads that have exited). Re-raises a callback's exception that has not been
  reported yet, once.
  """
  if all_threads:
    with _all_lock:
      states = list(_all_states)
  else:
    states = [thread_tokens()]
  first_error = None
  for state in states:
    try:
      for token in state.pending():
        token.block_until_ready()
    except Exception as err:  # a failed computation: report it, reset tokens
      state.reset()
      first_error = first_error or err
  if all_threads:
    _forget_dead_threads()
  if first_error is not None:
    reraise(first_error, None)


def _forget_dead_threads() -> None:
  # Called right after waiting on every state: a dead thread's tokens are
  # complete and it can dispatch nothing new.
  with _all_lock:
    _all_states[:] = [s for s in _all_states if s.alive()]


@atexit.register
def _wait_at_exit() -> None:
  try:
    effects_barrier(all_threads=True)
  except Exception:  # nothing left to report to at interpreter exit
    pass
