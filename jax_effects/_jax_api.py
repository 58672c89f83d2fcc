"""JAX's public functions that jax_effects calls, bound once, at import.

Users apply ``jax_effects`` to code they do not own by replacing JAX's names
globally: ``jax.jit = jax_effects.jit`` (likewise ``jax.effects_barrier``,
``jax.debug.callback``, ...). jax_effects itself must keep calling JAX's
functions: had it read ``jax.jit`` when a
:class:`~jax_effects._dispatch.function.PjitFunction` is built,
``jax_effects.jit`` would call itself without end. Every call into these JAX
functions goes through the names below, never through the ``jax`` namespace
at call time:

* the functions jax_effects offers a drop-in for (``jit``,
  ``effects_barrier``, ``io_callback``, ``debug_callback``) come from the
  JAX modules that define them (``_compat``), so they are JAX's even when
  the public name was replaced before jax_effects was imported;
* the others (``make_jaxpr``, ``shard_map``) are the public names as they
  were when jax_effects was imported.

Part in the token calling convention: none; every layer may use it (it
imports only ``jax`` and ``_compat``).
"""
from __future__ import annotations

from jax import make_jaxpr, shard_map

from jax_effects._compat import jax_debug_callback as debug_callback
from jax_effects._compat import jax_effects_barrier as effects_barrier
from jax_effects._compat import jax_io_callback as io_callback
from jax_effects._compat import jax_jit as jit
