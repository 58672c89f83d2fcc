"""The only module that imports ``jax._src``: JAX internals with no public route.

Everything here is pinned to the JAX range in ``setup.cfg`` (0.10.x). Each
name says why it is needed; if a future JAX exposes a public route, replace the
import here and nothing else changes.
"""
from __future__ import annotations

import contextlib
import operator

import jax

from jax._src import core as _core
from jax._src import dispatch as _dispatch
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
# Only for the plain-``jax.jit`` fallback lowering of an *ordered* marker: JAX
# then threads its own tokens through it (see _effects.PlainJitOrder).
ordered_effects = _effects.ordered_effects
shardable_ordered_effects = _effects.shardable_ordered_effects

# Sharding annotation JAX gives its own callbacks: MAXIMAL on one device under
# automatic partitioning, MANUAL (per device) inside a fully manual shard_map.
callback_op_sharding = _callback._callback_op_sharding

# Emitting a host-callback custom call directly (``_primitives``), as
# ``mlir.emit_python_callback`` does but without its per-call result wrapper:
# the token operand gets its own sharding entry (``SdyArray``) next to the
# callback's annotation, which ``set_sharding`` attaches to the op.
from jax._src.interpreters.mlir import set_sharding  # noqa: E402
from jax._src.sharding_impls import SdyArray, SdyArrayList  # noqa: E402

# A replicated sharding annotation (``Sharding`` custom call or
# ``sdy.sharding_constraint``) on the array operands of a callback that runs
# once under automatic partitioning (JAX 0.10: shardy ``SdyArray``/``SdyDim``
# with an empty mesh, or GSPMD's replicated ``HloSharding``). The partitioner
# then all-gathers a sharded operand, where going from a tiled sharding
# straight to the callback's MAXIMAL one is an "involuntary full
# rematerialization" it warns about. Used by ``_primitives``.
from jax._src.interpreters.mlir import wrap_with_sharding_op  # noqa: E402
from jax._src.lib import xla_client as _xc  # noqa: E402
from jax._src.named_sharding import SdyDim  # noqa: E402


def replicated(ctx, value, aval):
  """``value`` (of ``aval``) annotated as replicated on every device."""
  import jax
  if jax.config.jax_use_shardy_partitioner:
    sharding = SdyArray(
        mesh_shape=(),
        dim_shardings=tuple(SdyDim(axes=(), is_open=False) for _ in aval.shape))
  else:
    sharding = _xc.HloSharding.replicate().to_proto()
  return wrap_with_sharding_op(ctx, value, aval, sharding)


# The jax_disable_jit flag's state object: ``.value`` reads it without the
# attribute lookup of ``jax.config.jax_disable_jit`` (on every dispatch).
from jax._src.config import disable_jit as disable_jit_flag  # noqa: E402

# shard_map's primitive (and pmap's: JAX 0.10 stages jax.pmap as jit(shard_map)).
# The token-threading pass needs a rule for it; there is no public handle.
from jax._src.shard_map import shard_map_p  # noqa: E402

# JAX's own host-callback primitives, adopted by the token-threading pass
# (``_adopted``): ``jax.debug.callback`` binds ``debug_callback_p``,
# ``jax.debug.print``/``log`` bind ``debug_print_p``,
# ``jax.experimental.io_callback`` binds ``io_callback_p``. No public handle
# on the primitives, their effect types (``jax.debug`` exports only the debug
# ones) or io_callback's host-side implementation (``io_callback_p.impl``
# dispatches a computation instead). JAX 0.8-0.10.
from jax._src.debugging import debug_callback_p, debug_print_p  # noqa: E402
from jax._src.debugging import DebugEffect, OrderedDebugEffect  # noqa: E402
from jax._src.callback import io_callback_p, io_callback_impl  # noqa: E402
from jax._src.callback import IOEffect, OrderedIOEffect  # noqa: E402

# Lowering-time axis contexts: a host callback's lowering reads them to know
# where it will run (SPMD manual = one call per device, identified by
# partition id into the mesh; sharding context = one call on the first device
# of the computation's device assignment). Used by ``_placement``.
from jax._src.sharding_impls import SPMDAxisContext, ShardingContext  # noqa: E402


def clear_jax_runtime_tokens() -> None:
  """Forgets the tokens JAX keeps for ``jax.effects_barrier``.

  JAX keeps an output token per device for every executable with host
  callbacks and never drops a failed one, so after one callback error every
  later ``jax.effects_barrier()`` would raise it again. Called once the error
  has been reported (``_runtime_tokens.effects_barrier``).
  """
  _dispatch.runtime_tokens.clear()


def require_devices_during_lowering(primitive) -> None:
  """Makes jit lower computations with ``primitive`` for concrete devices.

  By default JAX lowers device-agnostically (``ShardingContext`` without a
  device assignment) and reuses the module for every device set; a host
  callback then cannot know which device runs it. JAX's registry for this
  (used by its cuDNN kernels) makes the lowering see the device assignment.
  Compilation is per device set anyway; lowering for an abstract mesh only
  (``jax.export``) is refused by JAX for such primitives.
  """
  _dispatch.prim_requires_devices_during_lowering.add(primitive)

_trace_ctx = _core.trace_ctx


def at_top_level() -> bool:
  """True when no JAX transformation or trace is active on this thread."""
  return _trace_ctx.is_top_level()


# ``jax.Array.committed`` is a Python property; the C++ attribute behind it is
# read on every dispatch (``_runtime_tokens.update``).
committed = operator.attrgetter("_committed")


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


def enclosing_staging() -> str | None:
  """What the innermost jaxpr being traced is for ("cond", "jit", ...).

  Walks from the current trace through its parents (vmap/jvp traces) to the
  innermost jaxpr-building trace and returns its ``traced_for``; None when no
  jaxpr is being built. Lets an effect record that it was bound directly in a
  ``cond``/``switch`` branch (a branch that ``vmap`` may later inline).
  """
  trace = _trace_ctx.trace
  while trace is not None:
    frame = getattr(trace, "frame", None)
    if frame is not None:
      info = frame.debug_info
      return None if info is None else info.traced_for
    trace = getattr(trace, "parent_trace", None)
  return None


def jax_runtime_token(effect):
  """JAX's own runtime token of an ordered effect on this thread, if any.

  Only code under plain ``jax.jit`` (or eager control flow) uses JAX's tokens
  for our effects; eager effects wait for it to keep program order.
  """
  return _dispatch.runtime_tokens.current_tokens.get(effect)



def no_user_mesh():
  """A context in which the user's ambient mesh is not in effect.

  Our own helper computations (combining per-device runtime tokens, the
  initial token) run on the devices of their operands; a mesh the user set
  with ``jax.set_mesh`` (context or global setter) would make ``jax.jit``
  check them against that mesh ("Received incompatible devices").
  ``jax.set_mesh(None)`` is public and clears this thread's concrete and
  abstract mesh for the block (JAX 0.8-0.10). JAX allows it only outside
  any trace; under one (our helpers are called at the top level, so only if
  a user reads ``runtime_tokens()`` while tracing) nothing is changed.
  """
  if not _trace_ctx.is_top_level():
    return contextlib.nullcontext()
  return jax.set_mesh(None)

# ``batch_jaxpr(closed_jaxpr, axis_data, in_batched, instantiate)``: which
# outputs of a jaxpr vmap batches. The vmap rules of ``while``/``cond`` that
# jax_effects wraps (``_control_flow_batching``) call JAX's own rule unchanged
# and use this, as that rule does, to find whether the predicate is batched
# (JAX 0.8-0.10: same signature; no public route).
from jax._src.interpreters.batching import batch_jaxpr  # noqa: E402

# Higher-order primitives of JAX with no public handle, for the pass's rules
# (``_token_pass``); JAX 0.8, 0.9 and 0.10 define them here.
# ``custom_vmap_call`` (jax.custom_batching.custom_vmap), ``composite``
# (jax.lax.composite) and ``linear_call`` (jax.custom_derivatives.linear_call)
# are inlined by the pass, as their impls do.
from jax._src.custom_batching import custom_vmap_p  # noqa: E402
from jax._src.lax.lax import composite_p  # noqa: E402
from jax._src.custom_derivatives import linear_call_p  # noqa: E402

# The jaxprs held in an equation's params (sub-computations of higher-order
# primitives): public as ``jax.extend.core.jaxprs_in_params`` from JAX 0.10,
# only in ``jax._src.core`` before (0.8, 0.9).
try:
  from jax.extend.core import jaxprs_in_params  # noqa: E402
except ImportError:  # JAX < 0.10
  from jax._src.core import jaxprs_in_params  # noqa: E402
