"""Runtime tokens kept on their devices, and combined for elsewhere.

After a per-device (``shard_map``) program the returned token is a vector,
one element per device (each device's chain); after a program whose effects
ran once over several devices it is a scalar copied on each of them (the
first device's copy is the chain's). Either stays on its devices
(:func:`kept_on_devices`) as the next runtime token of a call over the same
devices, so that call continues each device's chain with no copy; any other
computation gets one scalar on the first device (:func:`combine`), ready
only once every device's effects have run. In the deterministic view the
held per-device output is released at that point (``output``).
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
  the next call of a program over them (:func:`for_sharding`).

  So does one element per device (a ``shard_map`` program: each device's
  chain) and a scalar over several devices (automatic partitioning: its
  effects ran once, on the first device, whose copy is the chain's; the
  others' copies are stale, see ``first_device.on_first_device``, and only
  that program's devices other than the first read them, to pass them
  through). Passing it back whole spares copying the first device's copy to
  the others before every call (a third of a call on 8 CPU devices). A
  thread's initial token (a NumPy scalar) is on no device.
  """
  if isinstance(token, np.generic):
    return False
  return bool(token.ndim) or len(token.sharding.device_set) > 1



def for_sharding(token, sharding):
  """``token`` as the next computation may take it.

  A token kept on its devices (:func:`kept_on_devices`) can be handed as it
  is only to a computation over the same devices (``sharding``: that of the
  token the callee returned last time, or None). Any other computation gets
  one scalar token on the first device: one element per device combined
  (:func:`combine`), or of a scalar the first device's copy
  (``_compat.uncommitted``). Other tokens are returned as they are. (The
  thread's state stores what this returns: ``threads.ThreadTokens``.)
  """
  if kept_on_devices(token) and (sharding is None
                                 or (token.sharding is not sharding
                                     and token.sharding != sharding)):
    return combine(token) if token.ndim else _compat.uncommitted(token)
  return token


def _release_and_pass(token):
  # Raises nothing (a failure here would fail the computation, and every
  # later one given its token): what the deliveries raised goes to the
  # thread whose slot the token holds, for its next call or barrier.
  failures = _output.release_held()
  if failures:
    slot = _token_value.slot_of(int(token))
    for exc in failures:
      _errors.defer(exc, slot)
  return token


def _combine(*shards):
  return jnp.max(jnp.concatenate([s.reshape((-1,)) for s in shards]))


def _combine_and_release(*shards):
  # The callback's result is the token: the next dispatch's effects follow
  # the release.
  return _jax_api.io_callback(_release_and_pass,
                     jax.ShapeDtypeStruct((), _token_value.TOKEN_DTYPE),
                     _combine(*shards))


_combine_jit = _jax_api.jit(_combine)
_advance_jit = _jax_api.jit(_token_value.advance)
_combine_release_jit = _jax_api.jit(_combine_and_release)


def combine(token):
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




def advanced(token):
  """``token`` one sequence number on (``token_value.advance``), computed
  on its devices once it is ready (so a computation given it still follows
  the one that returned it); kept on its devices if it was
  (:func:`kept_on_devices`), else uncommitted."""
  with _compat.no_user_mesh():
    out = _advance_jit(token)
  return out if kept_on_devices(token) else _compat.uncommitted(out)
