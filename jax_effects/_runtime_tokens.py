"""Runtime tokens and output tokens: ordering across dispatches.

Compiler tokens order side effects *inside* one computation. Between
computations, the order is carried by **runtime tokens**: tiny arrays (an
``int32`` scalar holding the dispatching thread's slot) that every
token-threaded executable takes as inputs, one per ordered :class:`~jax_effects.Effect` it uses, and returns as outputs. Because
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

After a per-device (``shard_map``) program the token is a vector, one
element per device; it stays on its devices for the next call of the same
program and is combined (:func:`combine_per_device`) only for a computation
that runs elsewhere. A token's *value* is the dispatching thread's slot, so a
multi-device callback knows whom to report an error to (``_errors``).
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import threading
import types
import weakref
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jax_effects import _compat
from jax_effects import _errors
from jax_effects import _output
from jax_effects import _effects

# int32: a token's value is the slot of the thread that dispatched it (see
# ThreadTokens.slot); host callbacks pass it through unchanged.
TOKEN_DTYPE = np.int32
_slots = itertools.count(1)


class ThreadTokens:
  """The token state of one Python thread."""
  __slots__ = ("runtime", "output", "last_sharding", "per_device", "slot",
               "initial", "thread", "__weakref__")

  def __init__(self, thread: threading.Thread):
    # chain key (Effect) -> uncommitted single-device runtime token
    self.runtime: dict[Any, jax.Array] = {}
    # sharding -> latest output token on that device set (insertion = recency)
    self.output: dict[Any, jax.Array] = {}
    # the most recently inserted key of ``output`` (None: unknown)
    self.last_sharding: Any = None
    # True while some runtime token is a per-device vector (see update)
    self.per_device = False
    # This thread's number (>= 1), the value of every runtime token it
    # dispatches: the carriers of its computations hold it, so a host callback
    # knows which thread dispatched it (for errors that cannot fail the
    # computation, see defer_error). 0 stands for "unknown".
    self.slot = next(_slots)
    self.initial: jax.Array | None = None
    self.thread = weakref.ref(thread)

  def devices(self) -> dict[Any, jax.Array]:
    """Device -> the latest output token covering that device.

    Only this process's devices: in a multi-process program a computation's
    token also spans other processes' devices, whose shards (and effects)
    this process neither holds nor waits for.
    """
    out = {}
    for sharding, token in list(self.output.items()):
      for device in sharding.addressable_devices:
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
    self.last_sharding = None
    self.per_device = False


_local = threading.local()
_all_lock = threading.Lock()
_all_states: list[ThreadTokens] = []


def thread_state() -> ThreadTokens:
  """This thread's token state (created and registered on first use)."""
  try:
    return _local.state
  except AttributeError:
    state = _local.state = ThreadTokens(threading.current_thread())
    with _all_lock:
      _all_states.append(state)
    return state


def initial_token(state: ThreadTokens) -> jax.Array:
  """The token of a stream that has had no effect yet in ``state``'s thread.

  Ready, uncommitted, and holding the thread's slot.
  """
  token = state.initial
  if token is None:
    with _compat.no_user_mesh():   # not placed by the user's mesh
      token = state.initial = jnp.asarray(state.slot, TOKEN_DTYPE)
  return token


def update(state: ThreadTokens, keys, token: jax.Array) -> None:
  """Records ``token`` (returned by one executable) for ``keys`` and devices.

  Then raises an error a multi-device callback of this thread deferred
  (:func:`defer_error`), if any.
  """
  output = state.output
  sharding = token.sharding
  if state.last_sharding is sharding:  # already the most recent entry
    output[sharding] = token
  else:  # move to the end (recency)
    output.pop(sharding, None)
    output[sharding] = token
    state.last_sharding = sharding
  if keys:
    if token.ndim:
      # One element per device (a shard_map program): kept as it is, so the
      # next call of a program over the same devices continues each device's
      # chain from its own element, with no copy and no extra dispatch; it is
      # combined only for a computation that runs elsewhere (per_device_tokens)
      # or, in the deterministic view, right away (that releases the output).
      if _output.holding():
        runtime = combine_per_device(token)
      else:
        runtime = token
        state.per_device = True
    else:
      runtime = _compat.uncommitted(token) if _compat.committed(token) else token
    for key in keys:
      state.runtime[key] = runtime
  if _errors.deferred:   # a multi-device callback (of this thread?) failed
    _errors.raise_deferred(state.slot)


def tokens_for(state: ThreadTokens, keys, per_device_sharding) -> tuple:
  """The runtime tokens of ``keys`` to pass to the next computation.

  ``per_device_sharding``: sharding of the per-device token the callee
  returned last time (None: the callee takes scalar tokens only); see
  :func:`per_device_tokens`.
  """
  runtime = state.runtime
  initial = initial_token(state)
  if len(keys) == 1:  # the common case, without a comprehension's frame
    tokens = (runtime.get(keys[0], initial),)
  else:
    tokens = tuple([runtime.get(k, initial) for k in keys])
  if state.per_device:
    tokens = per_device_tokens(state, keys, tokens, per_device_sharding)
  return tokens


def per_device_tokens(state: ThreadTokens, keys, tokens: tuple,
                      sharding) -> tuple:
  """``tokens`` with each per-device token not on ``sharding`` combined.

  A per-device runtime token (one element per device of a shard_map program)
  can be handed as it is only to a computation over the same devices
  (``sharding``: that of the token the callee returned last time, or None).
  Any other computation gets the elements combined into one scalar token on
  the first device (:func:`combine_per_device`), which is stored back.
  """
  out = []
  for key, token in zip(keys, tokens):
    if token.ndim and (sharding is None or token.sharding != sharding):
      token = state.runtime[key] = combine_per_device(token)
    out.append(token)
  state.per_device = any(t.ndim for t in state.runtime.values())
  return tuple(out)


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

  While ``ordering("global")`` is active on this thread, ``.effects`` has
  exactly one entry, ``GLOBAL`` (the one stream of that mode; the initial
  token if no global-mode call has run yet): calls in that mode use no
  per-effect stream. In ``"per_effect"`` mode it lists every stream this
  thread has used (``GLOBAL`` too, after a global block).
  """
  state = thread_state()
  if _effects.get_ordering() == "global":
    token = state.runtime.get(_effects.GLOBAL)
    if token is None:
      token = initial_token(state)
    effects = {_effects.GLOBAL: token}
  else:
    effects = dict(state.runtime)
  return RuntimeTokens(types.MappingProxyType(effects),
                       types.MappingProxyType(state.devices()))


# --- combining per-device tokens ------------------------------------------------

def _release_and_pass(token):
  _output.release_held()
  return token


def _combine(*shards):
  return jnp.max(jnp.concatenate([s.reshape((-1,)) for s in shards]))


def _combine_and_release(*shards):
  # The callback's result is the token: the next dispatch's effects follow
  # the release.
  return io_callback(_release_and_pass,
                     jax.ShapeDtypeStruct((), TOKEN_DTYPE),
                     _combine(*shards))


_combine_jit = jax.jit(_combine)
_combine_release_jit = jax.jit(_combine_and_release)


def combine_per_device(token):
  """The next runtime token from a per-device token (one element per device).

  The elements are copied to the first device (plain copies, no collective)
  and reduced there; the result, uncommitted on that device, is ready only
  once every device's effects have run. In the deterministic view, the held
  per-device output is released at that point (a host callback).
  """
  shards = [s.data for s in token.addressable_shards]
  fn = _combine_release_jit if _output.holding() else _combine_jit
  # Our own computation, on the token's devices: never the user's mesh.
  with _compat.no_user_mesh():
    moved = jax.device_put(shards, shards[0].device)
    return _compat.uncommitted(fn(*moved))


# --- barrier -------------------------------------------------------------------

def wait_for_thread() -> None:
  """Blocks until this thread's dispatched effects have run (raises nothing:
  a failure is reported by the next call or barrier)."""
  for token in thread_state().pending():
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001 - reported by effects_barrier
      pass


def effects_barrier(all_threads: bool = False) -> None:
  """Blocks until every effect dispatched so far has completed.

  With ``all_threads=False`` waits for the effects dispatched by the calling
  thread; with ``all_threads=True`` for those of every thread (including
  threads that have exited). Re-raises a callback's exception that has not been
  reported yet, once (including an exception of a callback in a multi-device
  computation, which cannot fail that computation: it is raised by the
  dispatching call when it returns, or else here).
  """
  if all_threads:
    with _all_lock:
      states = list(_all_states)
    # Dead before the wait: dispatches nothing after it, so it can be dropped.
    dead = [s for s in states if not s.alive()]
  else:
    states = [thread_state()]
  first_error = None
  for state in states:
    try:
      for token in state.pending():
        token.block_until_ready()
    except Exception as err:  # a failed computation: report it, reset tokens
      state.reset()
      first_error = first_error or err
  try:   # effects under plain jax.jit use JAX's own tokens (this thread's)
    jax.effects_barrier()
  except Exception as err:
    _compat.clear_jax_runtime_tokens()   # JAX keeps failed ones: report once
    first_error = first_error or err
  if all_threads:
    _forget_dead_threads(dead)
  if first_error is not None:
    _errors.reraise(first_error, None)
  # multi-device callbacks' errors: this thread's and those of unknown origin
  # (every thread's with all_threads=True)
  deferred = _errors.pop_deferred(None if all_threads else (states[0].slot, 0))
  if deferred is not None:
    raise deferred.with_traceback(deferred.__traceback__)


def _forget_dead_threads(dead: list[ThreadTokens]) -> None:
  # Called right after waiting on every state: the tokens of a thread that was
  # already dead before the wait are complete and it can dispatch nothing new.
  # (A thread that dies during the wait may have dispatched after its tokens
  # were read; it is dropped by a later barrier.)
  dead_ids = {id(s) for s in dead}
  with _all_lock:
    _all_states[:] = [s for s in _all_states if id(s) not in dead_ids]


@atexit.register
def _wait_at_exit() -> None:
  try:
    effects_barrier(all_threads=True)
  except Exception:  # nothing left to report to at interpreter exit
    pass
