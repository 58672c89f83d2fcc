"""The two side-effect primitives, before and after token threading.

``effect_p`` is what user-facing functions (``print``, ``log``, ``callback``)
bind while a program is being traced::

    results = effect_p(*args; host_callback, effect, ordered, result_avals)

It carries a :class:`~jax_effects._effects.TraceEffect` marker so JAX keeps it
through its transformations, and it has the rules those transformations need
(eager impl, JVP, batching, a fallback lowering for plain ``jax.jit``).

``threaded_effect_p`` is what the token-threading pass replaces it with::

    token', carrier', results = threaded_effect_p(token, carrier, *args; ...)

``token`` is a *compiler token* (``!stablehlo.token``): consecutive side
effects of one chain are linked by it, so XLA cannot reorder them. ``carrier``
is an ``int32`` scalar standing for the same chain where a token cannot go
(across ``cond``/``while``/``scan`` boundaries, and out to the runtime token):
the host callback takes it as an operand and returns it, which is a real data
dependency XLA must respect. It has *no* JAX-level effect, so after the pass
JAX sees an effect-free function and ``jax.jit``'s C++ fast path stays in use.

Both lower to one ``xla_ffi_python_*_callback`` custom call with
``has_side_effect = true``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _placement
from jax_effects import _runtime_tokens


class HostCallback:
  """A host function run by a side-effect primitive.

  ``fn`` takes the flat operands as NumPy arrays and returns a tuple of NumPy
  arrays matching ``result_avals`` (checked here, with a message naming the
  callback). Compared and hashed by identity, as JAX requires of primitive
  parameters. ``traced_in_branch``: bound directly in a ``cond``/``switch``
  branch (see ``_transformation_rules``).
  """
  __slots__ = ("fn", "description", "result_avals", "traced_in_branch",
               "traced_in_while_cond", "__weakref__")

  def __init__(self, fn: Callable[..., Sequence[Any]], description: str,
               result_avals: tuple = ()):
    self.fn = fn
    self.description = description
    self.result_avals = result_avals
    self.traced_in_branch = False
    self.traced_in_while_cond = False

  def __repr__(self):
    return f"<host callback {self.description}>"

  def __call__(self, *args):
    results = self.fn(*args)
    avals = self.result_avals
    if not avals:
      return ()
    return check_results(self.description, results, avals)


def check_results(description, results, avals):
  if not isinstance(results, (tuple, list)) or len(results) != len(avals):
    n = len(results) if isinstance(results, (tuple, list)) else "a non-sequence"
    raise TypeError(
        f"{description} returned {n} results; expected {len(avals)} "
        f"(shapes/dtypes {[str(a.str_short()) for a in avals]})")
  out = []
  for i, (r, aval) in enumerate(zip(results, avals)):
    if isinstance(r, (np.ndarray, np.generic, jax.Array)):
      r = np.asarray(r)
    else:  # Python scalars and lists take the declared dtype, like literals
      r = np.asarray(r, dtype=aval.dtype)
    if r.shape != aval.shape or r.dtype != aval.dtype:
      raise TypeError(
          f"{description} result #{i} has shape {r.shape} and dtype {r.dtype}; "
          f"expected shape {aval.shape} and dtype {aval.dtype}")
    out.append(r)
  return tuple(out)


# --- trace-time primitive ------------------------------------------------------

effect_p = Primitive("jax_effects_effect")
effect_p.multiple_results = True


def _effect_abstract_eval(*avals, host_callback, effect, ordered, result_avals):
  del avals
  return result_avals, _effects.jax_effects_of(
      effect, ordered, host_callback.traced_in_while_cond)


effect_p.def_effectful_abstract_eval(_effect_abstract_eval)


def _effect_impl(*args, host_callback, effect, ordered, result_avals):
  """Eager execution: wait for this stream's earlier dispatches, then run."""
  if host_callback.traced_in_branch:  # a cond branch inlined by vmap
    from jax_effects import _transformation_rules
    raise _transformation_rules.branch_vmapped_error(host_callback)
  if _runtime_tokens._deferred:   # a dispatched callback failed: raise first
    _runtime_tokens.raise_deferred(_runtime_tokens.thread_tokens())
  if ordered:
    state = _runtime_tokens.thread_tokens()
    marker = _effects.marker(effect, True)
    mode = _effects.get_ordering()
    if state.mode != mode:   # after a mode switch: follow earlier dispatches
      _runtime_tokens.switch_mode(state, mode)
    key = _effects.chain_key(marker, mode)
    token = state.runtime.get(key)
    if token is not None:
      token.block_until_ready()
    # ... and for effects under plain jax.jit (incl. eager cond/while).
    token = _compat.jax_runtime_token(_effects.PLAIN_JIT_ORDER)
    if token is not None:
      token.block_until_ready()
  # Python scalars take JAX's canonical dtypes, as they do under jit.
  np_args = [np.asarray(a, dtype=jax.dtypes.canonicalize_dtype(np.asarray(a).dtype))
             for a in args]
  results = host_callback(*np_args)
  return [jnp.asarray(r) for r in results]


effect_p.def_impl(_effect_impl)


def _fallback_lowering(ctx, *args, host_callback, effect, ordered, result_avals):
  """Lowering under plain ``jax.jit`` (no token threading by jax_effects).

  An ordered effect carries JAX's ordered effect ``PLAIN_JIT_ORDER``: JAX
  passes its own compiler token for it (one stream for all effects) and
  threads runtime tokens between dispatches, so program order holds, through
  JAX's slower dispatch path. Unordered effects get no token.
  """
  del result_avals
  if host_callback.traced_in_branch and "_fun" not in str(ctx.name_stack):
    # A cond branch that vmap inlined (its predicate is batched): the cond
    # lowering names each branch's ops "branch_<i>_fun"; these have no branch.
    from jax_effects import _transformation_rules
    raise _transformation_rules.branch_vmapped_error(host_callback)
  marker = _effects.PLAIN_JIT_ORDER
  ordered = marker in _effects.jax_effects_of(
      effect, ordered, host_callback.traced_in_while_cond)
  token = ctx.tokens_in.get(marker) if ordered else None
  # Where it runs (device, shard): may add the partition id as an operand.
  operands, avals_in, wrap = _placement.attribute(
      ctx, list(args), list(ctx.avals_in), list(ctx.avals_out), threaded=False)
  sub_ctx = dataclasses.replace(ctx, avals_in=avals_in)
  results, token, _ = mlir.emit_python_callback(
      sub_ctx, wrap(_host_function(host_callback, with_carrier=False)), token,
      operands, avals_in, ctx.avals_out, has_side_effect=True,
      returns_token=ordered,
      sharding=_compat.callback_op_sharding(
          ctx.module_context.axis_context, None, ctx.avals_out))
  if ordered:
    # Uncacheable lowering: tokens_in holds every ordered effect of the
    # enclosing region (e.g. a cond's branches); pass the others through.
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({marker: token})))
  return results


mlir.register_lowering(effect_p, _fallback_lowering, cacheable=False)


# --- post-pass primitive -----------------------------------------------------

threaded_effect_p = Primitive("jax_effects_threaded_effect")
threaded_effect_p.multiple_results = True


def _threaded_abstract_eval(token, carrier, *avals, host_callback, result_avals):
  del avals, host_callback
  return [token, carrier, *result_avals]


threaded_effect_p.def_abstract_eval(_threaded_abstract_eval)


def _host_function(host_callback: HostCallback, with_carrier: bool):
  """The Python function XLA calls: runs the callback, records its errors."""
  if with_carrier:
    def host(carrier, *args):
      try:
        results = host_callback(*args)
      except BaseException as exc:  # reaches the caller as itself, once
        raise _runtime_tokens.record_error(exc) from None
      return (carrier, *results)
  else:
    def host(*args):
      try:
        return host_callback(*args)
      except BaseException as exc:
        raise _runtime_tokens.record_error(exc) from None
  return host


def _threaded_host(host_callback: HostCallback, result_avals: tuple):
  """The function XLA calls for a threaded effect (hot path, one frame).

  ``(token, carrier, *args) -> (token, carrier, *results)``: ``token`` is the
  None XLA passes for a ``!stablehlo.token`` operand and the placeholder it
  expects back; the carrier is returned as received. Results are converted
  and checked by :func:`check_results` (errors name the callback, expected
  and actual shape/dtype); a user exception is recorded, once.
  """
  fn = host_callback.fn
  description = host_callback.description
  if result_avals:
    def host(token, carrier, *args):
      try:
        results = check_results(description, fn(*args), result_avals)
      except BaseException as exc:  # reaches the caller as itself, once
        raise _runtime_tokens.record_error(exc) from None
      return (token, carrier, *results)
  else:
    def host(token, carrier, *args):
      try:
        fn(*args)
      except BaseException as exc:  # reaches the caller as itself, once
        raise _runtime_tokens.record_error(exc) from None
      return (token, carrier)
  return host


# Custom-call targets of JAX's Python callbacks (jaxlib registers them).
_FFI_TARGETS = {"cpu": "xla_ffi_python_cpu_callback",
                "cuda": "xla_ffi_python_gpu_callback",
                "rocm": "xla_ffi_python_gpu_callback"}
_ffi_lowerings: dict[str, Callable] = {}


def _emit_host_call(ctx, host, operands, sharding):
  """Emits the side-effecting Python-callback custom call for ``host``.

  What ``mlir.emit_python_callback`` emits (same target, ``index`` attribute,
  sharding annotation with an entry for the token), minus its per-call
  wrapper, which re-converts and re-checks every result and costs more than
  the rest of the callback. ``ctx`` has the token first in ``avals_in`` and
  ``avals_out``. Returns the op's results.
  """
  target = _FFI_TARGETS[ctx.module_context.platforms[0]]
  lower = _ffi_lowerings.get(target)
  if lower is None:
    lower = _ffi_lowerings[target] = jax.ffi.build_ffi_lowering_function(
        target, has_side_effect=True)
  ctx.module_context.add_host_callback(host)
  index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
  op = lower(ctx, *operands, index=index)
  if isinstance(sharding, _compat.SdyArrayList):
    # the token's entry, as emit_python_callback adds it
    sharding = _compat.SdyArrayList((
        _compat.SdyArray(
            mesh_shape=(), dim_shardings=(),
            logical_device_ids=sharding.shardings[0].logical_device_ids),
        *sharding.shardings))
  if sharding is not None:
    _compat.set_sharding(ctx.module_context, op, sharding)
  return op.results


def _threaded_lowering(ctx, token, carrier, *args, host_callback, result_avals):
  platforms = ctx.module_context.platforms
  sharding = _compat.callback_op_sharding(
      ctx.module_context.axis_context, None, ctx.avals_out[1:])
  if len(platforms) == 1 and platforms[0] in _FFI_TARGETS:
    # Where it runs (device, shard): may add the partition id as an operand.
    operands, avals_in, wrap = _placement.attribute(
        ctx, [token, carrier, *args], list(ctx.avals_in), list(ctx.avals_out),
        threaded=True, passthrough=2)
    return _emit_host_call(
        dataclasses.replace(ctx, avals_in=avals_in),
        wrap(_threaded_host(host_callback, tuple(result_avals))), operands,
        sharding)
  del result_avals
  # Other platforms (TPU): through emit_python_callback, which adds the token.
  operands, avals_in, wrap = _placement.attribute(
      ctx, [carrier, *args], list(ctx.avals_in[1:]), list(ctx.avals_out[1:]),
      threaded=True, passthrough=1)
  sub_ctx = dataclasses.replace(ctx, avals_in=avals_in,
                                avals_out=ctx.avals_out[1:])
  results, token, _ = mlir.emit_python_callback(
      sub_ctx, wrap(_host_function(host_callback, with_carrier=True)), token,
      operands, sub_ctx.avals_in, sub_ctx.avals_out,
      has_side_effect=True, returns_token=True, sharding=sharding)
  return [token, *results]


mlir.register_lowering(threaded_effect_p, _threaded_lowering, cacheable=False)
# The lowering reads the device assignment: which device runs each callback
# (device_id of log records, see _placement).
_compat.require_devices_during_lowering(threaded_effect_p)


def bind_effect(host_callback: HostCallback, flat_args: Sequence[Any], *,
                effect: _effects.Effect | None, ordered: bool | None,
                result_avals: tuple = ()) -> list:
  """Binds ``effect_p``: the one entry point of every user-facing effect.

  ``ordered=None`` takes the effect's own setting (``Effect.ordered``).
  """
  if effect is None:
    effect = _effects.DEFAULT
  elif not isinstance(effect, _effects.Effect):
    raise TypeError(
        f"{host_callback.description}: effect= must be a jax_effects.Effect or "
        f"None, got {effect!r}")
  if ordered is None:
    ordered = effect.ordered
  elif not isinstance(ordered, (bool, np.bool_)):
    raise TypeError(
        f"{host_callback.description}: ordered= must be a bool (or None for "
        f"the effect's setting), got {ordered!r}")
  host_callback.result_avals = tuple(result_avals)
  staging = _compat.enclosing_staging()
  host_callback.traced_in_branch = staging in ("cond", "switch")
  host_callback.traced_in_while_cond = staging == "while_cond"
  return effect_p.bind(*flat_args, host_callback=host_callback, effect=effect,
                       ordered=bool(ordered), result_avals=tuple(result_avals))
