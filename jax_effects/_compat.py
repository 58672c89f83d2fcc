"""JAX internals and JAX version differences: the only module that knows them.

This is the only module that imports ``jax._src`` or compares JAX versions.

Supported: the JAX range in ``setup.cfg`` (0.8.3 <= jax < 0.11, i.e. the 0.8,
0.9 and 0.10 lines). Two kinds of names live here:

* JAX internals with no public route (``jax._src``), each with its reason and
  the versions it applies to; if a future JAX exposes a public route, replace
  the import here and nothing else changes.
* One named shim per difference between the supported JAX lines, each saying
  which versions need it. No other module compares JAX versions: they use
  these names, and a feature that a line cannot support raises
  :class:`UnsupportedFeature` (``require``) with the reason given by
  ``unsupported_reason``, which the tests also use to skip.

Part in the token calling convention: none of its own; it hands the other
layers the JAX pieces the convention is built from (effect registries, JAX's
runtime tokens, lowering helpers), the same on every supported line.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import threading
import traceback as _traceback
import types as _types

import jax

# (major, minor, patch) of the installed JAX; compared only in this module.
JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3]
                    if p.isdigit())

# Unless a comment says otherwise, every ``jax._src`` name below exists with
# the same meaning on all supported lines (JAX 0.8.3 to 0.10.x).

# _callback_op_sharding: the sharding JAX gives its own host callbacks.
# The effect-type registries and the Effect base class.
# runtime_tokens (JAX's per-device tokens),
# prim_requires_devices_during_lowering.
# trace_ctx (is a trace active; the innermost jaxpr being built), DropVar.
from jax._src import callback as _callback
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
# ArrayImpl: building an uncommitted single-shard array (``uncommitted``).
from jax._src.array import ArrayImpl as _ArrayImpl

# Base class of JAX effect types. Public as ``jax.extend.core.Effect`` from
# JAX 0.10; on 0.8 and 0.9 only ``jax._src.effects.Effect`` (the same class).
Effect = _effects.Effect

# A jaxpr binder whose value is unused (``_``). Public as
# ``jax.extend.core.DropVar`` from JAX 0.10; on 0.8 and 0.9 only
# ``jax._src.core.DropVar`` (the same class).
DropVar = _core.DropVar


def bind_equation(eqn, invals):
  """Binds ``eqn``'s primitive to ``invals`` with its params (re-emits it).

  From JAX 0.9 ``Primitive.get_bind_params`` returns the bind params; on 0.8
  it returns ``(subfuns, params)`` and the subfunctions (call primitives'
  bodies) come first in ``bind``'s arguments.
  """
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bind_params, tuple):   # JAX 0.8
    subfuns, bind_params = bind_params
    return eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return eqn.primitive.bind(*invals, **bind_params)


# The trace that stages a jaxpr and its tracers, and constant folding
# (JAX 0.8-0.10, the same on all three): re-emitting an equation as it is,
# without re-running its abstract evaluation, is what ``jax.jit``'s inlining
# does (``pe.inline_jaxpr_into_trace``, the loop copied below); no public
# API re-emits an equation. It makes the token pass cost a copy, not a
# trace, per equation it leaves unchanged (``_core.jaxpr_eval``).
from jax._src.interpreters import partial_eval as _pe  # noqa: E402


def equation_copier(jaxpr):
  """``copy(eqn, invals)`` re-emitting an equation of ``jaxpr`` unchanged
  into the current trace, as ``jax.jit``'s inlining does (the same
  equation, new binders, no abstract evaluation), or None when nothing can
  be: the current trace does not stage a jaxpr, or ``jaxpr`` uses
  high-level types. ``copy`` returns the outputs (one value unless the
  primitive has multiple results), or None for an equation it leaves to
  :func:`bind_equation`: an input from another trace, or whose type is not
  the equation's, only constants as inputs (bound, they fold eagerly), an
  effect on an input, a mutable reference made or used."""
  trace = _core.trace_ctx.trace
  if type(trace) is not _pe.DynamicJaxprTrace or getattr(
      jaxpr, "is_high", False):
    return None
  tracer_type = _pe.DynamicJaxprTracer
  literal_type = _core.Literal
  input_effect = _effects.JaxprInputEffect
  fold = _pe.try_constant_folding
  emit = trace.emit_eqn

  def copy(eqn, invals):
    if getattr(eqn.primitive, "ref_allocating", False):
      return None   # (JAX evaluates these afresh: mutable references)
    src = eqn.source_info
    tracers = []
    staged = False
    for v, x in zip(eqn.invars, invals):
      if type(v) is literal_type:
        tracers.append(tracer_type(trace, v.aval, v, src))
        continue
      if type(x) is tracer_type and x._trace is trace:
        staged = True
      elif isinstance(x, _core.Tracer):
        return None
      else:
        x = trace.to_jaxpr_tracer(x, src)
      if x.aval != v.aval or v.aval.has_qdd:
        return None
      tracers.append(x)
    if not staged:
      return None
    effects = eqn.effects
    if effects and any(isinstance(e, input_effect) for e in effects):
      return None
    out_avals = [v.aval for v in eqn.outvars]
    consts = fold(eqn.primitive, tracers, eqn.params, out_avals)
    if consts is not None:
      outs = [trace.new_const(c, source_info=src, aval=aval)
              for c, aval in zip(consts, out_avals)]
    else:
      outs = emit(tracers, out_avals, eqn.primitive, eqn.params, effects,
                  src, eqn.ctx)
    return outs if eqn.primitive.multiple_results else outs[0]

  return copy


def varying_axes(aval) -> frozenset:
  """The manual mesh axes over which a value inside ``shard_map`` varies.

  JAX 0.10 keeps them in ``aval.manual_axis_type.varying``; 0.8 and 0.9 in
  ``aval.vma`` (a frozenset of axis names).
  """
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(aval.vma)

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

# Loop-invariant hoisting of scan's partial evaluation (grad, vjp, linearize
# of a scan), JAX 0.8-0.10: ``_scan_known_hoisting`` re-traces the forward
# ("known") scan body with its consts known, and every equation whose inputs
# are all consts is evaluated once, outside the loop. For an effect that is
# wrong: ``print("step")`` or a progress bar's ``bar.update()`` in the body
# would run once instead of once per iteration (JAX's own
# ``jax.debug.print("step")`` does so under ``jax.grad``).
# ``_scan_partial_eval`` calls it by its module-level name, so it is wrapped
# there: a body with one of our effects (``keep_effects_in_loops``) is not
# hoisted (JAX's own "to disable" return); every other scan is hoisted as
# before.
from jax._src.lax.control_flow import loops as _loops  # noqa: E402

_jax_scan_known_hoisting = _loops._scan_known_hoisting
_unhoisted_effect_types: set = set()


def _scan_known_hoisting(jaxpr_known, known_consts, num_res):
  if any(type(e) in _unhoisted_effect_types for e in jaxpr_known.effects):
    return jaxpr_known, known_consts, [False] * num_res, []
  return _jax_scan_known_hoisting(jaxpr_known, known_consts, num_res)


def keep_effects_in_loops(*effect_types) -> None:
  """Equations carrying an effect of these types stay in their scan's body
  under partial evaluation (see ``_scan_known_hoisting`` above)."""
  _unhoisted_effect_types.update(effect_types)
  _loops._scan_known_hoisting = _scan_known_hoisting


# Sharding annotation JAX gives its own callbacks: MAXIMAL on one device under
# automatic partitioning, MANUAL (per device) inside a fully manual shard_map.
callback_op_sharding = _callback._callback_op_sharding

# Emitting a host-callback custom call directly (``_primitives``), as
# ``mlir.emit_python_callback`` does but without its per-call result wrapper
# and without a token operand: ``set_sharding`` attaches the callback's
# annotation to the op (``mlir.set_sharding`` differs, shim below). JAX
# 0.8-0.10.
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
# same on JAX 0.8-0.10).
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
# on JAX 0.8-0.10) and, below, the annotations that keep its packing local.
from jax._src.sharding_impls import SdyArrayList  # noqa: E402


def one_per_device(ctx, value, aval, num_devices: int):
  """``value`` (of ``aval``, a vector of ``num_devices`` elements) annotated
  as tiled over the devices in order: the partitioner gives each device its
  own element (device ``i`` of the computation's device assignment holds
  element ``i``), with no data movement for a value computed in place (an
  iota). Shardy: a one-axis inline mesh of the devices in order; GSPMD:
  a tiled ``OpSharding``. JAX 0.8-0.10."""
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
  replicated sharding with the others unspecified). JAX 0.8-0.10."""
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
  one ``SdyArray`` per result, GSPMD a tuple sharding). JAX 0.8-0.10."""
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
#: result of a host call that takes JAX's token (JAX 0.8-0.10).
abstract_token = _core.abstract_token


def physical_aval(aval):
  """The aval of what a custom call receives for ``aval``: a PRNG key array's
  key data (``uint32[..., 2]`` for threefry), any other array as it is
  (``core.physical_aval``, JAX 0.8-0.10; no public handle)."""
  return _core.physical_aval(aval)


def lowering_for_export(ctx) -> bool:
  """Whether ``ctx`` lowers for ``jax.export`` (``LoweringParameters.for_export``
  of the module being lowered; the same attribute on JAX 0.8-0.10)."""
  return bool(ctx.module_context.lowering_parameters.for_export)


# Traceback filtering as ``jax.jit``'s (``jax._src.traceback_util``, the same
# on JAX 0.8-0.10): an exception leaving the outermost ``api_boundary`` has
# the frames of the registered paths removed (``JAX_TRACEBACK_FILTERING``).
from jax._src import traceback_util as _traceback_util  # noqa: E402



def _filtered(tb):
  """``tb`` without the frames of the excluded paths (JAX's and ours): a
  prefix test per frame (JAX's ``filter_traceback`` stats files per frame
  and path, and its boundary extracts the whole stack, source lines
  included, per error: milliseconds where a callback's error is raised)."""
  prefixes = tuple(_traceback_util._exclude_paths)
  out = None
  for frame, lineno in reversed(list(_traceback.walk_tb(tb))):
    if not frame.f_code.co_filename.startswith(prefixes):
      out = _types.TracebackType(out, frame, frame.f_lasti, lineno)
  return out


def api_boundary(fun):
  """As JAX's ``traceback_util.api_boundary``: an exception leaving ``fun``
  loses the frames of the excluded paths from its traceback
  (``JAX_TRACEBACK_FILTERING`` as for JAX: ``off`` keeps them,
  ``tracebackhide`` marks them), at a cost of microseconds per exception
  (:func:`_filtered`) and nothing per call. Unlike JAX's it adds no note
  (``__notes__``): a callback's error reaches the caller as the user's own
  object, unchanged but for its traceback (JAX's boundaries inside, around
  a trace, add theirs as under ``jax.jit``)."""
  @functools.wraps(fun)
  def boundary(*args, **kwargs):
    __tracebackhide__ = True  # noqa: F841 - read by IPython
    try:
      return fun(*args, **kwargs)
    except Exception as e:
      mode = _traceback_util._filtering_mode()
      if mode == "off":
        raise
      if mode == "tracebackhide":
        _traceback_util._add_tracebackhide_to_hidden_frames(e.__traceback__)
        raise
      e.with_traceback(_filtered(e.__traceback__))
      raise   # (no note added: a callback's error is the user's object)
  return boundary


def exclude_from_tracebacks(path: str) -> None:
  """Leaves the frames of files under ``path`` out of filtered tracebacks."""
  _traceback_util.register_exclusion(path)


def export_allowed_custom_calls() -> frozenset | None:
  """The custom-call targets the running ``jax.export.export(...)(...)``
  call allows (its ``disabled_checks``), read from its frame (``do_export``
  in ``jax._src.export._export``, whose ``disabled_checks`` is a closure
  variable: JAX 0.8-0.10); None when no such frame is found (another
  caller, another JAX). ``"ALL"`` stands for every target."""
  import sys
  frame = sys._getframe(1)
  while frame is not None:
    if (frame.f_code.co_name == "do_export" and frame.f_globals.get(
        "__name__") == "jax._src.export._export"):
      checks = frame.f_locals.get("disabled_checks")
      if checks is None:
        return None
      return frozenset(t for t in (c.is_custom_call() for c in checks)
                       if t is not None)
    frame = frame.f_back
  return None


def keep_alive_with_executable(ctx, obj) -> None:
  """Keeps ``obj`` alive as long as the executable compiled from the module
  ``ctx`` lowers: the module context's keepalives, which JAX hands to the
  executable (``MeshExecutable``); not part of the module, the persistent
  cache key or its entry (JAX 0.8-0.10; ``jax.export`` refuses a module
  with keepalives)."""
  ctx.module_context.add_keepalive(obj)

# JAX's own functions that jax_effects calls and that it also offers a
# drop-in for: ``jit`` (``jax.jit``), ``effects_barrier``
# (``jax.effects_barrier``), ``io_callback`` and ``debug_callback``
# (``jax.experimental.io_callback``, ``jax.debug.callback``). A user may
# replace the public names by jax_effects' (``jax.jit = jax_effects.jit``),
# even before jax_effects is imported (a wrapper that imports it lazily):
# taken from the modules that define them, these stay JAX's, so jax_effects
# never calls itself through them (``_jax_api``). The public names are these
# very objects on JAX 0.8-0.10.
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
# ones). JAX 0.8-0.10.
from jax._src.debugging import debug_callback_p  # noqa: E402
from jax._src.debugging import debug_print_p
from jax._src.debugging import DebugEffect
from jax._src.debugging import OrderedDebugEffect
# shard_map's primitive (and pmap's: JAX stages jax.pmap as jit(shard_map),
# always on 0.10, by default (jax_pmap_shmap_merge=True) on 0.8 and 0.9).
# The token-threading pass needs a rule for it; there is no public handle.
from jax._src.shard_map import shard_map_p  # noqa: E402

# The host side of adopted callbacks (``_frontends.adopted_host``) gives the user's
# function what JAX's impls of these primitives give it, without their
# per-call Python overhead (``api.device_put`` of the operands is ~30 us a
# call; the three ``with`` blocks ~4 us), so adopted callbacks run at
# jax_effects' speed. JAX 0.8-0.10 all do the same (``debug_callback_impl``:
# operands ``device_put`` to the first CPU device, the callback run with that
# device as ``jax_default_device`` and no concrete or abstract mesh;
# ``io_callback_impl``: the same, with only the default device set; a failing
# callback logged by the module's ``logger`` before it propagates).
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
NO_MESH_SETTINGS = ((_config.device_context, _mesh.empty_concrete_mesh),
                    (_config.abstract_mesh_context_manager,
                     _mesh.empty_abstract_mesh))

def debug_callback_parts(flat_callback):
  """``(callback, in_tree, static_args)`` of the flat callback
  ``jax.debug.callback`` binds (its closure: ``_flat_callback`` merges
  ``static_args``, a dict position -> value, into the flat arguments,
  unflattens them with ``in_tree`` to ``(args, kwargs)`` and calls
  ``callback``; JAX 0.8-0.10), or None for any other callable (one bound
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
  returns the leaves of its result; JAX 0.8-0.10), or None for another
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


def shard_map_manual_axes(params) -> frozenset:
  """The mesh axes a ``shard_map`` equation makes manual (from its params).

  JAX 0.10 names the param ``newly_manual_axes`` (axes already manual in an
  enclosing ``shard_map`` left out); 0.8 and 0.9 name it ``manual_axes`` (the
  ``axis_names`` given to ``jax.shard_map``).
  """
  if "newly_manual_axes" in params:
    return frozenset(params["newly_manual_axes"])
  return frozenset(params["manual_axes"])

# Whether JAX's backends are initialised (the pytest plugin sets the number
# of CPU devices and must know whether that can still take effect). No
# public query: ``jax.devices()`` would initialise them. JAX 0.8-0.10.
from jax._src.xla_bridge import backends_are_initialized  # noqa: E402
# Effects JAX's own vmap rule of ``cond`` refuses in a branch whose predicate
# is batched (io_callback's, and Ref effects): a cond holding one is left to
# JAX's rule and its error (``_primitives.control_flow_batching``). The
# Ref effect type has no public handle. JAX 0.8-0.10.
from jax._src.state.types import RefEffect  # noqa: E402


def refused_by_jax_in_batched_cond(effect) -> bool:
  """Whether JAX's vmap rule of ``cond`` refuses ``effect`` in a branch
  whose predicate is batched (see the imports above)."""
  return isinstance(effect, (IOEffect, OrderedIOEffect, RefEffect))


def in_cond_branch(name_stack) -> bool:
  """Whether an op lowered under ``name_stack`` is inside a ``cond`` branch.

  JAX's cond lowering names each branch's ops ``branch_<i>_fun`` in the name
  stack (``jax/_src/lax/control_flow/conditionals.py``, JAX 0.8-0.10); a
  branch vmap inlined into a ``select`` has no such name. No public handle.
  """
  return "_fun" in str(name_stack)


# Lowering-time axis contexts: a host callback's lowering reads them to know
# where it will run (SPMD manual = one call per device, identified by
# partition id into the mesh; sharding context = one call on the first device
# of the computation's device assignment). Used by ``_runtime.placement``.
from jax._src.sharding_impls import ShardingContext  # noqa: E402
from jax._src.sharding_impls import SPMDAxisContext


def clear_jax_runtime_tokens() -> None:
  """Forgets the tokens JAX keeps for ``jax.effects_barrier``.

  JAX keeps an output token per device for every executable with host
  callbacks and never drops a failed one, so after one callback error every
  later ``jax.effects_barrier()`` would raise it again. Called once the error
  has been reported (``_barrier.effects_barrier``).
  """
  _dispatch.runtime_tokens.clear()


# Whether JAX's backend has started (``_runtime.fork``: XLA's runtime does
# not survive a fork after it). No public route: ``jax.devices()`` would start
# it. ``backends_are_initialized`` exists on JAX 0.8.3 to 0.10.x.
from jax._src import xla_bridge as _xla_bridge  # noqa: E402


def backend_started() -> bool:
  """Whether this process's JAX backend has started (starts nothing)."""
  return _xla_bridge.backends_are_initialized()


def cpu_collectives_on_host(host: str) -> None:
  """Makes the CPU backend, when it starts, listen for its cross-process
  collectives (gloo over TCP) on ``host`` only.

  JAX creates gloo's TCP device without an address, and gloo then binds the
  address the machine's hostname resolves to (often its outward address);
  ``make_gloo_tcp_collectives`` takes one, but JAX passes none and has no
  option for it. So the ``"cpu"`` backend factory is registered again (as
  ``xla_bridge`` registers it: priority 0, failures raised) with collectives
  bound to ``host``. Call after ``jax.distributed.initialize`` (the
  collectives use its client) and before the backend starts. Used by the
  multi-process launcher (``_tools.launcher``: 127.0.0.1). The same names on
  JAX 0.8.3 to 0.10.x (``jax._src.lib._jax`` is ``xla_client._xla``).
  """
  import functools
  from jax._src import distributed
  from jax._src.lib import _jax
  if _xla_bridge.backends_are_initialized():
    raise RuntimeError("jax_effects: the CPU collectives' address must be "
                       "set before JAX's backend starts")
  collectives = _jax.make_gloo_tcp_collectives(
      distributed_client=distributed.global_state.client, hostname=host)
  _xla_bridge.register_backend_factory(
      "cpu", functools.partial(_xla_bridge.make_cpu_client,
                               collectives=collectives),
      priority=0, fail_quietly=False)


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
_eval_trace = _core.eval_trace
_top_axis_env = _core.top_axis_env

# What ``trace_ctx.is_top_level()`` reads, without its two Python frames
# (read on every dispatch, see ``_call_path.fast_dispatch``). JAX 0.10
# keeps the trace and axis environment in thread-local config states
# (``.value``); 0.8 and 0.9 in attributes of the ``threading.local``
# ``trace_ctx``.
if hasattr(_core, "trace_state_strong_ref"):   # JAX 0.10
  _trace_value = _core.trace_state_strong_ref
  _axis_env_value = _core.axis_env_state
else:   # JAX 0.8, 0.9: attributes of a threading.local, read as ``.value``
  class _TraceContextValue:
    __slots__ = ("_name",)

    def __init__(self, name: str):
      self._name = name

    @property
    def value(self):
      return getattr(_trace_ctx, self._name)

  _trace_value = _TraceContextValue("trace")
  _axis_env_value = _TraceContextValue("axis_env")

#: ``(trace, axis_env, eval_trace, top_axis_env)``: at the top level when
#: ``trace.value is eval_trace and axis_env.value is top_axis_env``; for a
#: caller that inlines :func:`at_top_level` (the dispatch fast path: one
#: Python frame less per call on JAX 0.10).
TOP_LEVEL = (_trace_value, _axis_env_value, _eval_trace, _top_axis_env)


def at_top_level() -> bool:
  """True when no JAX transformation or trace is active on this thread."""
  return (_trace_value.value is _eval_trace
          and _axis_env_value.value is _top_axis_env)


def compiled_dispatch() -> bool:
  """True when a call dispatches a compiled computation: no transformation or
  trace active on this thread and ``jax.disable_jit`` off."""
  return at_top_level() and not disable_jit_flag.value


# ``jax.Array.committed`` is a Python property; the C++ attribute behind it is
# read on every dispatch (``ThreadTokens.update``).
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


# BatchTrace: the trace of a jax.vmap (JAX 0.8-0.10; deprecated from
# jax.interpreters.batching), found around an update of a progress bar.
from jax._src.interpreters.batching import BatchTrace as _BatchTrace  # noqa: E402


def enclosing_vmaps() -> tuple[tuple[int, int], ...]:
  """The ``vmap``s around the code being traced, innermost first, as
  ``(id of its trace, its axis size)``.

  Walks from the current trace through every trace's ``parent_trace`` (a
  sub-jaxpr's trace, a ``scan`` body's, has the trace it was traced in as
  parent: JAX 0.8-0.10), so a ``vmap`` around a loop whose body is being
  traced is found too. ``jax_effects.progress`` counts an update inside a
  ``vmap`` its bar was not opened in once per element.
  """
  found = []
  trace = _trace_ctx.trace
  while trace is not None:
    if isinstance(trace, _BatchTrace):
      found.append((id(trace), int(trace.axis_data.size)))
    trace = getattr(trace, "parent_trace", None)
  return tuple(found)


def jax_runtime_tokens() -> list:
  """Every token JAX keeps for ``jax.effects_barrier`` on this thread
  (ordered effects' runtime tokens, and the output token per device of
  every executable with host callbacks), to wait for without raising what
  JAX raises there (``_runtime.barrier``)."""
  tokens = _dispatch.runtime_tokens
  return [*tokens.current_tokens.values(),
          *tokens.output_runtime_tokens.values()]


def building_jaxpr() -> bool:
  """True when a jaxpr is being built: the current trace, or a trace below
  it (through ``parent_trace``: vmap/jvp traces), stages a jaxpr
  (``jit``, ``make_jaxpr``, ``.trace()``, control flow)."""
  trace = _trace_ctx.trace
  while trace is not None:
    if getattr(trace, "frame", None) is not None:
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


def eager_transformation() -> bool:
  """True when the innermost trace is a transformation applied eagerly.

  That is a chain of transformation traces (``jvp``, ``vmap``,
  ``linearize``, partial evaluation) linked by their ``parent_trace`` down
  to the eval trace: a ``jit`` bound now is executed (compiled, dispatched)
  before its bind returns. False at the top level (no trace), and when the
  chain reaches a trace that builds a jaxpr (``jit``, ``make_jaxpr``,
  control flow: it has a ``frame``) or a trace of unknown kind (one with no
  ``parent_trace``): what is bound there runs later, if at all. The trace
  classes and their ``parent_trace``/``frame`` attributes are the same on
  JAX 0.8.3 to 0.10.x.
  """
  trace = _trace_ctx.trace
  if trace is _eval_trace:
    return False
  while trace is not None:
    if trace is _eval_trace:
      return True
    if getattr(trace, "frame", None) is not None:
      return False
    trace = getattr(trace, "parent_trace", None)
  return False


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
  ``jax.set_mesh`` clears this thread's concrete and abstract mesh for the
  block: given None on JAX 0.10; JAX 0.8 and 0.9 refuse None and take JAX's
  empty mesh (``jax._src.mesh.empty_concrete_mesh``, the value "no mesh"
  there). JAX allows it only outside any trace; under one (our helpers are
  called at the top level, so only if a user reads ``runtime_tokens()``
  while tracing) nothing is changed.
  """
  if not _trace_ctx.is_top_level():
    return contextlib.nullcontext()
  if JAX_VERSION >= (0, 10):
    return jax.set_mesh(None)
  from jax._src.mesh import empty_concrete_mesh  # JAX 0.8, 0.9
  return jax.set_mesh(empty_concrete_mesh)

# ``trace_context()``: the ``jax.config`` values that change what tracing
# produces (x64, the mesh, ...), JAX's own key for its trace caches; a
# jax_effects.jit function's kept traces are keyed by it too
# (``_dispatch.tracing.TraceCache``: its learnt state outlives a config change).
# No public route; JAX 0.8-0.10.
from jax._src.config import trace_context  # noqa: E402

# ``register_cache(obj, for_what)``: ``jax.clear_caches()`` calls
# ``obj.cache_clear()`` (held weakly). A jax_effects.jit function's kept
# traces (``_dispatch.tracing.TraceCache``) are a staging cache like JAX's own
# tracing caches, so they are dropped with them. No public route; JAX 0.8-0.10.
from jax._src.util import register_cache  # noqa: E402

# The transfer guard levels in effect (``jax.transfer_guard``): the
# thread's, else the global one. ``jax.config``'s per-direction states miss
# the global ``jax_transfer_guard`` flag, which sets guard_lib directly.
# No public route; JAX 0.8-0.10.
from jax._src.lib import guard_lib as _guard_lib  # noqa: E402


def host_transfers_guarded() -> bool:
  """Whether a transfer guard other than "allow" is in effect for implicit
  host-to-device transfers on this thread (``threads.ThreadTokens.initial_token``)."""
  level = _guard_lib.thread_local_state().host_to_device
  if level is None:
    level = _guard_lib.global_state().host_to_device
  return level is not None and level != _guard_lib.TransferGuardLevel.ALLOW


#: ``transfer_guard_state()``: this thread's guard state; its
#: ``explicit_device_put`` flag is what ``jax.device_put`` sets around its
#: transfers (``config.explicit_device_put_scope``), so a guard of
#: "disallow" lets them through. The adopted host side of JAX's callbacks
#: sets it around its ``batched_device_put`` calls, so they count as the
#: explicit puts ``debug_callback_impl``/``io_callback_impl`` make (JAX
#: 0.8-0.10).
transfer_guard_state = _guard_lib.thread_local_state


# Higher-order primitives of JAX with no public handle, for the pass's rules
# (``_pass.token_pass``); JAX 0.8, 0.9 and 0.10 define them here.
# ``custom_vmap_call`` (jax.custom_batching.custom_vmap), ``composite``
# (jax.lax.composite) and ``linear_call`` (jax.custom_derivatives.linear_call)
# are inlined by the pass, as their impls do.
from jax._src.custom_batching import custom_vmap_p  # noqa: E402
from jax._src.custom_derivatives import linear_call_p  # noqa: E402
# ``batch_jaxpr(closed_jaxpr, axis_data, in_batched, instantiate)``: which
# outputs of a jaxpr vmap batches. The vmap rules of ``while``/``cond`` that
# jax_effects wraps (``_primitives.control_flow_batching``) call JAX's own rule unchanged
# and use this, as that rule does, to find whether the predicate is batched
# (JAX 0.8-0.10: same signature; no public route).
from jax._src.interpreters.batching import batch_jaxpr  # noqa: E402
from jax._src.lax.lax import composite_p  # noqa: E402

# The jaxprs held in an equation's params (sub-computations of higher-order
# primitives): public as ``jax.extend.core.jaxprs_in_params`` from JAX 0.10,
# only in ``jax._src.core`` before (0.8, 0.9).
try:
  from jax.extend.core import jaxprs_in_params  # noqa: E402
except ImportError:  # JAX < 0.10
  from jax._src.core import jaxprs_in_params  # noqa: E402
# --- features that not every supported JAX line has ---------------------------

class UnsupportedFeature(NotImplementedError):
  """A jax_effects feature the installed JAX version cannot support.

  The message names the feature, the installed JAX version, the JAX version
  (or setting) that supports it, and a fix.
  """


def _pmap_shmap_merge_off() -> bool:
  # jax_pmap_shmap_merge: an option of JAX 0.8 and 0.9 only (default True:
  # pmap staged as jit(shard_map)); JAX 0.10 removed it (always so).
  return not getattr(jax.config, "jax_pmap_shmap_merge", True)


def _simplified_constants_on() -> bool:
  return bool(getattr(jax.config, "jax_use_simplified_jaxpr_constants", False))


# name -> (is the feature unavailable with the installed JAX and its settings?,
#          why, and what fixes it). One entry per limit of a supported line;
# ``unsupported_reason`` reads them, ``require`` raises them, and the tests
# skip with the same text (tests/conftest.py, marker ``jax_feature``).
FEATURES = {
    # JAX 0.8 and 0.9 with jax_pmap_shmap_merge=False stage jax.pmap as the
    # legacy xla_pmap primitive, which has no route for our side effects (JAX
    # refuses ordered effects in it). Not an issue on JAX 0.10.
    "effects in jax.pmap": (
        _pmap_shmap_merge_off,
        "side effects inside jax.pmap need jax.pmap staged as shard_map: "
        "jax_pmap_shmap_merge=False (an option of JAX 0.8 and 0.9) is set. "
        "Fix: jax.config.update('jax_pmap_shmap_merge', True) (the default), "
        "or upgrade to JAX >= 0.10, where pmap is always staged so"),
    # JAX 0.8 and 0.9 with JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS=1 fail to lower
    # a function closing over NumPy constants under plain jax.jit too
    # ("'TypedNdArray' object has no attribute 'sharding'"); fixed in 0.10.
    "simplified jaxpr constants": (
        lambda: JAX_VERSION < (0, 10),
        "JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS=1 with closed-over NumPy "
        "constants needs JAX >= 0.10 (JAX 0.8 and 0.9 fail to lower them, "
        "under plain jax.jit too). Fix: upgrade to JAX >= 0.10, or close "
        "over jax.Arrays (jnp.asarray) instead of NumPy arrays"),
    # JAX 0.8 and 0.9 hand 4-bit integer arrays to host callbacks with wrong
    # values (a packed buffer read as unpacked: [1, 2, -3] arrives as
    # [1, 2, 7] or prints as [1 2 4]; jax.debug.print and io_callback too).
    # Fixed in 0.10.
    "4-bit integer operands": (
        lambda: JAX_VERSION < (0, 10),
        "int4/uint4 arrays passed to a host callback need JAX >= 0.10 (JAX "
        "0.8 and 0.9 hand them to the host with wrong values, in "
        "jax.debug.print and io_callback too). Fix: upgrade to JAX >= 0.10, "
        "or pass x.astype(jnp.int8)"),
}


# JAX 0.8 can crash (SIGSEGV in ``pxla.MeshExecutable.from_hlo``) when two
# threads compile the same new jax.jit computation at once (seen in CI: two
# threads' first calls of one jax_effects.jit function). On JAX 0.8 the
# first calls of one jax_effects.jit function (which trace and compile) are
# serialized by a lock of that function; JAX 0.9 and 0.10 need nothing. (One
# lock per function, not one for all: a first call also runs its
# computation, whose callbacks may wait for another function's first call.)
_NO_GUARD = contextlib.nullcontext()


def first_call_guard():
  """A new context for one jax_effects.jit function's first calls (see
  above): a lock on JAX 0.8, nothing on later lines."""
  return threading.RLock() if JAX_VERSION < (0, 9) else _NO_GUARD


def has_4bit_integers(avals) -> bool:
  """Whether any of ``avals`` (or values with ``.dtype``) is int4/uint4."""
  import jax.numpy as jnp
  return any(getattr(a, "dtype", None) in (jnp.int4, jnp.uint4)
             for a in avals)


def unsupported_reason(feature: str) -> str | None:
  """Why ``feature`` (a key of ``FEATURES``) is unavailable now, or None."""
  unavailable, reason = FEATURES[feature]
  if not unavailable():
    return None
  return f"{reason} (installed: JAX {jax.__version__})"


def require(feature: str, call: str = "jax_effects") -> None:
  """Raises :class:`UnsupportedFeature` when ``feature`` is unavailable.

  ``call`` names the user's call that needs the feature (message prefix).
  """
  reason = unsupported_reason(feature)
  if reason is not None:
    raise UnsupportedFeature(f"{call}: {reason}")


# ``jax.export``: ``Exported.call`` binds ``call_exported_p`` (no public
# handle on the primitive or its lowering). The token-threading pass threads
# an exported jax_effects function's call on the chain of DEFAULT
# (``_pass.exported_rule``), lowering it with JAX's own rule given the
# chain's compiler token as the exported module's. JAX 0.8-0.10.
from jax._src.export._export import call_exported_p  # noqa: E402
from jax._src.export._export import (  # noqa: E402
    _call_exported_lowering as call_exported_lowering)
