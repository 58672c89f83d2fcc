"""Per-thread token state: each Python thread's chains, read for each dispatch.

Each Python thread has its own streams, so threads never wait for each
other: its :class:`ThreadTokens` (made on first use, :func:`thread_state`)
holds its chains' runtime tokens and output tokens (``token_store``, where
a call's returned token is stored) and hands them to each dispatch
(:meth:`ThreadTokens.tokens_for`).

* **A failed token is never handed on** (``design/errors.md``): a
  computation that failed as a whole (an XLA failure: the call's results
  carry it, as under ``jax.jit``) ends its chain's lineage: the next
  computation starts the chain afresh, and what the failed execution held
  on the host is freed (``executions.failed``). A token still in flight is
  handed on (the device orders the computations) unless its computation
  may fail (it runs JAX's own callbacks): then the dispatch waits for it.
* A thread's state goes with the thread; its slot and pending tokens are
  kept until they are done (``thread_slots``).

Part in the token calling convention: the runtime tokens each computation
is passed (``token_value``); the call path that uses this module is
``_dispatch.call_path``; the contract: ``design/tokens.md``,
``design/errors.md``.
"""
from __future__ import annotations

import threading
from typing import Any
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._runtime import device_tokens as _device_tokens
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import thread_slots as _thread_slots
from jax_effects._runtime import token_store as _token_store
from jax_effects._runtime import token_value as _token_value


class ThreadTokens(_token_store.TokenStore):
  """The token state of one Python thread (see the module docstring): the
  chains' tokens (``token_store.TokenStore``, which stores a call's returned
  token), read for each dispatch here."""
  __slots__ = ("initial", "thread", "__weakref__")

  def __init__(self, thread: threading.Thread, slot: int):
    super().__init__(slot, _thread_slots.base_of(slot))
    self.initial: Any = None
    self.thread = weakref.ref(thread)

  def pending(self) -> list[jax.Array]:
    return [*self.outputs(), *self.runtime.values(), *self.joined]

  def begin_dispatch(self) -> None:
    self.dispatching += 1

  def end_dispatch(self) -> None:
    self.dispatching -= 1

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
    """Waits until the computations holding ``keys``' tokens have ended
    (an eager effect runs after them); a failed one's chain starts afresh."""
    if self.joined:
      self._wait_joined()
    failed = tuple(k for k in keys if k in self.runtime
                   and not _token_store.settled(self.runtime[k]))
    if failed:
      self.chains_failed(failed)

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
      _token_store.settled(token)   # (a failure is the joined call's own)

  def switch_mode(self, mode: str) -> None:
    """Called before a dispatch in a mode other than the thread's last one.

    The two modes use different runtime-token streams, so nothing would order
    this dispatch after the thread's earlier ones, which may still be in flight
    (a ``set_ordering`` from another thread lands between any two calls): wait
    for them first. Switches are rare; the common path is one comparison.
    """
    if self.mode is not None:
      _token_store.wait_quietly(self.pending())
    self.mode = mode

  def settle(self) -> list:
    """Waits for every computation this thread dispatched; the chains of
    failed ones start afresh (:meth:`chains_failed`). Returns the failed
    tokens (a barrier: each failure is its call's, reported by it, see
    ``design/errors.md``)."""
    failed = []
    for token in self.pending():
      if not _token_store.settled(token):
        failed.append(token)
    if failed:
      ids = {id(t) for t in failed}
      keys = tuple(k for k, t in self.runtime.items() if id(t) in ids)
      self.drop_outputs(ids)
      self.joined = [t for t in self.joined if id(t) not in ids]
      self.chains_failed(keys)
    return failed

  def mark_at_risk(self, keys) -> None:
    """The computation that returned ``keys``' tokens may fail as a whole
    (learnt by its own trace, after its dispatch: see :meth:`tokens_for`)."""
    self.at_risk.update(k for k in keys if k is not _effects.UNORDERED)
    self._refresh_fast()

  def clear_fast(self) -> None:
    """The thread's mode changed: its next dispatch takes the general path."""
    self.fast_mode = None


local = threading.local()


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
                                       _thread_slots.take_slot())
    _errors.set_thread_slot(state.slot)
    _thread_slots.register(state)
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
    states = _thread_slots.all_states()
  else:
    state = getattr(local, "state", None)
    states = [] if state is None else [state]
  for state in states:
    state.clear_fast()


@_fork.reset_in_child
def _forget_forking_thread() -> None:
  """A forked child's forking thread starts without state (``fork``; the
  fast hooks hold ``local`` itself, so its entry is removed, not the object
  replaced)."""
  local.__dict__.pop("state", None)
