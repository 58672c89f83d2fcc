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
that runs elsewhere. A token's *value* is the dispatching thread's slot (and
``_errors.FAILED`` while inside a computation), so a callback's error goes to
the thread that dispatched it: deferred in ``_errors``, raised by that
thread's call (:func:`raise_own`), next call (:func:`raise_deferred`) or
barrier. A thread's state is released when the thread exits; interpreter
exit waits for every thread and reports what is left. The contract:
``design/errors.md``.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import signal
import threading
import types
import weakref
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _errors
from jax_effects import _output
from jax_effects import _placement
from jax_effects import _sequence

# int32: a token's value is the slot of the thread that dispatched it (see
# ThreadTokens.slot); host callbacks pass it through unchanged.
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
    # dispatch on other devices follows (_file_last). Its computation is also
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


_local = threading.local()
# Reentrant: a thread-exit finalizer (_thread_exited) may run from garbage
# collection in a thread that holds it.
_all_lock = threading.RLock()
# every live thread's state (weakly: a thread's state goes with the thread)
_all_states: "weakref.WeakSet[ThreadTokens]" = weakref.WeakSet()


def thread_state() -> ThreadTokens:
  """This thread's token state (created and registered on first use)."""
  try:
    return _local.state
  except AttributeError:
    state = _local.state = ThreadTokens(threading.current_thread())
    _register(state)
    return state


def initial_token(state: ThreadTokens) -> np.ndarray:
  """The token of a stream that has had no effect yet in ``state``'s thread.

  A NumPy ``int32`` scalar holding the thread's slot: ``jax.jit`` copies it
  to wherever the first computation runs, as part of that dispatch. A thread
  starting its first stream does no device work of its own, so it never
  waits behind other threads' work on some device (a ``jax.Array`` made
  here would be put on the default device first, and a device busy with
  other threads' callbacks can hold that up). :func:`as_array` where a
  ``jax.Array`` is needed.
  """
  token = state.initial
  if token is None:
    token = state.initial = TOKEN_DTYPE(state.slot)
  return token


def as_array(token) -> jax.Array:
  """``token`` as a ``jax.Array`` (the initial token is a NumPy scalar),
  uncommitted, not placed by the user's mesh."""
  if isinstance(token, jax.Array):
    return token
  with _compat.no_user_mesh():
    return jnp.asarray(token)


def update(state: ThreadTokens, keys, token: jax.Array) -> None:
  """Records ``token`` (returned by one executable) for ``keys`` and devices.

  Raises nothing: an error a callback deferred is raised by the thread's next
  call before it dispatches, or its barrier (the result of this call is
  returned either way).
  """
  output = state.output
  sharding = token.sharding
  if state.last_token is not None:
    _file_last(state)
  if state.last_sharding is sharding:  # already the most recent entry
    output[sharding] = token
  else:  # move to the end (recency)
    output.pop(sharding, None)
    output[sharding] = token
    state.last_sharding = sharding
  if keys:
    if kept_on_devices(token):
      # One element or copy per device: kept as it is, so the next call of a
      # program over the same devices continues each device's chain from its
      # own element, with no copy and no extra dispatch; it is combined only
      # for a computation that runs elsewhere (per_device_tokens) or, in the
      # deterministic view, right away (that releases the output).
      if _output.holding():
        runtime = combine_per_device(token)
      else:
        runtime = token
        state.per_device = True
    else:
      runtime = _compat.uncommitted(token) if _compat.committed(token) else token
    for key in keys:
      if key is not _effects.UNORDERED:
        state.runtime[key] = runtime
  if state.per_device:
    state.fast_mode = None
  else:
    # Only if the thread's mode is still the one of this dispatch: a
    # set_ordering by another thread while it was in flight cleared
    # fast_mode (mode_changed), which must not be undone here. (Read after
    # the store: a switch landing in between clears it, as set_ordering
    # sets the mode before clearing.)
    mode = state.fast_mode = state.mode
    if _effects.get_ordering() != mode:
      state.fast_mode = None


def mode_changed(all_threads: bool) -> None:
  """The calling thread's ordering mode (every thread's, with
  ``all_threads``) changed: their next dispatch takes the general path,
  which follows the earlier dispatches (:func:`switch_mode`)."""
  if all_threads:
    with _all_lock:
      states = list(_all_states)
  else:
    state = getattr(_local, "state", None)
    states = [] if state is None else [state]
  for state in states:
    state.fast_mode = None


def fast_dispatch(mode: str, key, jitted, *, fun, general, learn, retry,
                  per_device, site: "LaunchSite"):
  """The dispatch hook of one function in its common case (``_jit``).

  Valid while the function threads one ordered chain ``key`` with scalar
  runtime tokens through ``jitted`` (``jitted(token, *args, **kwargs)
  -> (outputs, token)``) in ordering mode ``mode``. The returned
  ``call(*args, **kwargs)`` is what calling the function calls: it passes
  the thread's token of ``key``, stores the returned one (also when an
  interrupt lands right after the dispatch, see :func:`store_interrupted`)
  and raises the errors of callbacks that ran inline in the call, the steps
  of ``_jit``'s general dispatch without their loops, branches and frames.
  Everything else goes elsewhere: under a trace, ``fun`` (the user's
  function; under ``jax.disable_jit`` ``jitted`` calls it, see ``_jit``); in
  another mode, after a mode switch, with a per-device token or an error
  pending (``ThreadTokens.fast_mode``), ``general``; a trace that finds
  another chain raises ``retry``, given to ``learn`` before ``general`` is
  called; a per-device token returned (a new signature) is stored and given
  to ``per_device``. A computation over several CPU devices is launched under
  :data:`launch_lock` (``site``: what this hook launched last).
  """
  trace, axis_env, eval_trace, top_axis_env = _compat.TOP_LEVEL
  committed, uncommitted = _compat.committed, _compat.uncommitted
  errors = _errors.deferred   # (the registry dict itself: emptied, never replaced)

  def call(*args, **kwargs):
    if trace.value is not eval_trace or axis_env.value is not top_axis_env:
      return fun(*args, **kwargs)   # under a trace (_compat.at_top_level)
    try:
      state = _local.state
    except AttributeError:   # the thread's first call
      return general(*args, **kwargs)
    if state.fast_mode != mode or errors:
      return general(*args, **kwargs)
    runtime = state.runtime
    token = runtime.get(key)
    if token is None:
      token = initial_token(state)
    state.dispatching = True   # (see _on_sigint)
    try:
      try:
        # (forwarding an empty **kwargs costs a dict: about 1% of a call)
        if site.serialize is not True or not serialize_launch(site):
          out, token = (jitted(token, *args, **kwargs) if kwargs
                        else jitted(token, *args))
        else:
          with launch_lock:
            out, token = (jitted(token, *args, **kwargs) if kwargs
                          else jitted(token, *args))
      except retry as err:   # the trace found another chain
        learn(err)
        token = None
      except Exception as err:  # noqa: BLE001 - an execution error or not
        dispatch_failed(state, err)
      if token is not None:
        try:
          sharding = token.sharding
          if sharding is not site.sharding:
            launched(site, sharding)
          if sharding is not state.last_sharding or state.last_token is None:
            if kept_on_devices(token):   # a per-device token (a new signature)
              update(state, (key,), token)
              per_device(token)
              sharding = None
            else:   # another device set than the last dispatch's
              _file_last(state)
              state.output.pop(sharding, None)
              state.last_sharding = sharding
          if sharding is not None:
            state.last_token = token
            runtime[key] = (uncommitted(token) if committed(token)
                            else token)
        except BaseException:
          store_interrupted(state, (key,), token)   # see store_interrupted
          raise
    finally:
      state.dispatching = False
    if token is None:   # (outside the handler: no __context__)
      return general(*args, **kwargs)
    if state.own_errors:   # a callback of this call failed (ran inline)
      raise_own(state, token)
    return out
  interrupts_deferred_in(call)
  return call


def _file_last(state: ThreadTokens) -> None:
  """Moves the fast path's last output token into ``state.output``."""
  token = state.last_token
  if token is not None:
    state.last_token = None
    output = state.output
    output.pop(state.last_sharding, None)
    output[state.last_sharding] = token


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


def kept_on_devices(token) -> bool:
  """Whether ``token`` (returned by a computation) stays on its devices for
  the next call of a program over them (:func:`per_device_tokens`).

  So does one element per device (a ``shard_map`` program: each device's
  chain) and a scalar over several devices (automatic partitioning: its
  effects ran once, on the first device, whose copy is the chain's; the
  others' copies are stale, see ``_primitives._on_first_device``, and only
  that program's devices other than the first read them, to pass them
  through). Passing it back whole spares copying the first device's copy to
  the others before every call (a third of a call on 8 CPU devices). A
  thread's initial token (a NumPy scalar) is on no device.
  """
  if isinstance(token, np.generic):
    return False
  return bool(token.ndim) or len(token.sharding.device_set) > 1


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

  A per-device runtime token (:func:`kept_on_devices`) can be handed as it is
  only to a computation over the same devices (``sharding``: that of the
  token the callee returned last time, or None). Any other computation gets
  one scalar token on the first device, which is stored back: one element per
  device combined (:func:`combine_per_device`), or of a scalar the first
  device's copy (``_compat.uncommitted``).
  """
  out = []
  for key, token in zip(keys, tokens):
    if kept_on_devices(token) and (sharding is None
                                   or token.sharding != sharding):
      token = state.runtime[key] = (combine_per_device(token) if token.ndim
                                    else _compat.uncommitted(token))
    out.append(token)
  state.per_device = any(kept_on_devices(t) for t in state.runtime.values())
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
    if token is None:   # (a jax.Array, as every other token in the snapshot)
      token = as_array(initial_token(state))
    effects = {_effects.GLOBAL: token}
  else:
    effects = dict(state.runtime)
  return RuntimeTokens(types.MappingProxyType(effects),
                       types.MappingProxyType(state.devices()))


# --- callback errors of this thread (the registry is ``_errors``) --------------

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
  _errors.defer(exc, slot)


def current_slot() -> int:
  """The slot of the calling thread (0 if it never used jax_effects)."""
  state = getattr(_local, "state", None)
  return 0 if state is None else state.slot


def raise_deferred(state: ThreadTokens) -> None:
  """Raises the errors deferred by computations this thread dispatched.

  Waits first for the thread's dispatched computations (only when an error is
  pending), so the errors of a failed execution are all reported together.
  """
  if state.slot not in _errors.deferred:
    return
  _wait_quietly(state)
  exc = _errors.pop_deferred((state.slot,))
  if exc is not None:
    raise exc.with_traceback(exc.__traceback__)


def dispatch_failed(state: ThreadTokens, err: Exception) -> None:
  """Raises ``err``, raised by the dispatch in progress (see
  ``_errors.reraise``).

  Errors of callbacks that ran inline before the computation failed (in
  ``own_errors``) are deferred to the thread's next call or barrier, which
  raise them before dispatching anything: left in ``own_errors``, the next
  call would raise them after running (its result discarded for an earlier
  call's error). An interrupt deferred during the dispatch (``_on_sigint``)
  is raised instead of ``err`` (with ``err`` as its cause).
  """
  if state.own_errors:
    interrupts = _defer_own_errors(state)
    if interrupts:
      if isinstance(err, jax.errors.JaxRuntimeError):
        state.reset()
      raise interrupts[0] from err
  _errors.reraise(err, state.reset)


def _is_interrupt(exc: BaseException) -> bool:
  """An interrupt deferred during a dispatch (:func:`_on_sigint`)."""
  return getattr(exc, "jax_effects_signal", False)


def _defer_own_errors(state: ThreadTokens) -> list:
  """Moves the callbacks' errors in ``state.own_errors`` to the thread's
  deferred errors (its next call or barrier raises them before dispatching);
  returns the interrupts that were there."""
  own, state.own_errors = state.own_errors, []
  for exc in own:
    if not _is_interrupt(exc):
      _errors.defer(exc, state.slot)
  return [exc for exc in own if _is_interrupt(exc)]


def raise_own(state: ThreadTokens, token) -> None:
  """Raises the errors of the call that just returned (callbacks that ran
  inline), with every other error of the thread pending once that call's
  computation has completed: one report."""
  if any(_is_interrupt(exc) for exc in state.own_errors):
    # Ctrl-C during the dispatch (_on_sigint): raised now, without waiting
    # for the computation (its token is stored); the callbacks' errors stay
    # for the thread's next call or barrier.
    raise _defer_own_errors(state)[0]
  own, state.own_errors = state.own_errors, []
  try:
    token.block_until_ready()
  except Exception:  # noqa: BLE001 - not ours to report here
    pass
  if state.slot in _errors.deferred:
    _wait_quietly(state)
  rest = _errors.pop_deferred((state.slot,))
  errors = own + (_errors.flat_errors(rest) if rest is not None else [])
  exc = errors[0] if len(errors) == 1 else _errors.group(errors)
  raise exc.with_traceback(exc.__traceback__)


# --- SIGINT during a dispatch ------------------------------------------------------
# Python raises KeyboardInterrupt at the next instruction boundary of the main
# thread: when SIGINT arrives while a dispatch is blocked in JAX's C++ code
# (the CPU client runs a computation with host callbacks inline), that is
# right after the call returns, in the dispatching frame, before its result
# is stored: the computation runs, but its token would be lost, so the next
# call's effects could run before its effects and a barrier would not wait
# for them. While a registered dispatching frame stores its token, the
# interrupt is deferred to the end of that call (raise_own): the token is
# stored first. Anywhere else (tracing, compiling, a host callback, user
# code) it is raised at once, as Python's default handler does.

_deferring_codes: set = set()


def interrupts_deferred_in(function) -> None:
  """Registers a dispatching function (its frame stores a dispatched
  computation's token while ``ThreadTokens.dispatching``)."""
  _deferring_codes.add(function.__code__)


def _on_sigint(signum, frame):
  state = getattr(_local, "state", None)
  if (state is not None and state.dispatching and frame is not None
      and frame.f_code in _deferring_codes):
    exc = KeyboardInterrupt()
    exc.jax_effects_signal = True
    state.own_errors.append(exc)   # raised by this call once its token is stored
    return
  signal.default_int_handler(signum, frame)


def _install_sigint_handler() -> None:
  """Installs :func:`_on_sigint` (from the main thread, once) where Python's
  default SIGINT handler is installed; a user's own handler is left alone."""
  if threading.current_thread() is not threading.main_thread():
    return
  try:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
      signal.signal(signal.SIGINT, _on_sigint)
  except (ValueError, OSError):  # not the main interpreter, no signals
    pass


# --- launches over several CPU devices, one at a time ------------------------------
# XLA's CPU client (jaxlib 0.8 to 0.10) deadlocks when executables that span
# several devices are launched from several threads at once: the launch of
# each device's part runs on the client's small thread pool and blocks there
# while that device has its maximum of computations in flight, and the
# computations that would free a place wait for a thread of the same pool.
# Plain JAX hangs the same way (8 threads calling a jitted shard_map over 8 CPU
# devices; no callback needed). One such launch at a time never did: threaded
# dispatches of a computation that spans several CPU devices take
# ``launch_lock`` around the launch (waiting for it releases the GIL).

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
  return site.serialize is True and not in_host_callback()


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

def in_host_callback() -> bool:
  """True while a compiled computation's host callback runs on this thread."""
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
  _sequence.wait_idle((state.slot,))   # effects left to run on the host


def wait_quietly(all_threads: bool) -> None:
  """Blocks on this thread's tokens (every thread's, exited ones included, with
  ``all_threads``) and reports nothing: each error stays for the thread that
  dispatched it (a mode switch waits like this)."""
  if all_threads:
    with _all_lock:
      states = list(_all_states)
      orphans = list(_orphans)
  else:
    states, orphans = [thread_state()], []
  for state in states:
    _wait_quietly(state)
  for token in orphans:
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001 - reported by a barrier
      pass
  if all_threads:
    _sequence.wait_idle()
  try:   # effects under plain jax.jit (JAX keeps a failed token: reported later)
    jax.effects_barrier()
  except Exception:  # noqa: BLE001
    pass


def wait_for_thread() -> None:
  """Blocks until this thread's dispatched effects have run (raises nothing:
  a failure is reported by the next call or barrier)."""
  _wait_quietly(thread_state())


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
    states = [thread_state()]
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
  # Effects left to run on the host once every device's part is there
  # (_sequence): their calls have all been made by now.
  _sequence.wait_idle(None if all_threads else (states[0].slot,))
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
    _errors.reraise(first_error, None)
  # deferred errors: this thread's and those of unknown origin (every
  # thread's with all_threads=True)
  deferred = _errors.pop_deferred(None if all_threads
                                  else (states[0].slot, 0))
  if deferred is not None:
    raise deferred.with_traceback(deferred.__traceback__)


# --- thread lifetime -------------------------------------------------------------
# A ThreadTokens is referenced strongly only by its thread's threading.local, so
# it goes away with its thread: _thread_exited then keeps only the tokens of
# that thread that are still pending (an all-threads barrier and interpreter
# exit wait for them), and drops those that are already complete.

_orphans: list[jax.Array] = []


def _register(state: ThreadTokens) -> None:
  _prune_orphans()   # (a thread's first use: an ordinary context)
  _install_sigint_handler()   # (the main thread's first use)
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
  with _all_lock:
    _orphans.extend(tokens)


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
