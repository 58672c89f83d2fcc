"""Lowering: MLIR helpers, sharding annotations, device-aware lowering.

For the lowering rules of ``_primitives`` and ``_runtime.placement``. Part
in the token calling convention: none of its own (``jax_effects._compat``).
"""
from __future__ import annotations

import inspect as _inspect

import jax

from jax._src import callback as _callback
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax_effects._compat.versions import JAX_VERSION
from jax_effects._compat.versions import unsupported_jax

# The sharding annotation JAX gives its own callbacks (MAXIMAL on one device,
# or MANUAL in a fully manual shard_map). JAX 0.8-0.12.
callback_op_sharding = _callback._callback_op_sharding

# MLIR helpers and sharding annotations for host calls emitted directly (as
# ``mlir.emit_python_callback`` does, without its per-call wrapper), and
# Shardy's per-value (``SdyArray``) and per-result (``SdyArrayList``)
# shardings: no public handle; the same fields on JAX 0.8-0.12.
from jax._src.interpreters import mlir as _mlir  # noqa: E402
from jax._src.interpreters.mlir import wrap_with_sharding_op  # noqa: E402
from jax._src.lib import xla_client as _xc  # noqa: E402
from jax._src.named_sharding import SdyDim  # noqa: E402
from jax._src.sharding_impls import SdyArray  # noqa: E402
from jax._src.sharding_impls import SdyArrayList  # noqa: E402


def _shardy() -> bool:
  return jax.config.jax_use_shardy_partitioner


def _sdy_replicated(aval):
  return SdyArray(mesh_shape=(), dim_shardings=tuple(
      SdyDim(axes=(), is_open=False) for _ in aval.shape))


def _hlo_replicated():
  return _xc.HloSharding.replicate().to_proto()


def replicated(ctx, value, aval):
  """``value`` (of ``aval``) annotated as replicated on every device: the
  partitioner all-gathers a sharded operand of a once-run callback rather
  than warn of an "involuntary full rematerialization"."""
  sharding = _sdy_replicated(aval) if _shardy() else _hlo_replicated()
  return wrap_with_sharding_op(ctx, value, aval, sharding)


def on_first_device(ctx, value, aval):
  """``value`` (of ``aval``) annotated as held by the computation's first
  device only (as JAX's callbacks' results): the partitioner broadcasts it
  from there where other devices need it."""
  if _shardy():
    sharding = SdyArray(mesh_shape=(), dim_shardings=(), logical_device_ids=(0,))
  else:
    sharding = _xc.OpSharding()
    sharding.type = _xc.OpSharding.Type.MAXIMAL
    sharding.tile_assignment_devices = [0]
  return wrap_with_sharding_op(ctx, value, aval, sharding)


def one_per_device(ctx, value, aval, num_devices: int):
  """``value`` (of ``aval``, a vector of ``num_devices`` elements) tiled
  over the devices in order: device ``i`` of the computation's device
  assignment holds element ``i`` (``_primitives.host_assembly``)."""
  if _shardy():
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
  others left to the partitioner."""
  rows = range(len(aval.shape) - 1)
  if _shardy():
    sharding = SdyArray(
        mesh_shape=None,
        dim_shardings=tuple(SdyDim(axes=(), is_open=d in rows)
                            for d in range(len(aval.shape))))
    return wrap_with_sharding_op(ctx, value, aval, sharding)
  return wrap_with_sharding_op(ctx, value, aval, _hlo_replicated(),
                               unspecified_dims=set(rows))


def replicated_results(avals):
  """The sharding annotation of an op whose results (of ``avals``) are all
  replicated (``host_assembly``'s per-device host call)."""
  if _shardy():
    return SdyArrayList(tuple(_sdy_replicated(aval) for aval in avals))
  if len(avals) == 1:
    return _hlo_replicated()
  sharding = _xc.OpSharding()
  sharding.type = _xc.OpSharding.Type.TUPLE
  sharding.tuple_shardings = [_hlo_replicated() for _ in avals]
  return sharding


def set_sharding(module_context, op, sharding) -> None:
  """Attaches ``sharding`` (OpSharding or SdyArray[List]) to the MLIR ``op``:
  ``mlir.set_sharding`` takes the module context first from JAX 0.10, only
  ``(op, sharding)`` on 0.8/0.9."""
  if JAX_VERSION >= (0, 10):
    _mlir.set_sharding(module_context, op, sharding)
  else:
    _mlir.set_sharding(op, sharding)


def with_token_sharding(sharding, has_results: bool):
  """``sharding`` of a host call's results with an entry for a compiler
  token result put first, as ``mlir.emit_python_callback`` adds one: with
  Shardy, naming the results' devices from JAX 0.10, none on 0.8/0.9."""
  if (sharding is None or not has_results or not _shardy()
      or not isinstance(sharding, SdyArrayList)):
    return sharding
  ids = sharding.shardings[0].logical_device_ids if JAX_VERSION >= (0, 10) else ()
  return SdyArrayList((SdyArray(mesh_shape=(), dim_shardings=(),
                                logical_device_ids=ids),
                       *sharding.shardings))


def token_on_devices(token, sharding) -> None:
  """Annotates the host call that returned ``token`` (and results sharded
  as ``sharding``) with its token on the results' devices: JAX 0.8/0.9's
  ``emit_python_callback`` gives a returned token no device (a replicated
  side effect, which XLA's partitioner refuses)."""
  if (JAX_VERSION < (0, 10) and _shardy()
      and isinstance(sharding, SdyArrayList)):
    ids = sharding.shardings[0].logical_device_ids
    token.owner.attributes["sdy.sharding"] = SdyArrayList((
        SdyArray(mesh_shape=(), dim_shardings=(), logical_device_ids=ids),
        *sharding.shardings)).build()


#: The aval of a compiler token (``jax.core.abstract_token`` is deprecated
#: from JAX 0.10, with no replacement in ``jax.extend``). JAX 0.8-0.12.
abstract_token = _core.abstract_token


def physical_aval(aval):
  """What a custom call receives for ``aval`` (a PRNG key array's key data):
  ``core.physical_aval``, no public handle. JAX 0.8-0.12."""
  return _core.physical_aval(aval)


def lowering_for_export(ctx) -> bool:
  """Whether ``ctx`` lowers for ``jax.export`` (JAX 0.8-0.12)."""
  return bool(ctx.module_context.lowering_parameters.for_export)


def keep_alive_with_executable(ctx, obj) -> None:
  """Keeps ``obj`` alive as long as the executable compiled from ``ctx``'s
  module (its keepalives: not part of the module or the cache key; JAX
  0.8-0.12; ``jax.export`` refuses a module with keepalives)."""
  ctx.module_context.add_keepalive(obj)


# Lowering-time axis contexts, which tell a host callback's lowering where it
# will run (``_runtime.placement``). JAX 0.8-0.12.
from jax._src.sharding_impls import ShardingContext  # noqa: E402
from jax._src.sharding_impls import SPMDAxisContext


def require_devices_during_lowering(primitive) -> None:
  """Makes jit lower computations with ``primitive`` for concrete devices
  (JAX's registry for it), so a host callback knows which device runs it
  (JAX 0.8-0.12)."""
  _dispatch.prim_requires_devices_during_lowering.add(primitive)


def wrap_lowerings(primitives, wrap, cacheable: bool | None = None) -> None:
  """Registers ``wrap(rule)`` for each lowering rule (every platform's) of
  each of ``primitives``, once (``wrap(rule).jax_effects_wraps`` is
  ``rule``); uncacheable with ``cacheable=False``, else as cacheable as the
  rule it wraps (a program the wrapper leaves alone lowers to the same
  module). ``mlir._lowerings`` and ``_platform_specific_lowerings`` hold
  ``LoweringRuleEntry(rule, inline)``, ``_uncacheable_primitives`` the
  uncacheable ones, on JAX 0.8-0.12.

  Run when ``jax_effects`` is imported: where these internals exist but
  have changed shape (``register_lowering`` without ``inline``/
  ``cacheable``, an entry without ``.rule``/``.inline``, a registry that
  is no mapping), it raises the one ``ImportError`` of
  ``versions.unsupported_jax``, naming the installed JAX, before it has
  registered anything."""
  try:
    entries = []
    for prim in primitives:
      registries = [(None, _mlir._lowerings)] + list(
          _mlir._platform_specific_lowerings.items())
      for platform, rules in registries:
        entry = rules.get(prim)
        if entry is None or hasattr(entry.rule, "jax_effects_wraps"):
          continue
        keep = (prim not in _mlir._uncacheable_primitives
                if cacheable is None else cacheable)
        entries.append((prim, platform, entry.rule, entry.inline, keep))
    # (register_lowering's parameters, checked before the first call: a
    # TypeError from its body is no reason to refuse)
    signature = _inspect.signature(_mlir.register_lowering)
    for prim, platform, rule, inline, keep in entries:
      signature.bind(prim, rule, platform=platform, inline=inline, cacheable=keep)
  except (AttributeError, TypeError, ValueError) as err:
    raise unsupported_jax(err) from err
  for prim, platform, rule, inline, keep in entries:
    wrapped = wrap(prim, rule)
    wrapped.jax_effects_wraps = rule
    _mlir.register_lowering(prim, wrapped, platform=platform, inline=inline,
                            cacheable=keep)
