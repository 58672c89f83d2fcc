"""Per-thread token state: each Python thread's chains, read for each dispatch.

Each Python thread has its own streams, so threads never wait for each
other: its :class:`ThreadTokens` (made on first use, :func:`thread_state`)
holds its chains' tokens (``token_store``, where a call's returned token is
stored) and hands them to each dispatch (:meth:`ThreadTokens.tokens_for`);
a failed token is never handed on (``design/errors.md``). A thread's state
goes with the thread. :func:`runtime_tokens` (public API) is a read-only
snapshot of the calling thread's tokens.

A thread's *slot* (its number in every token it dispatches,
``token_value``) is taken from a bounded pool (:func:`take_slot`) when its
state is made. The state goes with its thread (only its
``threading.local`` holds it strongly); :func:`_thread_exited` keeps the
thread's pending tokens (:func:`orphans`), and the slot is freed once they
have completed and its errors have been reported (:func:`sweep`). A freed
slot's next owner starts its chains past every sequence number the ended
thread used (:func:`base_of`): ``design/errors.md``, "Thread exit".

Part in the token calling convention: the runtime tokens each computation
is passed (``token_value``), by ``_dispatch.call_path``; the slot half of
every runtime token and carrier; the contract: ``design/tokens.md``,
``design/errors.md``.
"""
from __future__ import annotations

import dataclasses
import threading
import types
from typing import Any, Callable, Mapping
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import token_store as _token_store
from jax_effects._runtime import token_value as _token_value


class ThreadTokens(_token_store.TokenStore):
  """The token state of one Python thread (module docstring)."""
  __slots__ = ("initial", "thread", "python_thread", "__weakref__")

  def __init__(self, thread: threading.Thread, slot: int):
    super().__init__(slot, base_of(slot))
    self.initial: Any = None
    self.thread = weakref.ref(thread)
    #: Started by Python, not one of XLA's (where host callbacks run).
    self.python_thread = _placement.python_thread(thread)

  def pending(self) -> list[jax.Array]:
    last = () if self.last_token is None else (self.last_token,)
    return [*self.output.values(), *last, *self.runtime.values(),
            *self.joined]

  def alive(self) -> bool:
    thread = self.thread()
    return thread is not None and thread.is_alive()

  def initial_token(self) -> np.ndarray | jax.Array:
    """The token of a stream that has had no effect yet in this thread: a
    NumPy scalar, copied by ``jax.jit``'s dispatch (a ``jax.Array`` made
    here would wait behind other threads' work on the default device);
    under a transfer guard, placed once (:func:`_placed`) and kept."""
    token = self.initial
    if token is None:
      token = self.initial = _token_value.initial(self.slot)
    if (type(token) is _token_value.TOKEN_DTYPE
        and _compat.host_transfers_guarded()):
      token = self.initial = _placed(token)
    return token

  def tokens_for(self, keys, device_sharding, nested: bool = False) -> tuple:
    """``(tokens, read)``: the runtime tokens of ``keys`` for the next
    computation, and those read for them (for :meth:`update`). A failed
    token is never handed on; one still running is, unless it is
    :attr:`at_risk` (``design/errors.md``). ``device_sharding``:
    ``token_store.for_sharding``'s; ``nested``: :meth:`_past_outer`."""
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
          (key in self.at_risk or _token_store.is_done(token))
          and not _token_store.settled(token)):
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
    """Waits for the computations holding ``keys``' tokens (an eager
    effect); a failed one's chain starts afresh."""
    if self.joined:
      self._wait_joined()
    failed = tuple(k for k in keys if k in self.runtime
                   and not _token_store.settled(self.runtime[k]))
    if failed:
      self.chains_failed(failed)

  def _fresh(self, key):
    """A token of ``key``'s chain that no computation returned (the slot and
    the chain's current sequence number)."""
    seq = self.last_seq(key)
    if not seq:
      return self.initial_token()
    value = _token_value.initial(self.slot) | _token_value.TOKEN_DTYPE(
        seq << _token_value.SEQ_SHIFT)
    return _placed(value) if _compat.host_transfers_guarded() else value

  def _past_outer(self, key, token):
    """The token of ``key`` for a call from a host callback of this
    thread's call in flight, which took ``token``: the inner call is
    another execution, so ``token`` one sequence number on (computed on
    its devices, after it), and the host's copy follows."""
    self.seqs[key] = (self.last_seq(key) + 1) & _token_value.SEQ_MASK
    if isinstance(token, jax.Array):
      return _token_store.advanced(token)
    return self._fresh(key)   # (an initial token: no computation to follow)

  def _for_sharding(self, keys, tokens, sharding) -> list:
    """``tokens`` through ``token_store.for_sharding``, stored back."""
    out = []
    kept = False   # (one of them stays kept on devices: device_tokens holds)
    for key, token in zip(keys, tokens):
      moved = _token_store.for_sharding(token, sharding)
      if moved is not token:
        self.runtime[key] = moved
      elif not kept:
        kept = _token_store.kept_on_devices(token)
      out.append(moved)
    if not kept:
      self.device_tokens = any(_token_store.kept_on_devices(t)
                               for t in self.runtime.values())
    return out

  def _wait_joined(self) -> None:
    joined, self.joined = self.joined, []
    _token_store.wait_quietly(joined)   # (a failure is the joined call's own)

  def switch_mode(self, mode: str) -> None:
    """Before a dispatch in another mode than the thread's last: waits for
    the earlier ones (the modes' streams do not order each other)."""
    if self.mode is not None:
      _token_store.wait_quietly(self.pending())
    self.mode = mode

  def settle(self) -> list:
    """Waits for every computation this thread dispatched; the chains of
    failed ones start afresh. Returns the failed tokens."""
    failed = [t for t in self.pending() if not _token_store.settled(t)]
    if failed:
      ids = {id(t) for t in failed}
      keys = tuple(k for k, t in self.runtime.items() if id(t) in ids)
      self.drop_outputs(ids)
      self.joined = [t for t in self.joined if id(t) not in ids]
      self.chains_failed(keys)
    return failed

  def mark_at_risk(self, keys) -> None:
    """The computation that returned ``keys``' tokens may fail as a whole
    (learnt by its trace, after its dispatch)."""
    self.at_risk.update(k for k in keys if k is not _effects.UNORDERED)
    self._refresh_fast()


# --- slots and thread lifetime ---------------------------------------------

# Reentrant: a thread-exit finalizer (_thread_exited) may run from garbage
# collection in a thread that holds it.
_all_lock = threading.RLock()
# every live thread's state (weakly: a thread's state goes with the thread)
_all_states: "weakref.WeakSet" = weakref.WeakSet()

#: Called (no arguments) when a thread's state is created, before its first
#: dispatch (``interrupts`` installs its SIGINT handler from the main's).
on_new_thread: list[Callable[[], None]] = []
_next_slot = 1
_free_slots: list[int] = []
# Incremented in a forked child: a parent's thread state finalized there is
# not the child's.
_generation = 0
# Slots of ended threads -> (their tokens that were pending when they
# ended, where the slot's next owner's chains start).
_ended: dict[int, tuple] = {}
# Freed slots -> where their next owner's chains start (:func:`base_of`).
_slot_base: dict[int, int] = {}


def base_of(slot: int) -> int:
  """The sequence number the chains of the next owner of ``slot`` start
  from (taken once)."""
  return _slot_base.pop(slot, 0)


def take_slot() -> int:
  global _next_slot
  with _all_lock:
    if not _free_slots and _next_slot > _token_value.MAX_SLOT:
      sweep()
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
    return [t for tokens, _ in _ended.values() for t in tokens]


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
    # (one more: an execution whose dispatch raised took last + 1 unstored)
    _ended[slot] = (tokens, (last + 1) & mask)


def sweep() -> None:
  """Frees the slots of ended threads whose computations have completed and
  whose errors have been reported (from an ordinary context)."""
  if not _ended:
    return
  with _all_lock:
    for slot, (tokens, base) in list(_ended.items()):
      tokens[:] = [t for t in tokens if not _token_store.is_done(t)]
      if tokens or _errors.has_deferred(slot):
        continue   # (pending computations, unreported errors: kept)
      del _ended[slot]
      _slot_base[slot] = base
      _executions.slot_freed(slot)
      _free_slots.append(slot)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """Nothing of the parent's, JAX's own runtime tokens included; the
  forking thread starts without state (its entry goes: the fast hooks hold
  ``local`` itself)."""
  global _all_lock, _all_states, _next_slot, _generation
  _generation += 1
  for state in list(_all_states):
    state.reset()   # (so no finalizer files the parent's tokens)
  _all_lock = threading.RLock()
  _all_states = weakref.WeakSet()
  _ended.clear()
  _slot_base.clear()
  _free_slots.clear()
  _next_slot = 1
  _compat.clear_jax_runtime_tokens()
  local.__dict__.pop("state", None)


def held_slots() -> int:
  """How many slots ended threads still hold (for tests: bounded)."""
  with _all_lock:
    return len(_ended)


local = threading.local()


def thread_state() -> ThreadTokens:
  """This thread's token state (created and registered on first use;
  refused in a child forked after JAX's backend started)."""
  try:
    return local.state
  except AttributeError:
    if _fork.forked_after_backend:
      raise _fork.refused("a call that runs or waits for effects") from None
    state = local.state = ThreadTokens(threading.current_thread(),
                                       take_slot())
    _errors.set_thread_slot(state.slot)
    sweep()   # (a thread's first use: an ordinary context)
    for hook in on_new_thread:   # (interrupts: the main thread's first use)
      hook()
    with _all_lock:
      _all_states.add(state)
    weakref.finalize(state, _thread_exited, state.slot, state.output,
                     state.runtime, state.joined, state.seqs, state.base,
                     _generation)
    return state


def states(all_threads: bool) -> list:
  """This thread's state, if it has one (every thread's with
  ``all_threads``)."""
  if all_threads:
    return all_states()
  state = getattr(local, "state", None)
  return [] if state is None else [state]


def _dispatching() -> bool:
  state = getattr(local, "state", None)
  return state is not None and state.dispatching > 0


_errors.set_thread_state_maker(thread_state, _dispatching)


def _placed(value) -> jax.Array:
  """``value`` uncommitted on the default device, by a transfer allowed for
  it alone (the user's own stay under the user's guard)."""
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
  ``all_threads``) changed: their next dispatch takes the general path."""
  for state in states(all_threads):
    state.fast_mode = None


# --- runtime_tokens(): the public, read-only snapshot ---------------------

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
  exactly one entry, ``GLOBAL`` (the initial token if no global-mode call
  has run yet). In ``"per_effect"`` mode it lists every stream this thread
  has used (``GLOBAL`` too, after a global block).
  """
  state = thread_state()
  if _effects.get_ordering() == "global":
    token = state.runtime.get(_effects.GLOBAL)
    if token is None:   # (a jax.Array, as every other token in the snapshot)
      token = as_array(state.initial_token())
    effects = {_effects.GLOBAL: token}
  else:
    effects = dict(state.runtime)
  return RuntimeTokens(types.MappingProxyType(effects),
                       types.MappingProxyType(state.devices()))
