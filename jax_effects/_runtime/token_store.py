"""The token store: the tokens a thread's chains hold, and how a call's
returned token is stored.

A thread's :class:`TokenStore` holds, per chain, its latest runtime token
(``runtime``: uncommitted, or kept on its devices) and
sequence number (``seqs``: the host's copy of the device's), and the output
tokens per device set (for the barrier). It changes
only through the methods of the thread's state (one object:
``threads.ThreadTokens``, which reads for a dispatch), but for
``dispatching``, which the call path sets and clears: a call's returned
token is stored by :meth:`TokenStore.update` (:meth:`TokenStore.store` for
the fast hook's one chain), and joins one a call made inside it stored
(``design/errors.md``, "Calls made inside a call").

A token returned over several devices (a vector, one element per device,
after a ``shard_map`` program; a scalar copied on each, after automatic
partitioning) stays on its devices (:func:`kept_on_devices`) for the next
call over the same devices; any other computation gets one scalar on the
first device (:func:`combine`), ready once every device's effects have run
(``design/placement.md``, "Tokens across devices").

Part in the token calling convention: the runtime tokens passed to and
returned by every computation; the contract: ``design/tokens.md``.
"""
from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import output as _output
from jax_effects._runtime import token_value as _token_value

#: Set once jax_effects' interpreter-exit handler has run (``barrier``): a
#: dispatch after it (from an exit handler that runs later) takes the general
#: path, which reports its errors itself (``barrier.report_late``).
after_exit_handler = False


def is_done(token) -> bool:
  """Whether ``token``'s computation has ended (failed or not)."""
  try:
    return token.is_ready()
  except Exception:  # noqa: BLE001 - a failed or deleted array is done
    return True


def settled(token) -> bool:
  """Whether the computation that returned ``token`` ended without failing
  (waits for it). A NumPy initial token was returned by none."""
  if type(token) is not _token_value.TOKEN_DTYPE:
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001 - an XLA failure: its call's (errors.md)
      return False
  return True


def wait_quietly(tokens: Iterable) -> None:
  """Blocks on each of ``tokens``, ignoring failures: each error stays for
  the call or barrier that reports it (``design/errors.md``)."""
  for token in tokens:
    settled(token)


# --- tokens kept on their devices ------------------------------------------

def kept_on_devices(token) -> bool:
  """Whether ``token`` (returned by a computation) stays on its devices for
  the next call of a program over them (:func:`for_sharding`): one element
  per device, or a scalar over several (whose first device's copy is the
  chain's: passing it back whole spares a copy per call)."""
  if isinstance(token, np.generic):
    return False
  return bool(token.ndim) or len(token.sharding.device_set) > 1


def for_sharding(token, sharding):
  """``token`` as the next computation may take it: a token kept on its
  devices as it is only over the same devices (``sharding``: of the token
  the callee returned last time, or None), else one scalar token on the
  first device."""
  if kept_on_devices(token) and (sharding is None
                                 or (token.sharding is not sharding
                                     and token.sharding != sharding)):
    return combine(token) if token.ndim else _compat.uncommitted(token)
  return token


def _release_and_pass(token):
  # Raises nothing (that would fail every later computation given the
  # token): what the deliveries raised goes to the token's thread.
  failures = _output.release_held()
  if failures:
    slot = _token_value.slot_of(int(token))   # (a read from the device: once)
    for exc in failures:
      _errors.defer(exc, slot)
  return token


def _combine(*shards):
  return jnp.max(jnp.concatenate([s.reshape((-1,)) for s in shards]))


def _combine_and_release(*shards):
  # (the callback's result is the token: the next effects follow it)
  return _jax_api.io_callback(
      _release_and_pass, jax.ShapeDtypeStruct((), _token_value.TOKEN_DTYPE),
      _combine(*shards))


_combine_jit = _jax_api.jit(_combine)
_advance_jit = _jax_api.jit(_token_value.advance)
_combine_release_jit = _jax_api.jit(_combine_and_release)


def combine(token):
  """The next runtime token from a per-device token: the elements copied
  to the first device (no collective) and reduced there, uncommitted; in
  the deterministic view the held output is released then (``output``)."""
  shards = [s.data for s in token.addressable_shards]
  fn = _combine_release_jit if _output.holding() else _combine_jit
  # Our own computation, on the token's devices: never the user's mesh.
  with _compat.no_user_mesh():
    moved = jax.device_put(shards, shards[0].device)
    return _compat.uncommitted(fn(*moved))


def advanced(token):
  """``token`` one sequence number on, computed on its devices (so still
  ordered after it); kept there if it was, else uncommitted."""
  with _compat.no_user_mesh():
    out = _advance_jit(token)
  return out if kept_on_devices(token) else _compat.uncommitted(out)


_DEVICES_MODES: dict = {}


def devices_mode(mode: str | None) -> str | None:
  """``TokenStore.fast_mode`` while the thread holds a token kept on
  devices in ``mode``: only the fast hooks of such tokens run (one object
  per mode: compared by identity)."""
  if mode is None:
    return None
  return _DEVICES_MODES.setdefault(mode, mode + " (devices)")


class TokenStore:
  """What a thread's chains hold (module docstring); its output tokens, for
  the barrier: the latest on each device set, and the fast hook's last one,
  filed by the next :meth:`file`."""
  __slots__ = ("output", "last_sharding", "last_token", "runtime", "seqs",
               "at_risk", "verified", "joined", "plain", "device_tokens",
               "fast_mode", "dispatching", "mode", "slot", "base")

  def __init__(self, slot: int, base: int):
    # sharding -> latest output token on that device set (insertion = recency)
    self.output: dict[Any, jax.Array] = {}
    # The sharding of the most recent dispatch's output token, and that token
    # when it is not in ``output`` yet (the fast hook stores it without
    # hashing a sharding).
    self.last_sharding: Any = None
    self.last_token: jax.Array | None = None
    # chain key (Effect) -> uncommitted runtime token (or kept on devices)
    self.runtime: dict[Any, jax.Array] = {}
    # chain key -> the sequence number of its latest token (token_value):
    # the host's copy of what the device computes
    self.seqs: dict[Any, int] = {}
    # chain keys whose computation may fail as a whole (tokens_for)
    self.at_risk: set = set()
    # The token last stored that was ready when its call returned (a failure
    # there was raised by the call): handed on without a check.
    self.verified: Any = None
    # tokens of calls made inside this thread's call in flight (join)
    self.joined: list = []
    self.plain = None
    # True while some runtime token is kept on its devices (kept_on_devices)
    self.device_tokens = False
    # The mode in which the fast hooks may run (devices_mode(mode) while a
    # token is kept on devices); None while anything needs the general
    # path (_refresh_fast): one comparison stands for all those checks.
    self.fast_mode: str | None = None
    # dispatches in progress, counted by the call path (>1: a call from a
    # host callback of the thread's own call); while nonzero a SIGINT is
    # handled by interrupts
    self.dispatching = 0
    # The ordering mode of this thread's last dispatch (switch_mode).
    self.mode: str | None = None
    self.slot = slot
    # where every chain's numbers start (``threads.base_of``)
    self.base = base

  def devices(self) -> dict[Any, jax.Array]:
    """Device -> the latest output token covering it (this process's)."""
    items = list(self.output.items())
    if self.last_token is not None:
      items.append((self.last_sharding, self.last_token))
    return {device: token for sharding, token in items
            for device in sharding.addressable_devices}

  def file(self, token: jax.Array) -> None:
    """Files ``token`` as the latest output token of its device set."""
    output = self.output
    sharding = token.sharding
    last = self.last_token
    if last is not None:
      self.last_token = None
      output.pop(self.last_sharding, None)
      output[self.last_sharding] = last
    if self.last_sharding is not sharding:  # move to the end (recency)
      output.pop(sharding, None)
      self.last_sharding = sharding
    output[sharding] = token

  def drop_outputs(self, ids) -> None:
    """Forgets the output tokens whose ``id`` is in ``ids`` (failed)."""
    for sharding, t in list(self.output.items()):
      if id(t) in ids:
        del self.output[sharding]
    if self.last_token is not None and id(self.last_token) in ids:
      self.last_token = None

  def last_seq(self, key) -> int:
    """The sequence number of ``key``'s latest execution on this thread
    (:attr:`base` before its first)."""
    return self.seqs.get(key, self.base)

  def execution(self, keys) -> tuple:
    """``(seqs, seq)`` of the next execution of ``keys`` (read before its
    dispatch): its identity (chain -> the sequence number) and its returned
    token's sequence number (its carriers' maximum)."""
    seqs = {k: (self.last_seq(k) + 1) & _token_value.SEQ_MASK
            for k in keys if k is not _effects.UNORDERED}
    return seqs, max(seqs.values(), default=None)

  def update(self, keys, token: jax.Array, read: tuple = (),
             at_risk: bool = False, seq: int | None = None) -> None:
    """Records ``token``, returned by one executable given the tokens of
    ``keys`` (``read``: ``tokens_for``'s) as the execution ``seq`` (by
    default read now). ``at_risk``: it runs one of JAX's own callbacks.
    Raises nothing."""
    self.file(token)
    if keys:
      if kept_on_devices(token):
        if _output.holding():
          runtime = combine(token)
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
          if runtime is token and not self.device_tokens and is_done(token):
            self.verified = runtime   # (see verified)
          if at_risk:
            risky.add(key)
          elif risky:
            risky.discard(key)
    self._refresh_fast()

  def store(self, key, token: jax.Array, sharding, passed, seq: int,
            kept: bool = False, ended: bool = False) -> None:
    """:meth:`update` for the fast hook's one chain ``key``, written out (no
    sharding hashed) when nothing changed since ``passed`` was read.
    ``kept``: the token is kept on devices; ``ended``: it may be handed on
    unchecked (:attr:`verified`: ready when the call returned, or waited
    for by ``launch_lock.finish`` and ended without failing)."""
    runtime = self.runtime
    if (sharding is not self.last_sharding or runtime.get(key) is not passed
        or self.device_tokens is not kept
        or (kept and (sharding is not passed.sharding or _output.holding()))):
      self.update((key,), token, (passed,), seq=seq)
      return
    self.last_token = token
    stored = token
    if not kept and _compat.committed(token):
      stored = _compat.uncommitted(token)
    runtime[key] = stored
    if ended:
      self.verified = stored   # (see verified)
    self.seqs[key] = seq

  def _kept_meanwhile(self, key, passed, runtime, seq) -> bool:
    """Whether what a call made inside this one left for ``key`` stays: the
    later of the two by sequence number is kept (no token if that call
    failed: the chain starts afresh past both), the other joined."""
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
    # (a token at risk is handed on only by the general path: tokens_for)
    if self.joined or self.at_risk or after_exit_handler:
      self.fast_mode = None
    else:
      # A set_ordering by another thread meanwhile cleared fast_mode, which
      # must not be undone (read after the store: it sets the mode first).
      mode = self.mode
      self.fast_mode = devices_mode(mode) if self.device_tokens else mode
      if _effects.get_ordering() != mode:
        self.fast_mode = None

  def join(self, token) -> None:
    """A call made inside this thread's call in progress stored ``token``:
    the next dispatch waits for it."""
    self.joined.append(token)
    self.fast_mode = None

  def join_plain(self, token) -> None:
    """A plain ``jax.jit`` call of this thread launched ordered effects of
    ours (``token``: JAX's runtime token of ``PLAIN_JIT_ORDER``): the next
    dispatch waits for it. Only the latest is kept (each waited for the
    one before it)."""
    previous, self.plain = self.plain, token
    if previous is not None:
      self.joined = [t for t in self.joined if t is not previous]
    self.join(token)

  def store_interrupted(self, keys, token, read=(),
                        at_risk: bool = False,
                        seq: int | None = None) -> None:
    """:meth:`update` after an interrupt landed between the dispatch and
    it (the computation runs anyway); if storing fails, waits for it."""
    try:
      self.update(keys, token, read, at_risk, seq)
    except BaseException:  # noqa: BLE001 - a second interrupt: wait instead
      wait_quietly((token,))

  def chains_failed(self, keys) -> None:
    """The computation holding ``keys``' tokens failed as a whole: those
    chains start afresh, what it held on the host is freed
    (``executions.failed``)."""
    ended = True
    for key in keys:
      token = self.runtime.pop(key, None)
      if token is not None and kept_on_devices(token):
        ended = False
    self.fast_mode = None
    _executions.failed(self.slot, {k: self.last_seq(k) for k in keys}, ended)

  def reset(self) -> None:
    self.output.clear()
    self.last_sharding = None
    self.last_token = None
    self.runtime.clear()
    self.seqs.clear()
    self.at_risk.clear()
    self.joined.clear()
    self.plain = None
    self.fast_mode = None
    self.device_tokens = False
