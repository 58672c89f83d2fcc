"""Per-thread token state: the runtime and output tokens of one Python thread.

Compiler tokens order side effects *inside* one computation. Between
computations, the order is carried by **runtime tokens** (``token_value``:
an ``int32`` holding the dispatching thread's slot and the execution's
sequence number) that every token-threaded executable takes as inputs, one
per ordered :class:`~jax_effects.Effect` it uses, and returns as outputs.
Because an executable starts only when all its inputs are ready ("strict
execution"), passing the token returned by the previous computation makes the
next one wait for it. This module owns that state, and is its only writer:
:class:`ThreadTokens` changes only through its methods (a call's returned
token: :meth:`ThreadTokens.update`, or :meth:`ThreadTokens.store` for the
fast hook's one chain), but for :attr:`ThreadTokens.dispatching`, which the
fast hook sets and clears itself (:meth:`ThreadTokens.begin_dispatch` and
:meth:`ThreadTokens.end_dispatch` for a call that is never nested).

* **Thread-local and per effect**: each Python thread has its own streams,
  so threads never wait for each other. ``runtime`` (chain key -> token) is
  read before a dispatch (:meth:`ThreadTokens.tokens_for`) and written after
  it (:meth:`ThreadTokens.update`); ``output`` keeps the latest output token
  per device set, for the barrier.
* **A failed token is never handed on** (``design/errors.md``): a
  computation that failed as a whole (an XLA failure: the call's results
  carry it, as under ``jax.jit``) ends its chain's lineage: the next
  computation starts the chain afresh, and what the failed execution held
  on the host is freed (``executions.failed``). A token still in flight is
  handed on (the device orders the computations) unless its computation
  may fail (it runs JAX's own callbacks): then the dispatch waits for it
  (:meth:`ThreadTokens.tokens_for`).
* **Calls made inside a call**: a call dispatched from a host callback of
  the thread's own call in flight stores its token first; the outer call
  then *joins* it (:meth:`update`) instead of overwriting it, so the next
  dispatch follows both.
* A runtime token is kept *uncommitted*: ``jax.jit``'s C++ dispatch copies it
  to the devices of the next computation when (and only when) they differ,
  and it never pins a computation to a device. A token returned per device
  (a ``shard_map`` program) stays on its devices (``device_tokens``).
* **Slots**: a thread's number, the slot of every token it dispatches
  (``token_value``), is taken from a bounded pool and given back once the
  thread has ended, its computations have completed and its errors have
  been reported; whatever the runtime kept under it is then dropped
  (``executions.slot_freed``). A thread's state goes with the thread; its
  pending tokens are waited for by an all-threads barrier and at exit.

The call path that reads and writes this state through these methods is
``_dispatch.call_path``; the contract: ``design/tokens.md``,
``design/errors.md``.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._runtime import device_tokens as _device_tokens
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import output as _output
from jax_effects._runtime import token_value as _token_value


def settled(token) -> bool:
  """Whether the computation that returned ``token`` ended without failing
  (waits for it). A NumPy initial token was returned by none."""
  if type(token) is not _token_value.TOKEN_DTYPE:
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001 - an XLA failure: the call's, see above
      return False
  return True


class ThreadTokens:
  """The token state of one Python thread (see the module docstring)."""
  __slots__ = ("runtime", "seqs", "at_risk", "verified", "joined", "output",
               "last_sharding",
               "last_token", "device_tokens", "fast_mode", "dispatching",
               "slot", "base", "initial", "thread", "mode", "awaited",
               "__weakref__")

  def __init__(self, thread: threading.Thread, slot: int):
    # chain key (Effect) -> uncommitted single-device runtime token, or a
    # token kept on its devices (device_tokens)
    self.runtime: dict[Any, jax.Array] = {}
    # chain key -> the sequence number of its latest token (token_value):
    # the host's copy of what the device computes, so the host names every
    # execution it dispatches without reading a token (the next execution
    # of the chain is seqs[key] + 1).
    self.seqs: dict[Any, int] = {}
    # Chain keys whose token is returned by a computation that may fail as
    # a whole (see tokens_for): handed on only once it has ended.
    self.at_risk: set = set()
    # The runtime token last stored that was ready when its call returned:
    # its computation ran inside the call (the CPU client ran it inline),
    # and a failure there would have been raised by the call, so it is
    # handed on without a check (tokens_for). (A computation that failed
    # because an input did fails asynchronously: its token is not ready at
    # return, and is checked.)
    self.verified: Any = None
    # Tokens of calls made inside this thread's call in flight (from its
    # host callbacks), joined when it stored its own (see update): the next
    # dispatch waits for them.
    self.joined: list = []
    self.awaited: Any = None
    # sharding -> latest output token on that device set (insertion = recency)
    self.output: dict[Any, jax.Array] = {}
    # The sharding of the most recent dispatch's output token, and that token
    # when it is not in ``output`` yet: the fast hook stores it without
    # hashing a sharding; it is filed into ``output`` when a
    # dispatch on other devices follows.
    self.last_sharding: Any = None
    self.last_token: jax.Array | None = None
    # True while some runtime token is kept on its devices (device_tokens)
    self.device_tokens = False
    # The mode in which the fast dispatch hooks may run on this thread: its
    # mode at its last dispatch, while it holds no token kept on devices
    # (devices_mode(mode) while it does: only the hooks of such tokens run),
    # nothing joined and no token at risk; None after a mode change
    # (clear_fast) until the next general dispatch (update). One comparison
    # stands for all those checks.
    self.fast_mode: str | None = None
    # Dispatches in progress on this thread (more than one: a call made from
    # a host callback of the thread's own call). While nonzero a SIGINT is
    # handled by ``interrupts``.
    self.dispatching = 0
    self.slot = slot
    # The sequence number every chain of this thread starts from: past the
    # last one a previous owner of the slot used (see _take_slot), so an
    # execution's identity (slot, sequence number) is never that of an
    # earlier thread's, whose devices may still run (host_jobs).
    self.base = _slot_base.pop(slot, 0)
    self.initial: Any = None
    # The ordering mode of this thread's last dispatch (see switch_mode).
    self.mode: str | None = None
    self.thread = weakref.ref(thread)

  # --- reads -------------------------------------------------------------------

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
    return [*self.output.values(), *last, *self.runtime.values(),
            *self.joined]

  def alive(self) -> bool:
    thread = self.thread()
    return thread is not None and thread.is_alive()

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
      token = self.initial = _token_value.initial(self.slot)
    if type(token) is _token_value.TOKEN_DTYPE and _compat.host_transfers_guarded():
      token = self.initial = _placed_initial_token(self.slot)
    return token

  # --- the call path's state changes (``_dispatch.call_path``) -------------

  def tokens_for(self, keys, device_sharding, nested: bool = False) -> tuple:
    """``(tokens, read)``: the runtime tokens of ``keys`` to pass to the
    next computation, and the tokens read for them (for :meth:`update`).

    A failed token is never handed on (its chain starts afresh:
    :meth:`chains_failed`). A token whose computation has ended is checked
    (done, or failed). One still running is handed on as it is (the device
    orders the next computation after it, so a dispatch never waits for the
    device), unless that computation may fail as a whole
    (:attr:`at_risk`: it runs one of JAX's own callbacks, which fail an
    execution when they raise): then the dispatch waits for it first, so a
    failure ends there and never fails the computations after it.
    ``device_sharding``: sharding of the token kept on devices the callee
    returned last time (None: the callee takes scalar tokens only); see
    ``device_tokens.for_sharding``. ``nested``: a call made inside this
    thread's call in flight (from its host callback): see :meth:`_past_outer`.
    """
    if self.joined:
      self._wait_joined()
    runtime = self.runtime
    tokens = []
    failed = ()
    read = tuple(runtime.get(key) for key in keys)
    for key, token in zip(keys, read):
      if token is None:
        token = self._fresh(key)
      elif token is not self.verified and (
          (key in self.at_risk or _is_done(token)) and not settled(token)):
        failed += (key,)
        token = self._fresh(key)
      if nested:
        token = self._past_outer(key, token)
      tokens.append(token)
    if failed:
      self.chains_failed(failed)
    if self.device_tokens:
      tokens = self._for_sharding(keys, tokens, device_sharding)
    return tuple(tokens), read

  def wait_for(self, keys) -> None:
    """Waits until the computations holding ``keys``' tokens have ended
    (an eager effect runs after them); a failed one's chain starts afresh."""
    if self.joined:
      self._wait_joined()
    failed = tuple(k for k in keys if k in self.runtime
                   and not settled(self.runtime[k]))
    if failed:
      self.chains_failed(failed)

  def last_seq(self, key) -> int:
    """The sequence number of ``key``'s latest execution on this thread
    (:attr:`base` before its first)."""
    return self.seqs.get(key, self.base)

  def _fresh(self, key):
    """A token of ``key``'s chain that no computation returned: the slot and
    the chain's current sequence number (the initial token at 0)."""
    seq = self.last_seq(key)
    if not seq:
      return self.initial_token()
    value = _token_value.initial(self.slot) | _token_value.TOKEN_DTYPE(
        seq << _token_value.SEQ_SHIFT)
    if _compat.host_transfers_guarded():
      return _placed(value)
    return value

  def _past_outer(self, key, token):
    """The token of ``key`` for a call made inside this thread's call in
    flight (from its host callback), which has not stored its token yet:
    the outer execution took ``token`` (if it is on this chain), so its
    carriers hold the sequence number after ``token``'s. The inner one must
    be another execution: its token is ``token`` one sequence number on
    (computed on its devices, after it: still ordered after it), and the
    host's copy follows. (On a chain the outer is not on, a number is
    skipped: harmless.)"""
    self.seqs[key] = (self.last_seq(key) + 1) & _token_value.SEQ_MASK
    if isinstance(token, jax.Array):
      return _device_tokens.advanced(token)
    return self._fresh(key)   # (an initial token: no computation to follow)

  def _for_sharding(self, keys, tokens, sharding) -> list:
    """``tokens`` with each token kept on other devices than ``sharding``'s
    made one scalar (``device_tokens.for_sharding``), stored back."""
    out = []
    kept = False   # (one of them stays kept on devices: device_tokens holds)
    for key, token in zip(keys, tokens):
      moved = _device_tokens.for_sharding(token, sharding)
      if moved is not token:
        self.runtime[key] = moved
      elif not kept:
        kept = _device_tokens.kept_on_devices(token)
      out.append(moved)
    if not kept:
      self.device_tokens = any(_device_tokens.kept_on_devices(t)
                               for t in self.runtime.values())
    return out

  def _wait_joined(self) -> None:
    joined, self.joined = self.joined, []
    for token in joined:
      settled(token)   # (a failure is the joined call's own, see update)

  def begin_dispatch(self) -> None:
    self.dispatching += 1

  def end_dispatch(self) -> None:
    self.dispatching -= 1

  def update(self, keys, token: jax.Array, read: tuple = (),
             at_risk: bool = False, seq: int | None = None) -> None:
    """Records ``token`` (returned by one executable given the tokens of
    ``keys``: ``read`` is what :meth:`tokens_for` returned with them) for
    ``keys`` and its devices. ``at_risk``: the computation runs one of JAX's
    own callbacks (see :meth:`tokens_for`).

    ``seq``: the sequence number of ``token`` (:meth:`execution`, read
    before the dispatch; by default read now).

    A call made during that dispatch from one of its host callbacks (on this
    thread) has stored a token of a chain meanwhile: the later of the two
    (by sequence number) is kept, the other joined (:attr:`joined`), so the
    next dispatch follows both, and the host's copy of the sequence number
    stays that of the kept token. Raises nothing: an error a callback
    deferred is raised by the thread's next call before it dispatches, or
    its barrier.
    """
    output = self.output
    sharding = token.sharding
    if self.last_token is not None:
      self._file_last()
    if self.last_sharding is sharding:  # already the most recent entry
      output[sharding] = token
    else:  # move to the end (recency)
      output.pop(sharding, None)
      output[sharding] = token
      self.last_sharding = sharding
    if keys:
      if _device_tokens.kept_on_devices(token):
        # Kept as it is, so the next call of a program over the same devices
        # continues each device's chain from its own element, with no copy
        # and no extra dispatch; it is combined only for a computation that
        # runs elsewhere (device_tokens.for_sharding) or, in the
        # deterministic view, right away (that releases the output).
        if _output.holding():
          runtime = _device_tokens.combine(token)
        else:
          runtime = token
          self.device_tokens = True
      else:
        runtime = _compat.uncommitted(token) if _compat.committed(token) else token
      store, seqs, risky = self.runtime, self.seqs, self.at_risk
      if seq is None:
        seq = self.execution(keys)[1]
      for i, key in enumerate(keys):
        if key is not _effects.UNORDERED:
          if read and self._kept_meanwhile(key, read[i], runtime, seq):
            continue
          store[key] = runtime
          seqs[key] = seq
          if runtime is token and not self.device_tokens and _is_done(token):
            self.verified = runtime   # (see verified)
          if at_risk:
            risky.add(key)
          elif risky:
            risky.discard(key)
    self._refresh_fast()

  def store(self, key, token: jax.Array, sharding, passed, seq: int,
            kept: bool = False, finish=None) -> None:
    """:meth:`update` for the fast hook's one chain ``key``
    (``_dispatch.call_path.fast_dispatch``; ``kept``: its token is kept on
    devices), ``token`` (of ``sharding``) returned given ``passed`` as the
    execution ``seq``.
    Written out, no sharding hashed, when the token is on the last
    dispatch's device set (:attr:`last_sharding`) and of the kind passed (a
    scalar while no token is kept on devices; else one on ``passed``'s
    devices, outside a deterministic view), and no call made inside this
    one stored a token of ``key``; else :meth:`update`. ``finish``: the
    call site's wait for a computation that runs user code
    (``_runtime.launch_lock.finish``), or None."""
    runtime = self.runtime
    if (sharding is not self.last_sharding or runtime.get(key) is not passed
        or self.device_tokens is not kept
        or (kept and (sharding is not passed.sharding or _output.holding()))):
      self.update((key,), token, (passed,), seq=seq)
      if finish is not None:
        self.await_previous(passed, finish)
      return
    self.last_token = token
    if kept:
      runtime[key] = token
    else:
      stored = runtime[key] = (_compat.uncommitted(token)
                               if _compat.committed(token) else token)
      if token.is_ready():
        self.verified = stored   # (see verified)
    self.seqs[key] = seq
    if finish is not None:
      self.await_previous(passed, finish)

  def await_previous(self, passed, finish) -> None:
    """Waits (``finish``) for the computation this thread's previous call of
    a site running user code passed its token to, and keeps ``passed`` for
    the next (``_runtime.launch_lock``: at most two in flight)."""
    awaited, self.awaited = self.awaited, passed
    if awaited is not None:
      finish(awaited)

  def execution_seqs(self, keys) -> dict:
    """Chain -> the sequence number of the next execution of ``keys`` (read
    before its dispatch: a call made inside it moves them)."""
    return {k: (self.last_seq(k) + 1) & _token_value.SEQ_MASK
            for k in keys if k is not _effects.UNORDERED}

  def execution(self, keys) -> tuple:
    """``(seqs, seq)`` of the next execution of ``keys``: its identity
    (:meth:`execution_seqs`) and the sequence number of the token it returns,
    the maximum of its chains' carriers (``token_value``), as the device
    computes it."""
    seqs = self.execution_seqs(keys)
    return seqs, max(seqs.values(), default=None)

  def mark_at_risk(self, keys) -> None:
    """The computation that returned ``keys``' tokens may fail as a whole
    (learnt by its own trace, after its dispatch: see :meth:`tokens_for`)."""
    self.at_risk.update(k for k in keys if k is not _effects.UNORDERED)
    self._refresh_fast()

  def _kept_meanwhile(self, key, passed, runtime, seq) -> bool:
    """Whether what a call made inside this one left for ``key`` meanwhile
    stays (see :meth:`update`): when it took a later sequence number than
    this call's (``seq``), this call's token (``runtime``) is joined and the
    host's copy stays the later one, with its token, or with none if that
    call failed as a whole (the chain starts afresh after both: never with
    a number either execution had). Else a token it stored is joined and
    this call's is stored."""
    current = self.runtime.get(key)
    if current is passed:
      return False
    if _token_value.seq_after(self.last_seq(key), seq):
      self.join(runtime)
      return True
    if current is not None:
      self.join(current)
    return False

  def _refresh_fast(self) -> None:
    # (a chain whose token may fail as a whole is handed on only once it
    # has ended, by the general path: tokens_for; the fast hooks would hand
    # it on running, whichever function they belong to)
    if self.joined or self.at_risk or after_exit_handler:
      self.fast_mode = None
    else:
      # Only if the thread's mode is still the one of this dispatch: a
      # set_ordering by another thread while it was in flight cleared
      # fast_mode (clear_fast), which must not be undone here. (Read after
      # the store: a switch landing in between clears it, as set_ordering
      # sets the mode before clearing.) While a token is kept on devices,
      # only the hooks of such tokens may run (devices_mode).
      mode = self.mode
      self.fast_mode = devices_mode(mode) if self.device_tokens else mode
      if _effects.get_ordering() != mode:
        self.fast_mode = None

  def join(self, token) -> None:
    """A call made inside this thread's call in progress stored ``token``
    meanwhile (see :meth:`update`): the next dispatch waits for it."""
    self.joined.append(token)
    self.fast_mode = None

  def _file_last(self) -> None:
    """Moves the fast path's last output token into :attr:`output`."""
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

  def clear_fast(self) -> None:
    """The thread's mode changed: its next dispatch takes the general path."""
    self.fast_mode = None

  def store_interrupted(self, keys, token, read=(),
                        at_risk: bool = False,
                        seq: int | None = None) -> None:
    """Stores a dispatched computation's token when an interrupt
    (``KeyboardInterrupt`` from SIGINT, or another ``BaseException``) landed
    between the dispatch and :meth:`update`: the computation runs anyway, so
    the thread's next dispatch and its barrier must still follow it. Storing
    the same token twice is harmless; if storing fails, the token is waited for.
    """
    try:
      self.update(keys, token, read, at_risk, seq)
    except BaseException:  # noqa: BLE001 - a second interrupt: wait instead
      wait_quietly((token,))

  def chains_failed(self, keys) -> None:
    """The computation holding ``keys``' tokens failed (an XLA failure,
    learnt from its token or raised by its dispatch): those chains start
    afresh, and what the execution held on the host is freed
    (``executions.failed``; over several devices, one may still run its
    part: what skips its later effects stays, see ``executions``)."""
    ended = True
    for key in keys:
      token = self.runtime.pop(key, None)
      if token is not None and _device_tokens.kept_on_devices(token):
        ended = False
    self.fast_mode = None
    _executions.failed(self.slot, {k: self.last_seq(k) for k in keys},
                       ended)

  def settle(self) -> list:
    """Waits for every computation this thread dispatched; the chains of
    failed ones start afresh (:meth:`chains_failed`). Returns the failed
    tokens (a barrier: each failure is its call's, reported by it, see
    ``design/errors.md``)."""
    failed = []
    for token in self.pending():
      if not settled(token):
        failed.append(token)
    if failed:
      ids = {id(t) for t in failed}
      keys = tuple(k for k, t in self.runtime.items() if id(t) in ids)
      for sharding, t in list(self.output.items()):
        if id(t) in ids:
          del self.output[sharding]
      if self.last_token is not None and id(self.last_token) in ids:
        self.last_token = None
      self.joined = [t for t in self.joined if id(t) not in ids]
      self.chains_failed(keys)
    return failed

  def reset(self) -> None:
    self.runtime.clear()
    self.seqs.clear()
    self.at_risk.clear()
    self.joined.clear()
    self.output.clear()
    self.last_sharding = None
    self.last_token = None
    self.fast_mode = None
    self.device_tokens = False


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


_DEVICES_MODES: dict = {}


def devices_mode(mode: str | None) -> str | None:
  """``ThreadTokens.fast_mode`` while the thread holds a token kept on
  devices in ``mode``: the hooks of such tokens run
  (``call_path.fast_dispatch`` of such a token), the others take the general path
  (one object per mode: compared by identity)."""
  if mode is None:
    return None
  found = _DEVICES_MODES.get(mode)
  if found is None:
    found = _DEVICES_MODES.setdefault(mode, mode + " (devices)")
  return found


def thread_state() -> ThreadTokens:
  """This thread's token state (created and registered on first use).

  In a child forked after JAX's backend started, where no computation can
  run, creating one is refused (``fork``)."""
  try:
    return local.state
  except AttributeError:
    if _fork.forked_after_backend:
      raise _fork.refused("a call that runs or waits for effects") from None
    state = local.state = ThreadTokens(threading.current_thread(),
                                       _take_slot())
    _errors.set_thread_slot(state.slot)
    _register(state)
    return state


def _dispatching() -> bool:
  state = getattr(local, "state", None)
  return state is not None and state.dispatching > 0


_errors.set_thread_state_maker(thread_state, _dispatching)


def _placed_initial_token(slot: int) -> jax.Array:
  """An uncommitted ``int32`` scalar holding ``slot`` on the default device,
  put there by an explicit transfer that only it is allowed (the user's own
  transfers stay under the user's guard)."""
  return _placed(_token_value.initial(slot))


def _placed(value) -> jax.Array:
  with jax.transfer_guard_host_to_device("allow"), _compat.no_user_mesh():
    return jax.device_put(value)


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
    state.clear_fast()


def wait_quietly(tokens: Iterable) -> None:
  """Blocks on each of ``tokens``, ignoring failures: each error stays for
  the call or barrier that reports it (``design/errors.md``)."""
  for token in tokens:
    settled(token)


# --- slots and thread lifetime ---------------------------------------------------------
# A ThreadTokens is referenced strongly only by its thread's threading.local, so
# it goes away with its thread: _thread_exited then keeps only the tokens of
# that thread that are still pending (an all-threads barrier and interpreter
# exit wait for them) under its slot, which is freed once they have completed
# and its errors have been reported (_sweep).

#: Called (no arguments) when a thread's state is created, before its first
#: dispatch (``interrupts`` installs its SIGINT handler from the main thread's).
on_new_thread: list[Callable[[], None]] = []
_next_slot = 1
_free_slots: list[int] = []
# Incremented in a forked child: a parent's thread state finalized there is
# not the child's.
_generation = 0
# Slots of ended threads -> their tokens that were pending when they ended.
_ended: dict[int, list] = {}
# Slots of ended threads, and freed slots -> the sequence number their next
# owner's chains start from (ThreadTokens.base): past every one the ended
# thread used, on any chain.
_ended_base: dict[int, int] = {}
_slot_base: dict[int, int] = {}


def _take_slot() -> int:
  global _next_slot
  with _all_lock:
    if not _free_slots and _next_slot > _token_value.MAX_SLOT:
      _sweep_locked(force=True)
    if _free_slots:
      return _free_slots.pop()
    if _next_slot > _token_value.MAX_SLOT:
      raise RuntimeError(
          f"jax_effects: more than {_token_value.MAX_SLOT} threads hold "
          "effects that are not finished (pending computations or "
          "unreported errors): call jax_effects.effects_barrier("
          "all_threads=True) to let ended threads go")
    slot = _next_slot
    _next_slot += 1
    return slot


def orphans() -> list:
  """The pending tokens of exited threads (a copy)."""
  with _all_lock:
    return [t for tokens in _ended.values() for t in tokens]


def all_states() -> list:
  """Every live thread's state (a copy)."""
  with _all_lock:
    return list(_all_states)


def forget(states: list) -> None:
  """Drops exited threads' ``states`` (waited for by an all-threads
  barrier) and frees the slots of ended threads that have nothing left."""
  with _all_lock:
    for state in states:
      _all_states.discard(state)
  sweep()


def _register(state: ThreadTokens) -> None:
  sweep()   # (a thread's first use: an ordinary context)
  for hook in on_new_thread:   # (interrupts: the main thread's first use)
    hook()
  with _all_lock:
    _all_states.add(state)
  weakref.finalize(state, _thread_exited, state.slot, state.output,
                   state.runtime, state.joined, state.seqs, state.base,
                   _generation)


def _thread_exited(slot: int, output: dict, runtime: dict,
                   joined: list, seqs: dict, base: int,
                   generation: int) -> None:
  # A finalizer: it may run inside garbage collection on any thread, so it
  # calls nothing of jax here; what completed is dropped, and the slot
  # freed, later (sweep).
  tokens = [*output.values(), *runtime.values(), *joined]
  output.clear()
  runtime.clear()
  joined.clear()
  lock = _all_lock
  if lock is None or generation != _generation:
    return   # (the interpreter's teardown cleared this module; a fork)
  mask = _token_value.SEQ_MASK
  last = max(seqs.values(), key=lambda s: (s - base) & mask, default=base)
  with lock:
    _ended[slot] = tokens
    # (one more: an execution whose dispatch raised took last + 1 unstored)
    _ended_base[slot] = (last + 1) & mask


def sweep() -> None:
  """Frees the slots of ended threads whose computations have completed and
  whose errors have been reported (an ordinary context: a thread's first
  use, a barrier)."""
  if not _ended:
    return
  with _all_lock:
    _sweep_locked(force=False)


def _sweep_locked(force: bool) -> None:
  for slot, tokens in list(_ended.items()):
    tokens[:] = [t for t in tokens if not _is_done(t)]
    if tokens or _errors.slot_busy(slot):
      continue   # (pending computations, unreported errors: kept)
    del _ended[slot]
    _slot_base[slot] = _ended_base.pop(slot, 0)
    _executions.slot_freed(slot)
    _free_slots.append(slot)


def _is_done(token) -> bool:
  try:
    return token.is_ready()
  except Exception:  # noqa: BLE001 - a failed or deleted array is done
    return True


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child holds no thread state, token or pending computation of
  the parent's (``fork``): its forking thread starts without state (the
  fast hooks hold ``local`` itself, so its entry is removed, not the object
  replaced), the other threads do not exist there, and JAX's own runtime
  tokens of the forking thread stand for the parent's computations too."""
  global _all_lock, _all_states, _next_slot, _generation
  _generation += 1
  for state in list(_all_states):
    state.reset()   # (so no finalizer files the parent's tokens)
  local.__dict__.pop("state", None)
  _all_lock = threading.RLock()
  _all_states = weakref.WeakSet()
  _ended.clear()
  _ended_base.clear()
  _slot_base.clear()
  _free_slots.clear()
  _next_slot = 1
  _compat.clear_jax_runtime_tokens()


def live_thread_states() -> int:
  """How many threads hold token state (for tests: threads that exited do not)."""
  with _all_lock:
    return len(_all_states)


def held_slots() -> int:
  """How many slots ended threads still hold (for tests: bounded)."""
  with _all_lock:
    return len(_ended)
