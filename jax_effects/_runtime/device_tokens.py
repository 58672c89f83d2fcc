"""Runtime tokens kept on their devices, and combined for elsewhere.

A token returned over several devices (a vector, one element per device,
after a ``shard_map`` program; a scalar copied on each, after automatic
partitioning) stays on its devices (:func:`kept_on_devices`) for the next
call over the same devices; any other computation gets one scalar on the
first device (:func:`combine`), ready once every device's effects have run
(``design/placement.md``, "Tokens across devices").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import output as _output
from jax_effects._runtime import token_value as _token_value


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
  return _jax_api.io_callback(_release_and_pass,
                     jax.ShapeDtypeStruct((), _token_value.TOKEN_DTYPE),
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
