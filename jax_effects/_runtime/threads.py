"""Per-thread token state: the runtime and output tokens of one Python thread.

Compiler tokens order side effects *inside* one computation. Between
computations, the order is carried by **runtime tokens**: tiny arrays (an
``int32`` scalar holding the dispatching thread's slot, ``_runtime.errors``) that
every token-threaded executable takes as inputs, one per ordered
:class:`~jax_effects.Effect` it uses, and returns as outputs. Because an
executable starts only when all its inputs are ready ("strict execution"),
passing the token returned by the previous computation makes the next one
wait for it. This module is that state and its changes:

* :class:`ThreadTokens` is **thread-local and per effect**: each Python
  thread has its own streams, so threads never wait for each other. Its
  ``runtime`` map (chain key -> token) is read before a dispatch
  (:meth:`ThreadTokens.tokens_for`) and written after it
  (:meth:`ThreadTokens.update`); ``output``
  keeps the latest output token per device set, for the barrier.
* A runtime token is kept *uncommitted*: ``jax.jit``'s C++ dispatch copies it
  to the devices of the next computation when (and only when) they differ,
  and it never pins a computation to a device. A token returned per device
  (a ``shard_map`` program) stays on its devices (``per_device``).
* A thread's state goes with the thread; its pending tokens become
  *orphans* that an all-threads barrier and interpreter exit still wait for.

The call path that reads and writes this state is ``_dispatch.call_path``;
the barrier ``barrier``; errors raised to a thread ``raising``. The
contract: ``design/tokens.md``, ``design/errors.md``.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterable
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import output as _output
from jax_effects._runtime import per_device as _per_device

TOKEN_DTYPE = np.int32
_slots = itertools.count(1)


class ThreadTokens:
  """The token state of one Python thread."""
  __slots__ = ("runtime", "output", "last_sharding", "last_token",
               "per_device", "fast_mode", "dispatching", "slot",
               "initial", "thread", "mode", "own_errors", "__weakref__")

  def __init__(self, thread: threading.Thread):
    # chain key (Effect) -> uncommitted single-device runtime token
    self.runtime: dict[Any, jax.Array] = {}
    # sharding -> latest output token on that device set (insertion = recency)
    self.output: dict[Any, jax.Array] = {}
    # The sharding of the most recent dispatch's output token, and that token
    # when it is not in ``output`` yet: the fast hook (fast_dispatch) replaces
    # it without hashing a sharding; it is filed into ``output`` when a
    # dispatch on other devices follows (file_last). Its computation is also
    # that of a runtime token, so the thread-exit finalizer need not see it.
    self.last_sharding: Any = None
    self.last_token: jax.Array | None = None
    # True while some runtime token is a per-device vector (see update)
    self.per_device = False
    # The mode in which the fast dispatch hooks (fast_dispatch) may run on
    # this thread: its mode at its last dispatch, while it has no per-device
    # token; None after a mode change (mode_changed) until the next general
    # dispatch (update). One comparison stands for all those checks.
    self.fast_mode: str | None = None
    # True from a dispatch to the storing of its token (see _on_sigint).
    self.dispatching = False
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
    items = list(self.output.items())
    if self.last_token is not None:
      items.append((self.last_sharding, self.last_token))
    for sharding, token in items:
      for device in sharding.addressable_devices:
        out[device] = token
    return out

  def pending(self) -> list[jax.Array]:
    last = [] if self.last_token is None else [self.last_token]
    return [*self.output.values(), *last, *self.runtime.values()]

  def alive(self) -> bool:
    thread = self.thread()
    return thread is not None and thread.is_alive()

  def reset(self) -> None:
    self.runtime.clear()
    self.output.clear()
    self.last_sharding = None
    self.last_token = None
    self.fast_mode = None
    self.per_device = False

  # --- the call path's state changes (``_dispatch.call_path``; its fast
  # hook inlines a scalar variant of update) --------------------------------

  def initial_token(self) -> np.ndarray | jax.Array:
    """The token of a stream that has had no effect yet in ``self``'s thread.

    A NumPy ``int32`` scalar holding the thread's slot: ``jax.jit`` copies it
    to wherever the first computation runs, as part of that dispatch. A thread
    starting its first stream does no device work of its own, so it never
    waits behind other threads' work on some device (a ``jax.Array`` made
    here would be put on the default device first, and a device busy with
    other threads' callbacks can hold that up). :func:`as_array` where a
    ``jax.Array`` is needed.

    Under a transfer guard (``jax.transfer_guard``) that refuses or logs
    implicit host-to-device transfers, that copy would be one: the token is
    then put on the default device once by an explicit transfer, allowed for
    it alone (:func:`_placed_initial_token`), and kept.
    """
    token = self.initial
    if token is None:
      token = self.initial = _errors.TOKEN_DTYPE(self.slot)
    if type(token) is _errors.TOKEN_DTYPE and _compat.host_transfers_guarded():
      token = self.initial = _placed_initial_token(self.slot)
    return token

  def update(self, keys, token: jax.Array) -> None:
    """Records ``token`` (returned by one executable) for ``keys`` and devices.

    Raises nothing: an error a callback deferred is raised by the thread's next
    call before it dispatches, or its barrier (the result of this call is
    returned either way).
    """
    output = self.output
    sharding = token.sharding
    if self.last_token is not None:
      self.file_last()
    if self.last_sharding is sharding:  # already the most recent entry
      output[sharding] = token
    else:  # move to the end (recency)
      output.pop(sharding, None)
      output[sharding] = token
      self.last_sharding = sharding
    if keys:
      if _per_device.kept_on_devices(token):
        # One element or copy per device: kept as it is, so the next call of a
        # program over the same devices continues each device's chain from its
        # own element, with no copy and no extra dispatch; it is combined only
        # for a computation that runs elsewhere (per_device.tokens_for_sharding) or, in the
        # deterministic view, right away (that releases the output).
        if _output.holding():
          runtime = _per_device.combine(token)
        else:
          runtime = token
          self.per_device = True
      else:
        runtime = _compat.uncommitted(token) if _compat.committed(token) else token
      for key in keys:
        if key is not _effects.UNORDERED:
          self.runtime[key] = runtime
    if self.per_device or after_exit_handler:
      self.fast_mode = None
    else:
      # Only if the thread's mode is still the one of this dispatch: a
      # set_ordering by another thread while it was in flight cleared
      # fast_mode (mode_changed), which must not be undone here. (Read after
      # the store: a switch landing in between clears it, as set_ordering
      # sets the mode before clearing.)
      mode = self.fast_mode = self.mode
      if _effects.get_ordering() != mode:
        self.fast_mode = None

  def file_last(self) -> None:
    """Moves the fast path's last output token into ``self.output``."""
    token = self.last_token
    if token is not None:
      self.last_token = None
      output = self.output
      output.pop(self.last_sharding, None)
      output[self.last_sharding] = token

  def switch_mode(self, mode: str) -> None:
    """Called before a dispatch in a mode other than the thread's last one.

    The two modes use different runtime-token streams, so nothing would order
    this dispatch after the thread's earlier ones, which may still be in flight
    (a ``set_ordering`` from another thread lands between any two calls): wait
    for them first. Switches are rare; the common path is one comparison.
    """
    if self.mode is not None:
      wait_quietly(self.pending())
    self.mode = mode

  def store_interrupted(self, keys, token) -> None:
    """Stores a dispatched computation's token when an interrupt
    (``KeyboardInterrupt`` from SIGINT, or another ``BaseException``) landed
    between the dispatch and :meth:`update`: the computation runs anyway, so
    the thread's next dispatch and its barrier must still follow it. Storing
    the same token twice is harmless; if storing fails, the token is waited for.
    """
    try:
      self.update(keys, token)
    except BaseException:  # noqa: BLE001 - a second interrupt: wait instead
      wait_quietly((token,))

  def tokens_for(self, keys, per_device_sharding) -> tuple:
    """The runtime tokens of ``keys`` to pass to the next computation.

    ``per_device_sharding``: sharding of the per-device token the callee
    returned last time (None: the callee takes scalar tokens only); see
    ``per_device.tokens_for_sharding``.
    """
    runtime = self.runtime
    initial = self.initial_token()
    if len(keys) == 1:  # the common case, without a comprehension's frame
      tokens = (runtime.get(keys[0], initial),)
    else:
      tokens = tuple([runtime.get(k, initial) for k in keys])
    if self.per_device:
      tokens = _per_device.tokens_for_sharding(self, keys, tokens,
                                                per_device_sharding)
    return tokens


local = threading.local()
# Reentrant: a thread-exit finalizer (_thread_exited) may run from garbage
# collection in a thread that holds it.
_all_lock = threading.RLock()
# every live thread's state (weakly: a thread's state goes with the thread)
_all_states: "weakref.WeakSet[ThreadTokens]" = weakref.WeakSet()
#: Set once jax_effects' interpreter-exit handler has run (``exit``): a
#: dispatch after it (from an exit handler that runs later) takes the general
#: path, which reports its errors itself (``exit.report_late``).
after_exit_handler = False


def thread_state() -> ThreadTokens:
  """This thread's token state (created and registered on first use).

  In a child forked after JAX's backend started, where no computation can
  run, creating one is refused (``fork``)."""
  try:
    return local.state
  except AttributeError:
    if _fork.forked_after_backend:
      raise _fork.refused("a call that runs or waits for effects") from None
    state = local.state = ThreadTokens(threading.current_thread())
    _register(state)
    return state


def _placed_initial_token(slot: int) -> jax.Array:
  """An uncommitted ``int32`` scalar holding ``slot`` on the default device,
  put there by an explicit transfer that only it is allowed (the user's own
  transfers stay under the user's guard)."""
  with jax.transfer_guard_host_to_device("allow"), _compat.no_user_mesh():
    return jax.device_put(_errors.TOKEN_DTYPE(slot))


def as_array(token) -> jax.Array:
  """``token`` as a ``jax.Array`` (the initial token is a NumPy scalar),
  uncommitted, not placed by the user's mesh."""
  if isinstance(token, jax.Array):
    return token
  with _compat.no_user_mesh():
    return jnp.asarray(token)


def mode_changed(all_threads: bool) -> None:
  """The calling thread's ordering mode (every thread's, with
  ``all_threads``) changed: their next dispatch takes the general path,
  which follows the earlier dispatches (:meth:`ThreadTokens.switch_mode`)."""
  if all_threads:
    with _all_lock:
      states = list(_all_states)
  else:
    state = getattr(local, "state", None)
    states = [] if state is None else [state]
  for state in states:
    state.fast_mode = None


# --- thread lifetime -------------------------------------------------------------
# A ThreadTokens is referenced strongly only by its thread's threading.local, so
# it goes away with its thread: _thread_exited then keeps only the tokens of
# that thread that are still pending (an all-threads barrier and interpreter
# exit wait for them), and drops those that are already complete.

_orphans: list[jax.Array] = []
#: Called (no arguments) when a thread's state is created, before its first
#: dispatch (``interrupts`` installs its SIGINT handler from the main thread's).
on_new_thread: list[Callable[[], None]] = []


def wait_quietly(tokens: Iterable) -> None:
  """Blocks on each of ``tokens``, ignoring failures: each error stays for
  the call or barrier that reports it (``design/errors.md``)."""
  for token in tokens:
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001 - reported by a call or barrier
      pass


def orphans() -> list:
  """The pending tokens of exited threads (a copy)."""
  with _all_lock:
    return list(_orphans)


def all_states() -> list:
  """Every live thread's state (a copy)."""
  with _all_lock:
    return list(_all_states)


def forget(states: list, done_orphans: list) -> None:
  """Drops exited threads' ``states`` and the orphans in ``done_orphans``
  (both waited for by an all-threads barrier)."""
  done = {id(t) for t in done_orphans}
  with _all_lock:
    _orphans[:] = [t for t in _orphans if id(t) not in done]
    for state in states:
      _all_states.discard(state)


def _register(state: ThreadTokens) -> None:
  _prune_orphans()   # (a thread's first use: an ordinary context)
  for hook in on_new_thread:   # (interrupts: the main thread's first use)
    hook()
  with _all_lock:
    _all_states.add(state)
  weakref.finalize(state, _thread_exited, state.output, state.runtime)


def _thread_exited(output: dict, runtime: dict) -> None:
  # A finalizer: it may run inside garbage collection on any thread, so it
  # calls nothing of jax here; completed tokens are dropped later, by the
  # next thread's registration or a barrier (_prune_orphans).
  tokens = [*output.values(), *runtime.values()]
  output.clear()
  runtime.clear()
  lock = _all_lock
  if lock is None:   # the interpreter's teardown cleared this module
    return
  with lock:
    _orphans.extend(tokens)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child holds no thread state, token or pending computation of
  the parent's (``fork``): its forking thread starts without state (the
  fast hooks hold ``local`` itself, so its entry is removed, not the object
  replaced), the other threads do not exist there, and JAX's own runtime
  tokens of the forking thread stand for the parent's computations too."""
  global _all_lock, _all_states
  for state in list(_all_states):
    state.reset()   # (so no finalizer files the parent's tokens as orphans)
  local.__dict__.pop("state", None)
  _all_lock = threading.RLock()
  _all_states = weakref.WeakSet()
  _orphans.clear()
  _compat.clear_jax_runtime_tokens()


def _prune_orphans() -> None:
  """Drops the exited threads' tokens that have completed."""
  if not _orphans:
    return
  with _all_lock:
    snapshot = list(_orphans)
  done = {id(t) for t in snapshot if _is_ready(t)}
  if done:
    with _all_lock:   # (tokens added meanwhile by exiting threads stay)
      _orphans[:] = [t for t in _orphans if id(t) not in done]


def _is_ready(token) -> bool:
  try:
    return token.is_ready()
  except Exception:  # noqa: BLE001 - a failed or deleted array is done
    return True


def live_thread_states() -> int:
  """How many threads hold token state (for tests: threads that exited do not)."""
  with _all_lock:
    return len(_all_states)


