"""JAX's own callbacks and functions: adopted, or called as JAX's.

JAX's host-callback primitives and effect types (adopted by the pass), the
functions jax_effects also offers a drop-in for (taken from the modules that
define them), and what JAX's impls set around a user's callback (for the
adopted host side). Part in the token calling convention: none of its own
(``jax_effects._compat``).
"""
from __future__ import annotations

from jax._src import callback as _callback
from jax._src.lib import xla_client as _xc
from jax_effects._compat.versions import JAX_VERSION

# JAX's own functions that jax_effects calls and that it also offers a
# drop-in for: ``jit`` (``jax.jit``), ``effects_barrier``
# (``jax.effects_barrier``), ``io_callback`` and ``debug_callback``
# (``jax.experimental.io_callback``, ``jax.debug.callback``). A user may
# replace the public names by jax_effects' (``jax.jit = jax_effects.jit``),
# even before jax_effects is imported (a wrapper that imports it lazily):
# taken from the modules that define them, these stay JAX's, so jax_effects
# never calls itself through them (``_jax_api``). The public names are these
# very objects on JAX 0.8-0.12.
from jax._src.api import effects_barrier as jax_effects_barrier  # noqa: E402
from jax._src.api import jit as jax_jit  # noqa: E402
from jax._src.callback import io_callback as jax_io_callback  # noqa: E402
from jax._src.debugging import (  # noqa: E402
    debug_callback as jax_debug_callback)

from jax._src.callback import io_callback_p  # noqa: E402
from jax._src.callback import IOEffect
from jax._src.callback import OrderedIOEffect
# The jax_disable_jit flag's state object: ``.value`` reads it without the
# attribute lookup of ``jax.config.jax_disable_jit`` (on every dispatch).
from jax._src.config import disable_jit as disable_jit_flag  # noqa: E402
# JAX's own host-callback primitives, adopted by the token-threading pass
# (``_pass.adopted``): ``jax.debug.callback`` binds ``debug_callback_p``,
# ``jax.debug.print``/``log`` bind ``debug_print_p``,
# ``jax.experimental.io_callback`` binds ``io_callback_p``. No public handle
# on the primitives, their effect types (``jax.debug`` exports only the debug
# ones). JAX 0.8-0.12.
from jax._src.debugging import debug_callback_p  # noqa: E402
from jax._src.debugging import debug_print_p
from jax._src.debugging import DebugEffect
from jax._src.debugging import OrderedDebugEffect


# The host side of adopted callbacks (``_frontends.adopted_host``) gives the user's
# function what JAX's impls of these primitives give it, without their
# per-call Python overhead (``api.device_put`` of the operands is ~30 us a
# call; the three ``with`` blocks ~4 us), so adopted callbacks run at
# jax_effects' speed. JAX 0.8-0.10 all do the same (``debug_callback_impl``:
# operands ``device_put`` to the first CPU device, the callback run with that
# device as ``jax_default_device`` and no concrete or abstract mesh;
# ``io_callback_impl``: the same, with only the default device set; a failing
# callback logged by the module's ``logger`` before it propagates). JAX
# 0.11 does the same; 0.12's ``io_callback_impl`` also clears the meshes
# (``IO_CALLBACK_CLEARS_MESHES``).
from jax._src import config as _config  # noqa: E402
from jax._src import debugging as _debugging  # noqa: E402
from jax._src import mesh as _mesh  # noqa: E402

#: The loggers of JAX's ``jax.debug.callback``/``print``/``log`` and of its
#: ``io_callback`` (``jax.debug.log`` records go to the first).
debugging_logger = _debugging.logger
callback_logger = _callback.logger

#: ``jax_default_device``'s thread-local state: JAX's impls set it to the
#: CPU device around the user's function. ``swap_local(value)`` sets it and
#: returns what ``set_local`` restores: the swap JAX's ``with`` block makes
#: (the state has no update hook), without its context-manager objects.
default_device_setting = _config.default_device
#: ``((state, value), ...)``: what ``debug_callback_impl`` also sets (no
#: concrete and no abstract mesh), swapped the same way.
# The concrete and abstract mesh states are ``jax._src.config``'s
# ``device_context`` and ``abstract_mesh_context_manager`` on JAX 0.8-0.10,
# ``jax._src.mesh``'s (same names) from 0.11.
_mesh_states = _config if hasattr(_config, "device_context") else _mesh
#: Whether ``io_callback_impl`` also runs the callback with no concrete or
#: abstract mesh (JAX 0.12 on; 0.8-0.11 set only the default device).
IO_CALLBACK_CLEARS_MESHES = JAX_VERSION >= (0, 12)
NO_MESH_SETTINGS = ((_mesh_states.device_context, _mesh.empty_concrete_mesh),
                    (_mesh_states.abstract_mesh_context_manager,
                     _mesh.empty_abstract_mesh))

def debug_callback_parts(flat_callback):
  """``(callback, in_tree, static_args)`` of the flat callback
  ``jax.debug.callback`` binds (its closure: ``_flat_callback`` merges
  ``static_args``, a dict position -> value, into the flat arguments,
  unflattens them with ``in_tree`` to ``(args, kwargs)`` and calls
  ``callback``; JAX 0.8-0.12), or None for any other callable (one bound
  to ``debug_callback_p`` directly): then it is called as it is."""
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
  if not isinstance(parts[2], dict):
    return None
  return parts


def io_callback_parts(flat_callback):
  """``(callback, in_tree)`` of io_callback's flat callback (a
  ``_FlatCallback``: unflattens with ``in_tree``, calls ``callback_func``,
  returns the leaves of its result; JAX 0.8-0.12), or None for another
  callable."""
  if type(flat_callback) is not _callback._FlatCallback:
    return None
  return flat_callback.callback_func, flat_callback.in_tree


#: ``batched_device_put(aval, sharding, [x], [device], True)``: ``x`` (a
#: NumPy array of ``aval``'s shape and dtype, ``aval`` not weakly typed) as
#: the committed ``jax.Array`` on ``device`` (``sharding``: its
#: ``SingleDeviceSharding``) that ``jax.device_put(x, device)`` returns, by
#: the C++ call it ends in (``pxla.batched_device_put`` for one shard)
#: without its Python layers (~3 us instead of ~30 us).
batched_device_put = _xc.batched_device_put



# is batched (io_callback's, and Ref effects): a cond holding one is left to
# JAX's rule and its error (``_primitives.control_flow_batching``). The
# Ref effect type has no public handle. JAX 0.8-0.12.
from jax._src.state.types import RefEffect  # noqa: E402


def refused_by_jax_in_batched_cond(effect) -> bool:
  """Whether JAX's vmap rule of ``cond`` refuses ``effect`` in a branch
  whose predicate is batched (see the imports above)."""
  return isinstance(effect, (IOEffect, OrderedIOEffect, RefEffect))


# Program order across ordered-effect kinds under plain ``jax.jit``
# (``_primitives.plain_order``): from JAX 0.10 an uncacheable lowering rule
# is given every ordered effect's compiler token of its region (0.8/0.9: its
# own only). JAX's ordered callbacks' rules are read from the registries
# behind ``mlir.register_lowering`` (no public getter; JAX 0.10-0.12) and
# registered again, wrapped and uncacheable (``debug_callback_p``'s CPU/GPU
# rules are cached otherwise: a cached rule sees its own token only).
from jax._src.interpreters import mlir as _mlir  # noqa: E402

RULES_SEE_EVERY_TOKEN = JAX_VERSION >= (0, 10)


def wrap_jax_callback_lowerings(wrap) -> None:
  """Registers ``wrap(rule)`` for each lowering rule (every platform's) of
  ``io_callback_p`` and ``debug_callback_p``, once."""
  for prim in (io_callback_p, debug_callback_p):
    registries = [(None, _mlir._lowerings)] + list(
        _mlir._platform_specific_lowerings.items())
    for platform, rules in registries:
      entry = rules.get(prim)
      if entry is None or hasattr(entry.rule, "jax_effects_wraps"):
        continue
      _mlir.register_lowering(prim, wrap(entry.rule), platform=platform,
                              inline=entry.inline, cacheable=False)
