"""JAX's own callbacks and functions: adopted, or called as JAX's.

Part in the token calling convention: none of its own; the pass adopts
JAX's host-callback primitives, whose host side (``_frontends.adopted_host``)
gives the user's function what JAX's impls give it.
"""
from __future__ import annotations

from jax._src import callback as _callback
from jax._src.lib import xla_client as _xc
from jax_effects._compat.versions import JAX_VERSION

# JAX's functions jax_effects calls and also offers a drop-in for, taken
# from their defining modules so that they stay JAX's when a user replaces
# the public names (``jax.jit = jax_effects.jit``; ``design/thirdparty.md``).
# The public names are these objects on JAX 0.8-0.12.
from jax._src.api import effects_barrier as jax_effects_barrier  # noqa: E402
from jax._src.api import jit as jax_jit  # noqa: E402
from jax._src.callback import io_callback as jax_io_callback  # noqa: E402
from jax._src.debugging import (  # noqa: E402
    debug_callback as jax_debug_callback)

from jax._src.callback import io_callback_p  # noqa: E402
from jax._src.callback import IOEffect
from jax._src.callback import OrderedIOEffect
# The jax_disable_jit flag's state: ``.value`` without the attribute lookup
# of ``jax.config.jax_disable_jit`` (read on every dispatch). JAX 0.8-0.12.
from jax._src.config import disable_jit as disable_jit_flag  # noqa: E402
# JAX's host-callback primitives and their effect types, adopted by the pass
# (``_pass.token_pass``): no public handle. JAX 0.8-0.12.
from jax._src.debugging import debug_callback_p  # noqa: E402
from jax._src.debugging import debug_print_p
from jax._src.debugging import DebugEffect
from jax._src.debugging import OrderedDebugEffect


# What JAX's impls set around a callback, for the adopted host side to set
# without their per-call overhead (``device_put`` ~30 us, ``with`` blocks
# ~4 us): the CPU device as ``jax_default_device`` and, for
# ``debug_callback_impl`` (and 0.12's ``io_callback_impl``), no mesh.
from jax._src import config as _config  # noqa: E402
from jax._src import debugging as _debugging  # noqa: E402
from jax._src import mesh as _mesh  # noqa: E402

#: The loggers of JAX's ``jax.debug`` callbacks and of its ``io_callback``.
debugging_logger = _debugging.logger
callback_logger = _callback.logger

#: ``jax_default_device``'s thread-local state: ``swap_local(value)`` sets
#: it and returns what ``set_local`` restores (JAX's ``with`` block's swap).
default_device_setting = _config.default_device
# The mesh states are ``jax._src.config``'s on JAX 0.8-0.10, ``mesh``'s
# from 0.11.
_mesh_states = _config if hasattr(_config, "device_context") else _mesh
#: Whether ``io_callback_impl`` also clears the meshes (JAX 0.12 on).
IO_CALLBACK_CLEARS_MESHES = JAX_VERSION >= (0, 12)
#: ``((state, value), ...)``: no concrete and no abstract mesh.
NO_MESH_SETTINGS = ((_mesh_states.device_context, _mesh.empty_concrete_mesh),
                    (_mesh_states.abstract_mesh_context_manager,
                     _mesh.empty_abstract_mesh))


def debug_callback_parts(flat_callback):
  """``(callback, in_tree, static_args)`` from the closure of the flat
  callback ``jax.debug.callback`` binds (``_flat_callback``, JAX
  0.8-0.12), or None for any other callable."""
  code = getattr(flat_callback, "__code__", None)
  closure = getattr(flat_callback, "__closure__", None)
  if (code is None or closure is None or code.co_name != "_flat_callback"
      or set(code.co_freevars) != {"callback", "in_tree", "static_args"}):
    return None
  cells = dict(zip(code.co_freevars, closure))
  try:
    parts = (cells["callback"].cell_contents, cells["in_tree"].cell_contents,
             cells["static_args"].cell_contents)
  except ValueError:   # an empty cell
    return None
  return parts if isinstance(parts[2], dict) else None


def io_callback_parts(flat_callback):
  """``(callback, in_tree)`` of io_callback's flat callback (a
  ``_FlatCallback``, JAX 0.8-0.12), or None for another callable."""
  if type(flat_callback) is not _callback._FlatCallback:
    return None
  return flat_callback.callback_func, flat_callback.in_tree


#: ``batched_device_put(aval, sharding, [x], [device], True)``: NumPy ``x``
#: as the committed ``jax.Array`` ``jax.device_put(x, device)`` returns, by
#: the C++ call it ends in (~3 us instead of ~30 us). JAX 0.8-0.12.
batched_device_put = _xc.batched_device_put


# The Ref effect type: no public handle. JAX 0.8-0.12.
from jax._src.state.types import RefEffect  # noqa: E402


def refused_by_jax_in_batched_cond(effect) -> bool:
  """Whether JAX's vmap rule of ``cond`` refuses ``effect`` in a branch
  whose predicate is batched (a cond holding one is left to JAX's rule and
  its error: ``_primitives.effect``)."""
  return isinstance(effect, (IOEffect, OrderedIOEffect, RefEffect))


# Program order across ordered-effect kinds under plain ``jax.jit``
# (``_primitives.host_target``): from JAX 0.10 an uncacheable lowering rule
# is given every ordered effect's compiler token of its region (0.8/0.9: its
# own only). JAX's ordered callbacks' rules are read from the registries
# behind ``mlir.register_lowering`` (no public getter; JAX 0.10-0.12) and
# registered again, wrapped and uncacheable (``debug_callback_p``'s CPU/GPU
# rules are cached otherwise: a cached rule sees its own token only), by
# ``lowering.wrap_lowerings``.
from jax_effects._compat.lowering import wrap_lowerings  # noqa: E402

RULES_SEE_EVERY_TOKEN = JAX_VERSION >= (0, 10)


def jax_callback_is_ordered(params) -> bool:
  """Whether an ``io_callback_p`` or ``debug_callback_p`` equation with
  ``params`` is ordered (their params: ``ordered``; ``effect``)."""
  return (params.get("ordered") is True
          or isinstance(params.get("effect"), OrderedDebugEffect))


def wrap_jax_callback_lowerings(wrap) -> None:
  """Registers ``wrap(rule)`` (uncacheable) for each lowering rule (every
  platform's) of ``io_callback_p`` and ``debug_callback_p``, once
  (``lowering.wrap_lowerings``: an ``ImportError`` naming the JAX where
  its internals changed shape)."""
  wrap_lowerings((io_callback_p, debug_callback_p),
                 lambda prim, rule: wrap(rule), cacheable=False)
