"""Lowering: MLIR helpers, sharding annotations, device-aware lowering.

JAX internals for the lowering rules of jax_effects' primitives
(``_primitives``, ``_runtime.placement``), one shim per difference between
JAX lines. Part in the token calling convention: none of its own
(``jax_effects._compat``).
"""
from __future__ import annotations

from jax._src import callback as _callback
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax_effects._compat.versions import JAX_VERSION

# Sharding annotation JAX gives its own callbacks: MAXIMAL on one device under
# automatic partitioning, MANUAL (per device) inside a fully manual shard_map.
callback_op_sharding = _callback._callback_op_sharding

# Emitting a host-callback custom call directly (``_primitives``), as
# ``mlir.emit_python_callback`` does but without its per-call result wrapper
# and without a token operand: ``set_sharding`` attaches the callback's
# annotation to the op (``mlir.set_sharding`` differs, shim below). JAX
# 0.8-0.12.
from jax._src.interpreters import mlir as _mlir  # noqa: E402
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
# Shardy's per-value sharding, for ``replicated`` and ``on_first_device``
# below (its fields mesh_shape, dim_shardings and logical_device_ids are the
# same on JAX 0.8-0.12).
from jax._src.sharding_impls import SdyArray  # noqa: E402


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


def on_first_device(ctx, value, aval):
  """``value`` (of ``aval``) annotated as held by the computation's first
  device only (``MAXIMAL`` on device 0, the sharding JAX gives a callback's
  results under automatic partitioning): where the partitioner needs it on
  other devices it broadcasts it from there. Used by ``_primitives``."""
  import jax
  if jax.config.jax_use_shardy_partitioner:
    sharding = SdyArray(mesh_shape=(), dim_shardings=(),
                        logical_device_ids=(0,))
  else:
    sharding = _xc.OpSharding()
    sharding.type = _xc.OpSharding.Type.MAXIMAL
    sharding.tile_assignment_devices = [0]
  return wrap_with_sharding_op(ctx, value, aval, sharding)


# Sharding annotations of ``_primitives.host_assembly`` (the per-device host
# call of an effect whose operands are assembled on the host): Shardy's list
# of per-result shardings (``SdyArrayList``, no public handle; same fields
# on JAX 0.8-0.12) and, below, the annotations that keep its packing local.
from jax._src.sharding_impls import SdyArrayList  # noqa: E402


def one_per_device(ctx, value, aval, num_devices: int):
  """``value`` (of ``aval``, a vector of ``num_devices`` elements) annotated
  as tiled over the devices in order: the partitioner gives each device its
  own element (device ``i`` of the computation's device assignment holds
  element ``i``), with no data movement for a value computed in place (an
  iota). Shardy: a one-axis inline mesh of the devices in order; GSPMD:
  a tiled ``OpSharding``. JAX 0.8-0.12."""
  import jax
  if jax.config.jax_use_shardy_partitioner:
    sharding = SdyArray(
        mesh_shape=(("jax_effects_devices", num_devices),),
        dim_shardings=(SdyDim(axes=("jax_effects_devices",), is_open=False),))
  else:
    sharding = _xc.OpSharding()
    sharding.type = _xc.OpSharding.Type.OTHER
    sharding.tile_assignment_dimensions = [num_devices]
    sharding.tile_assignment_devices = list(range(num_devices))
  return wrap_with_sharding_op(ctx, value, aval, sharding)


def last_axis_whole(ctx, value, aval):
  """``value`` (of ``aval``) annotated with its last axis unsharded and the
  others left to the partitioner (Shardy: open dimensions; GSPMD: a
  replicated sharding with the others unspecified). JAX 0.8-0.12."""
  import jax
  rows = range(len(aval.shape) - 1)
  if jax.config.jax_use_shardy_partitioner:
    sharding = SdyArray(
        mesh_shape=None,
        dim_shardings=tuple(SdyDim(axes=(), is_open=d in rows)
                            for d in range(len(aval.shape))))
    return wrap_with_sharding_op(ctx, value, aval, sharding)
  sharding = _xc.HloSharding.replicate().to_proto()
  return wrap_with_sharding_op(ctx, value, aval, sharding,
                               unspecified_dims=set(rows))


def replicated_results(avals):
  """The sharding annotation of an op whose results (of ``avals``) are all
  replicated: the per-device host call of ``host_assembly`` (JAX's
  partitioned callback target makes every result replicated; Shardy wants
  one ``SdyArray`` per result, GSPMD a tuple sharding). JAX 0.8-0.12."""
  import jax
  if jax.config.jax_use_shardy_partitioner:
    return SdyArrayList(tuple(
        SdyArray(mesh_shape=(), dim_shardings=tuple(
            SdyDim(axes=(), is_open=False) for _ in aval.shape))
        for aval in avals))
  if len(avals) == 1:
    return _xc.HloSharding.replicate().to_proto()
  sharding = _xc.OpSharding()
  sharding.type = _xc.OpSharding.Type.TUPLE
  sharding.tuple_shardings = [_xc.HloSharding.replicate().to_proto()
                              for _ in avals]
  return sharding


def set_sharding(module_context, op, sharding) -> None:
  """Attaches ``sharding`` (OpSharding or SdyArray[List]) to the MLIR ``op``.

  JAX 0.10's ``mlir.set_sharding`` takes the module context first (it caches
  built attributes there); 0.8 and 0.9 take only ``(op, sharding)``.
  """
  if JAX_VERSION >= (0, 10):
    _mlir.set_sharding(module_context, op, sharding)
  else:
    _mlir.set_sharding(op, sharding)


def with_token_sharding(sharding, has_results: bool):
  """``sharding`` of a host call's results with an entry for a compiler
  token result put first, as ``mlir.emit_python_callback`` adds one (Shardy
  wants one ``SdyArray`` per result when there are others; an ``OpSharding``
  covers the whole op). The token's entry names the results' devices on JAX
  0.10 and none on 0.8/0.9, as each line's ``emit_python_callback`` does."""
  import jax
  if (sharding is None or not has_results
      or not jax.config.jax_use_shardy_partitioner
      or not isinstance(sharding, SdyArrayList)):
    return sharding
  ids = (sharding.shardings[0].logical_device_ids if JAX_VERSION >= (0, 10)
         else ())
  return SdyArrayList((SdyArray(mesh_shape=(), dim_shardings=(),
                                logical_device_ids=ids),
                       *sharding.shardings))


#: The aval of a compiler token (``jax.core.abstract_token`` is deprecated
#: from JAX 0.10 and has no replacement in ``jax.extend``): the operand and
#: result of a host call that takes JAX's token (JAX 0.8-0.12).
abstract_token = _core.abstract_token


def physical_aval(aval):
  """The aval of what a custom call receives for ``aval``: a PRNG key array's
  key data (``uint32[..., 2]`` for threefry), any other array as it is
  (``core.physical_aval``, JAX 0.8-0.12; no public handle)."""
  return _core.physical_aval(aval)


def lowering_for_export(ctx) -> bool:
  """Whether ``ctx`` lowers for ``jax.export`` (``LoweringParameters.for_export``
  of the module being lowered; the same attribute on JAX 0.8-0.12)."""
  return bool(ctx.module_context.lowering_parameters.for_export)


def keep_alive_with_executable(ctx, obj) -> None:
  """Keeps ``obj`` alive as long as the executable compiled from the module
  ``ctx`` lowers: the module context's keepalives, which JAX hands to the
  executable (``MeshExecutable``); not part of the module, the persistent
  cache key or its entry (JAX 0.8-0.12; ``jax.export`` refuses a module
  with keepalives)."""
  ctx.module_context.add_keepalive(obj)


# Lowering-time axis contexts: a host callback's lowering reads them to know
# where it will run (SPMD manual = one call per device, identified by
# partition id into the mesh; sharding context = one call on the first device
# of the computation's device assignment). Used by ``_runtime.placement``.
from jax._src.sharding_impls import ShardingContext  # noqa: E402
from jax._src.sharding_impls import SPMDAxisContext


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
