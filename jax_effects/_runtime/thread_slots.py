"""Thread slots and lifetime: which threads hold token state, and their slots.

A thread's *slot* (its number in every token it dispatches,
``token_value``) is taken from a bounded pool (:func:`take_slot`) when its
state is made. The state goes with its thread (only its
``threading.local`` holds it strongly); :func:`_thread_exited` keeps the
thread's pending tokens (:func:`orphans`), and the slot is freed once they
have completed and its errors have been reported (:func:`sweep`). A freed
slot's next owner starts its chains past every sequence number the ended
thread used (:func:`base_of`): ``design/errors.md``, "Thread exit".

Part in the token calling convention: the slot half of every runtime token
and carrier.
"""
from __future__ import annotations

import threading
from typing import Callable
import weakref

from jax_effects import _compat
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import token_store as _token_store
from jax_effects._runtime import token_value as _token_value

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
# Slots of ended threads -> their tokens that were pending when they ended.
_ended: dict[int, list] = {}
# Slots of ended threads, and freed slots -> where their next owner's
# chains start (:func:`base_of`).
_ended_base: dict[int, int] = {}
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


def register(state) -> None:
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
  whose errors have been reported (from an ordinary context)."""
  if not _ended:
    return
  with _all_lock:
    for slot, tokens in list(_ended.items()):
      tokens[:] = [t for t in tokens if not _token_store.is_done(t)]
      if tokens or _errors.has_deferred(slot):
        continue   # (pending computations, unreported errors: kept)
      del _ended[slot]
      _slot_base[slot] = _ended_base.pop(slot, 0)
      _executions.slot_freed(slot)
      _free_slots.append(slot)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """Nothing of the parent's, JAX's own runtime tokens included."""
  global _all_lock, _all_states, _next_slot, _generation
  _generation += 1
  for state in list(_all_states):
    state.reset()   # (so no finalizer files the parent's tokens)
  _all_lock = threading.RLock()
  _all_states = weakref.WeakSet()
  _ended.clear()
  _ended_base.clear()
  _slot_base.clear()
  _free_slots.clear()
  _next_slot = 1
  _compat.clear_jax_runtime_tokens()


def held_slots() -> int:
  """How many slots ended threads still hold (for tests: bounded)."""
  with _all_lock:
    return len(_ended)
