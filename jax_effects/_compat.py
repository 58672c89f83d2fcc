"""The only module that imports ``jax._src``: JAX internals with no public route.

Everything here is pinned to the JAX range in ``setup.cfg`` (0.10.x). Each
name says why it is needed; if a future JAX exposes a public route, replace the
import here and nothing else changes.
"""
from __future__ import annotations

from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import callback as _callback
from jax._src.array import ArrayImpl as _ArrayImpl

# Effect-type registries. Our trace-time marker effect must be allowed inside
# control flow, custom derivatives and remat, must survive partial evaluation
# (so grad/checkpoint neither drop nor duplicate an effect), and must be
# lowerable for code that ends up under plain ``jax.jit``. It is never added to
# ``ordered_effects``: JAX's own runtime-token machinery stays out of the way.
control_flow_allowed_effects = _effects.control_flow_allowed_effects
custom_derivatives_allowed_effects = _effects.custom_derivatives_allowed_effects
remat_allowed_effects = _effects.remat_allowed_effects
partial_eval_kept_effects = _effects.partial_eval_kept_effects
lowerable_effects = _effects.lowerable_effects

# Sharding annotation JAX gives its own callbacks: MAXIMAL on one device under
# automatic partitioning, MANUAL (per device) inside a fully manual shard_map.
callback_op_sharding = _callback._callback_op_sharding

_trace_ctx = _core.trace_ctx


def at_top_level() -> bool:
  """True when no JAX transformation or trace is active on this thread."""
  return _trace_ctx.is_top_level()


def uncommitted(array):
  """Returns ``array``'s first shard as an uncommitted single-device jax.Array.

  Runtime tokens must not pin the next computation to their devices: an
  uncommitted array is moved by ``jax.jit``'s C++ dispatch to wherever the
  next computation runs, and only when that differs. A token replicated over
  several devices is represented by its first shard (as JAX itself does when it
  copies a runtime token to another device set).
  """
  shard = array._arrays[0]
  return _ArrayImpl(shard.aval, shard.sharding, [shard], committed=False,
                    _skip_checks=True)
