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

Errors raised by a user's callback are recorded here (:func:`record_error`)
and replace the opaque XLA error that reaches the caller (:func:`reraise`), or
are deferred to the dispatching thread's next call or barrier
(:func:`defer_error`; the ``FAILED`` carrier bit and :data:`SLOT_MASK` are part
of the token convention). A thread's state is released when the thread exits;
interpreter exit waits for every thread and reports what is left. The
contract: ``design/errors.md``.
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
from jax_effects import _effects

# int32: a token's value is the slot of the thread that dispatched it (see
# ThreadTokens.slot); host callbacks pass it through unchanged.
TOKEN_DTYPE = np.int32
_slots = itertools.count(1)


class ThreadTokens:
  """The token state of one Python thread."""
  __slots__ = ("runtime", "output", "last_sharding", "per_device", "slot",
               "initial", "thread", "mode", "own_errors", "__weakref__")

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
    # The ordering mode of this thread's last dispatch (see switch_mode).
    self.mode: str | None = None
    # Errors of callbacks that ran inline on this thread, during the dispatch
    # in progress: that call raises them when it returns (see defer_error).
    self.own_errors: list[BaseException] = []
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
# Reentrant: a thread-exit finalizer (_thread_exited) may run from garbage
# collection in a thread that holds it.
_all_lock = threading.RLock()
# every live thread's state (weakly: a thread's state goes with the thread)
_all_states: "weakref.WeakSet[ThreadTokens]" = weakref.WeakSet()


def thread_tokens() -> ThreadTokens:
  """This thread's token state (created and registered on first use)."""
  try:
    return _local.state
  except AttributeError:
    state = _local.state = ThreadTokens(threading.current_thread())
    _register(state)
    return state


def initial_token(state: ThreadTokens) -> jax.Array:
  """The token of a stream that has had no effect yet in ``state``'s thread.

  Ready, uncommitted, and holding the thread's slot.
  """
  token = state.initial
  if token is None:
    token = state.initial = jnp.asarray(state.slot, TOKEN_DTYPE)
  return token


def update(state: ThreadTokens, keys, token: jax.Array) -> None:
  """Records ``token`` (returned by one executable) for ``keys`` and devices.

  Raises nothing: an error a callback deferred is raised by the thread's next
  call before it dispatches, or its barrier (the result of this call is
  returned either way).
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
      from jax_effects import _placement
      if _placement.is_deterministic():
        runtime = _placement.combine_per_device(token)
      else:
        runtime = token
        state.per_device = True
    else:
      runtime = _compat.uncommitted(token) if _compat.committed(token) else token
    for key in keys:
      if key is not _effects.UNORDERED:
        state.runtime[key] = runtime


def switch_mode(state: ThreadTokens, mode: str) -> None:
  """Called before a dispatch in a mode other than the thread's last one.

  The two modes use different runtime-token streams, so nothing would order
  this dispatch after the thread's earlier ones, which may still be in flight
  (a ``set_ordering`` from another thread lands between any two calls): wait
  for them first. Switches are rare; the common path is one comparison.
  """
  if state.mode is not None:
    _wait_quietly(state)
  state.mode = mode


def store_interrupted(state: ThreadTokens, keys, token) -> None:
  """Stores a dispatched computation's token when an interrupt
  (``KeyboardInterrupt`` from SIGINT, or another ``BaseException``) landed
  between the dispatch and :func:`update`: the computation runs anyway, so
  the thread's next dispatch and its barrier must still follow it. Storing
  the same token twice is harmless; if storing fails, the token is waited for.
  """
  try:
    update(state, keys, token)
  except BaseException:  # noqa: BLE001 - a second interrupt: wait instead
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001
      pass


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
  the first device (``_placement.combine_per_device``), which is stored back.
  """
  from jax_effects import _placement
  out = []
  for key, token in zip(keys, tokens):
    if token.ndim and (sharding is None or token.sharding != sharding):
      token = state.runtime[key] = _placement.combine_per_device(token)
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
  """
  state = thread_tokens()
  return RuntimeTokens(types.MappingProxyType(dict(state.runtime)),
                       types.MappingProxyType(state.devices()))


# --- callback errors -----------------------------------------------------------
# The contract is design/errors.md. Two paths:
#
# * A single-device jax_effects.jit computation fails: the host function
#   records the user's exception (record_error) and raises a marker into XLA;
#   the dispatch hook catches XLA's error and raises the original (reraise).
# * Every other compiled computation (multi-device, or plain jax.jit) cannot be
#   failed safely: the host function files the exception for the dispatching
#   thread (defer_error, keyed by its slot) and returns zeros; the thread's next
#   jax_effects call raises it before dispatching anything, or its barrier.

#: Carrier bit: an earlier effect of this chain in this execution failed, so the
#: later ones are skipped (set by the host function that failed; masked off
#: before the computation returns its token, see _thread_tokens).
FAILED = np.int32(1 << 30)
SLOT_MASK = np.int32((1 << 30) - 1)
#: At most this many deferred errors are kept per thread between two reports;
#: later ones are counted, and the count is reported with them.
MAX_KEPT_ERRORS = 64

_error_ids = itertools.count(1)
_errors_lock = threading.Lock()
_errors: dict[int, BaseException] = {}
_MARK = "jax_effects callback error #"
_MARK_RE = re.compile(re.escape(_MARK) + r"(\d+)")


class CallbackFailed(Exception):
  """Raised into XLA in place of a user's exception; carries its id."""

  def __init__(self, message: str, error_id: int):
    super().__init__(message)
    self.error_id = error_id


def describe(exc: BaseException) -> str:
  """``"Type: message"`` for ``exc``, even when its ``__str__`` raises."""
  try:
    name = type(exc).__qualname__
  except BaseException:  # noqa: BLE001 - a hostile metaclass
    name = "<exception>"
  try:
    text = str(exc)
  except BaseException:  # noqa: BLE001 - a user's __str__ that raises
    text = "<str() of the exception raised>"
  return f"{name}: {text}" if text else name


def record_error(exc: BaseException) -> CallbackFailed:
  """Stores a user callback's exception; returns the marker to raise to XLA."""
  n = next(_error_ids)
  with _errors_lock:
    _errors[n] = exc
  return CallbackFailed(f"{_MARK}{n}: {describe(exc)}", n)


def user_error(exc: BaseException) -> BaseException:
  """The user's exception behind ``exc`` (a :class:`CallbackFailed` marker
  whose record is removed here), or ``exc`` itself."""
  if isinstance(exc, CallbackFailed):
    with _errors_lock:
      orig = _errors.pop(exc.error_id, None)
    if orig is not None:
      return orig
  return exc


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


# Deferred errors: slot of the dispatching thread -> its unreported errors,
# oldest first (at most MAX_KEPT_ERRORS; _dropped counts the others). Slot 0:
# the dispatching thread is unknown (a callback under plain jax.jit that ran on
# one of XLA's threads).
_deferred: dict[int, list[BaseException]] = {}
_dropped: dict[int, int] = {}


def defer_error(exc: BaseException, slot: int = 0, inline: bool = False) -> None:
  """Keeps ``exc`` (a user's exception) for thread ``slot`` to raise.

  ``inline``: the callback may be running on the dispatching thread itself,
  inside its jax_effects call (the CPU client runs a computation inline when
  its inputs are ready): then that call raises it when it returns
  (:func:`raise_own`), as a failing Python call would.
  """
  if inline:
    state = getattr(_local, "state", None)
    if state is not None and state.slot == slot:
      state.own_errors.append(exc)
      return
  with _errors_lock:
    kept = _deferred.setdefault(slot, [])
    if len(kept) < MAX_KEPT_ERRORS:
      kept.append(exc)
    else:
      _dropped[slot] = _dropped.get(slot, 0) + 1


def current_slot() -> int:
  """The slot of the calling thread (0 if it never used jax_effects)."""
  state = getattr(_local, "state", None)
  return 0 if state is None else state.slot


def has_deferred(slot: int) -> bool:
  return slot in _deferred


def pop_deferred(slots=None) -> BaseException | None:
  """Removes every deferred error of ``slots`` (all if None); returns the
  report: the one error itself, or all of them together (:func:`group`).
  Each error is reported once: a later call finds nothing.
  """
  if not _deferred:
    return None
  with _errors_lock:
    slots = list(_deferred) if slots is None else slots
    errors: list[BaseException] = []
    dropped = 0
    for slot in slots:
      errors.extend(_deferred.pop(slot, ()))
      dropped += _dropped.pop(slot, 0)
  if not errors:
    return None
  if len(errors) == 1 and not dropped:
    return errors[0]
  return group(errors, dropped)


def group(errors: list[BaseException], dropped: int = 0) -> BaseException:
  """Several callback errors reported together.

  A ``BaseExceptionGroup`` (an ``ExceptionGroup`` when all are ``Exception`` s)
  on Python >= 3.11; before, the first error, with the others in its
  ``jax_effects_errors`` attribute (all of them, the first included).
  ``dropped``: errors beyond :data:`MAX_KEPT_ERRORS` that were only counted.
  """
  more = f" (and {dropped} more, not kept)" if dropped else ""
  message = (f"jax_effects: {len(errors)} host callbacks failed{more}; "
             "each is one of the exceptions below")
  try:
    report = BaseExceptionGroup(message, errors)  # noqa: F821 - Python >= 3.11
  except NameError:
    report = errors[0]
  report.jax_effects_errors = tuple(errors)
  report.jax_effects_dropped = dropped
  return report


def raise_deferred(state: ThreadTokens) -> None:
  """Raises the errors deferred by computations this thread dispatched.

  Waits first for the thread's dispatched computations (only when an error is
  pending), so the errors of a failed execution are all reported together.
  """
  if state.slot not in _deferred:
    return
  _wait_quietly(state)
  exc = pop_deferred((state.slot,))
  if exc is not None:
    raise exc.with_traceback(exc.__traceback__)


def raise_own(state: ThreadTokens, token) -> None:
  """Raises the errors of the call that just returned (callbacks that ran
  inline), with every other error of the thread pending once that call's
  computation has completed: one report."""
  own = state.own_errors
  state.own_errors = []
  try:
    token.block_until_ready()
  except Exception:  # noqa: BLE001 - not ours to report here
    pass
  if state.slot in _deferred:
    _wait_quietly(state)
  rest = pop_deferred((state.slot,))
  errors = own + (flat_errors(rest) if rest is not None else [])
  exc = errors[0] if len(errors) == 1 else group(errors)
  raise exc.with_traceback(exc.__traceback__)


def flat_errors(report: BaseException) -> list[BaseException]:
  errors = getattr(report, "jax_effects_errors", None)
  return list(errors) if errors is not None else [report]


def is_execution_error(err: BaseException) -> bool:
  """Whether ``err``, raised by running an executable, is an execution failure.

  An XLA runtime error, or a callback's error surfacing as another type: when
  the CPU client runs a computation inline, a failed host callback reaches the
  caller as ``ValueError("INTERNAL: CpuCallback error ...")``.
  """
  if isinstance(err, jax.errors.JaxRuntimeError):
    return True
  try:
    return _MARK in str(err)
  except Exception:  # noqa: BLE001 - not one of ours
    return False


def reraise(err: BaseException, state: ThreadTokens | None) -> None:
  """Raises the user's exception behind ``err`` (or ``err`` itself).

  The thread's tokens are reset: a failed computation's tokens carry its error
  and must not be handed to the next computation. An error that is not an
  execution failure (:func:`is_execution_error`: a tracing error, say) is
  raised unchanged and resets nothing.
  """
  if not is_execution_error(err):
    raise err
  orig = original_error(err)
  if state is not None:
    state.reset()
  if orig is None:
    raise err
  raise orig.with_traceback(orig.__traceback__) from None


# --- barrier -------------------------------------------------------------------

def in_host_callback() -> bool:
  """True while a compiled computation's host callback runs on this thread."""
  from jax_effects import _placement
  return _placement.current() is not None


def check_not_in_callback(call: str) -> None:
  """Refuses ``call`` (a barrier or mode switch) inside a host callback.

  It would wait for the computation that is running the callback (and, in a
  multi-device computation, for the other devices' callbacks): a deadlock.
  """
  if in_host_callback():
    raise RuntimeError(
        f"jax_effects: {call} was called from a host callback of a running "
        "computation; it would wait for that computation (a deadlock). Call it "
        "after the jitted call returns, outside the callback.")


def _wait_quietly(state: ThreadTokens) -> None:
  for token in state.pending():
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001 - reported by the call or barrier
      pass


def wait_quietly(all_threads: bool) -> None:
  """Blocks on this thread's tokens (every thread's, exited ones included, with
  ``all_threads``) and reports nothing: each error stays for the thread that
  dispatched it (a mode switch waits like this)."""
  if all_threads:
    with _all_lock:
      states = list(_all_states)
      orphans = list(_orphans)
  else:
    states, orphans = [thread_tokens()], []
  for state in states:
    _wait_quietly(state)
  for token in orphans:
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001 - reported by a barrier
      pass
  try:   # effects under plain jax.jit (JAX keeps a failed token: reported later)
    jax.effects_barrier()
  except Exception:  # noqa: BLE001
    pass


def wait_for_thread() -> None:
  """Blocks until this thread's dispatched effects have run (raises nothing:
  a failure is reported by the next call or barrier)."""
  _wait_quietly(thread_tokens())


def effects_barrier(all_threads: bool = False) -> None:
  """Blocks until every effect dispatched so far has completed.

  With ``all_threads=False`` waits for the effects dispatched by the calling
  thread; with ``all_threads=True`` for those of every thread (including
  threads that have exited). Then raises the callback errors not reported yet
  (see ``design/errors.md``): this thread's (every thread's with
  ``all_threads=True``) and those whose dispatching thread is unknown; one
  error as itself, several together (an ``ExceptionGroup``), each once.

  Refused (``RuntimeError``) inside a host callback of a running computation,
  which it would wait for.
  """
  check_not_in_callback(f"effects_barrier(all_threads={all_threads})")
  if all_threads:
    with _all_lock:
      states = list(_all_states)
      orphans = list(_orphans)
    # Dead before the wait: dispatches nothing after it, so it can be dropped
    # (its thread-local may outlive the thread a little).
    dead = [s for s in states if not s.alive()]
  else:
    states = [thread_tokens()]
    orphans = []
  first_error = None
  for state in states:
    try:
      for token in state.pending():
        token.block_until_ready()
    except Exception as err:  # a failed computation: report it, reset tokens
      state.reset()
      first_error = first_error or err
  for token in orphans:
    try:
      token.block_until_ready()
    except Exception as err:  # noqa: BLE001
      first_error = first_error or err
  try:   # effects under plain jax.jit use JAX's own tokens (this thread's)
    jax.effects_barrier()
  except Exception as err:
    _compat.clear_jax_runtime_tokens()   # JAX keeps failed ones: report once
    first_error = first_error or err
  if all_threads:
    done = {id(t) for t in orphans}
    with _all_lock:
      _orphans[:] = [t for t in _orphans if id(t) not in done]
      for state in dead:
        _all_states.discard(state)
  if first_error is not None:
    reraise(first_error, None)
  # deferred errors: this thread's and those of unknown origin (every
  # thread's with all_threads=True)
  deferred = pop_deferred(None if all_threads else (states[0].slot, 0))
  if deferred is not None:
    raise deferred.with_traceback(deferred.__traceback__)


# --- thread lifetime -------------------------------------------------------------
# A ThreadTokens is referenced strongly only by its thread's threading.local, so
# it goes away with its thread: _thread_exited then keeps only the tokens of
# that thread that are still pending (an all-threads barrier and interpreter
# exit wait for them), and drops those that are already complete.

_orphans: list[jax.Array] = []


def _register(state: ThreadTokens) -> None:
  with _all_lock:
    _all_states.add(state)
  weakref.finalize(state, _thread_exited, state.output, state.runtime)


def _thread_exited(output: dict, runtime: dict) -> None:
  pending = [t for t in (*output.values(), *runtime.values())
             if not _is_ready(t)]
  output.clear()
  runtime.clear()
  with _all_lock:
    _orphans[:] = [t for t in _orphans if not _is_ready(t)]
    _orphans.extend(pending)


def _is_ready(token) -> bool:
  try:
    return token.is_ready()
  except Exception:  # noqa: BLE001 - a failed or deleted array is done
    return True


def live_thread_states() -> int:
  """How many threads hold token state (for tests: threads that exited do not)."""
  with _all_lock:
    return len(_all_states)


@atexit.register
def _wait_at_exit() -> None:
  """Interpreter exit: waits for every thread's effects; an error not reported
  yet is printed to stderr with its traceback and the exit status becomes 1,
  as for an uncaught exception."""
  try:
    effects_barrier(all_threads=True)
  except BaseException as exc:  # noqa: BLE001 - reported here, as uncaught
    import os
    import sys
    import traceback
    try:
      sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a broken stdout
      pass
    try:
      sys.stderr.write("jax_effects: a host callback failed and its error was "
                       "not reported before interpreter exit:\n")
      traceback.print_exception(exc, file=sys.stderr)
      sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a broken stderr, or a hostile __str__
      pass
    os._exit(1)
