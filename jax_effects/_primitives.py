"""The two side-effect primitives, before and after token threading.

``effect_p`` is what user-facing functions (``print``, ``log``, ``callback``)
bind while a program is being traced::

    results = effect_p(*args; host_callback, effect, ordered)

(``host_callback``, a :class:`~jax_effects._host.HostCallback`, holds the
host function and ``result_avals``.) It carries a
:class:`~jax_effects._effects.TraceEffect` marker so JAX keeps it through its
transformations, and every rule of it lives here: abstract evaluation, the
eager impl, a fallback lowering for plain ``jax.jit``, and the rules that act
when a user's function is *traced* (before the pass), inside
``jax_effects.jit``, under plain ``jax.jit`` and eagerly alike (see
``design/transformations.md``):

* **vmap** (a *fancy* batcher, called even when no operand is batched): the
  equation is re-bound with a :class:`~jax_effects._host.BatchedHost` that
  runs the user's host function once per batch element, in batch
  (row-major) order, and stacks the results. Nested vmaps flatten into one
  ``BatchedHost`` with a multi-dimensional ``batch_shape`` (outermost vmap
  first); an operand that is not batched at some level is not broadcast,
  just reused for every element.
* **jvp**: the effect runs once, on the primal values; tangents of its
  results are symbolic zeros (host results are not differentiable). There is
  no linear part, so linearize/vjp/grad never stage an effect into the
  tangent or cotangent computation, and rematerialization
  (``jax.checkpoint``) never re-runs it: the equation carries a marker JAX
  keeps in the primal ("known") computation (``partial_eval_kept_effects``).
* **vmap of cond/switch with a batched predicate**: JAX converts it to a
  ``select`` that evaluates every branch, erasing the ``cond``. An effect
  records at bind time whether it was traced directly in a ``cond`` branch
  (``HostCallback.traced_in_branch``); the pass (and the eager impl) then
  reports an effect that reappears outside any branch with an error naming
  the limitation (:func:`branch_vmapped_error`).

``threaded_effect_p`` is what the token-threading pass replaces it with::

    token', carrier', results = threaded_effect_p(token, carrier, *args;
                                                  host_callback, entry,
                                                  ordered)

``token`` is a *compiler token* (``!stablehlo.token``): consecutive side
effects of one chain are linked by it in the program. ``carrier`` is an
``int32`` scalar standing for the same chain where a token cannot go (across
``cond``/``while``/``scan`` boundaries, and out to the runtime token): the
host callback takes it as an operand and returns it, a real data dependency
XLA must respect, so it is what orders the lowered calls (the custom call
does not take the token on CPU and GPU, see :func:`_threaded_lowering`). Its
value is the dispatching thread's slot and the ``FAILED`` bit
(``design/errors.md``); ``entry``: the carrier is the chain's runtime token
and this effect runs once per execution, so a ``FAILED`` bit there is an
earlier execution's and the host clears it; ``ordered``: the chain is an
ordered one (its carrier comes from a runtime token; an unordered chain's
starts at 0 in every execution). The primitive has *no* JAX-level
effect, so after the pass JAX sees an effect-free function and ``jax.jit``'s
C++ fast path stays in use.

Both lower to one ``xla_ffi_python_*_callback`` custom call with
``has_side_effect = true``. In a computation over several devices under
automatic partitioning, where the effect runs once, that call is made
inside a ``shard_map`` by the first device only (:func:`_on_first_device`:
the carrier stays replicated, so no device waits in a collective for a
callback); ``from_first_device_p`` takes a carrier from that device where
per-device effects follow. An operand ``print``/``log`` will show summarized
is cut to its edges before the call (``_edges``), or, in that case, taken
from the devices' shards on the host (``_host_assembly``: every device
makes a call, the first one runs the effect).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _errors
from jax_effects import _host
from jax_effects import _host_assembly
from jax_effects import _placement
from jax_effects import _runtime_tokens


# --- trace-time primitive ------------------------------------------------------

effect_p = Primitive("jax_effects_effect")
effect_p.multiple_results = True


def _effect_abstract_eval(*avals, host_callback, effect, ordered):
  del avals
  return host_callback.result_avals, _effects.jax_effects_of(
      effect, ordered, host_callback.traced_in_while_cond)


effect_p.def_effectful_abstract_eval(_effect_abstract_eval)


def _effect_impl(*args, host_callback, effect, ordered):
  """Eager execution: wait for this stream's earlier dispatches, then run."""
  if host_callback.traced_in_branch:  # a cond branch inlined by vmap
    raise branch_vmapped_error(host_callback)
  if _errors.deferred:   # a dispatched callback failed: raise it first
    _runtime_tokens.raise_deferred(_runtime_tokens.thread_state())
  if ordered:
    state = _runtime_tokens.thread_state()
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
  if host_callback.eager is not None:
    host_callback.eager(*args)
    return []
  # Python scalars take JAX's canonical dtypes, as they do under jit.
  np_args = [np.asarray(a, dtype=jax.dtypes.canonicalize_dtype(np.asarray(a).dtype))
             for a in args]
  edges = _operand_edges(host_callback, len(np_args))
  np_args = [a if e is None else e.take_numpy(a)
             for a, e in zip(np_args, edges)]
  results = host_callback(*np_args)
  return [jnp.asarray(r) for r in results]


effect_p.def_impl(_effect_impl)


def _gathered(ctx, args, avals) -> list:
  """The array operands of a callback that runs once, annotated replicated.

  Under automatic partitioning over several devices the callback runs on
  one device (MAXIMAL sharding). A sharded operand going straight there is
  what XLA's partitioner calls an "involuntary full rematerialization" (and
  warns about on stderr); through a replicated annotation it becomes an
  all-gather, the same data movement, without the warning. Per-device
  callbacks (manual ``shard_map``) and single-device programs are left as
  they are.
  """
  axis_context = ctx.module_context.axis_context
  if (not isinstance(axis_context, _compat.ShardingContext)
      or axis_context.num_devices <= 1):
    return list(args)
  return [_compat.replicated(ctx, x, aval) if aval.shape else x
          for x, aval in zip(args, avals)]


def _fallback_lowering(ctx, *args, host_callback, effect, ordered):
  """Lowering under plain ``jax.jit`` (no token threading by jax_effects).

  An ordered effect carries JAX's ordered effect ``PLAIN_JIT_ORDER``: JAX
  passes its own compiler token for it (one stream for all effects) and
  threads runtime tokens between dispatches, so program order holds, through
  JAX's slower dispatch path. Unordered effects get no token.
  """
  if host_callback.traced_in_branch and "_fun" not in str(ctx.name_stack):
    # A cond branch that vmap inlined (its predicate is batched): the cond
    # lowering names each branch's ops "branch_<i>_fun"; these have no branch.
    raise branch_vmapped_error(host_callback)
  marker = _effects.PLAIN_JIT_ORDER
  ordered = marker in _effects.jax_effects_of(
      effect, ordered, host_callback.traced_in_while_cond)
  token = ctx.tokens_in.get(marker) if ordered else None
  edges = _operand_edges(host_callback, len(args))
  avals_in = list(ctx.avals_in)
  if any(edges):
    avals_in, args = _cut_edges(ctx, args, edges, first=0)
  args = _gathered(ctx, args, avals_in)
  # Where it runs (device, shard): may add the partition id as an operand.
  where, operands, avals_in = _placement.at_lowering(
      ctx, list(args), avals_in)
  sub_ctx = dataclasses.replace(ctx, avals_in=avals_in)
  host = _host.host_function(host_callback, where, passthrough=0,
                             threaded=False, avals_out=ctx.avals_out)
  results, token, _ = mlir.emit_python_callback(
      sub_ctx, host, token,
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


# --- vmap ------------------------------------------------------------------------

class _BatchedControl(threading.local):
  """Depth of the vmap rules of control flow whose predicate is batched.

  While JAX's rule of such a ``while_loop`` batches the body and ``cond_fun``,
  an effect there depends on the batch index through the predicate (it runs
  for an element only while that element iterates) even if none of its
  operands does: it is batched per element, so the pass can skip the
  finished elements (``_host.masked``).
  """
  depth = 0


#: Read by the vmap rule of ``effect_p`` (one run when nothing is batched).
control_dependence = _BatchedControl()


@contextlib.contextmanager
def control_dependent():
  control_dependence.depth += 1
  try:
    yield
  finally:
    control_dependence.depth -= 1


def _effect_batcher(axis_data, args, dims, *, host_callback, effect, ordered):
  if all(d is None for d in dims) and not control_dependence.depth:
    # No operand depends on the batch index (e.g. the primal values under
    # jacfwd/hessian, whose tangents vmap batches): one run, as
    # jax.debug.print does; its results are the same for every element.
    outs = effect_p.bind(*args, host_callback=host_callback, effect=effect,
                         ordered=ordered)
    return outs, [None] * len(outs)
  size = axis_data.size
  fn = host_callback.fn
  if isinstance(fn, _host.BatchedHost):
    element, shape, levels = fn.element, fn.batch_shape, fn.levels
    element_avals = fn.element_avals
  else:
    element, shape, levels = host_callback, (), tuple(() for _ in args)
    element_avals = host_callback.result_avals
  new_args, new_levels = [], []
  for x, d, lv in zip(args, dims, levels):
    if d is None:
      new_args.append(x)
      new_levels.append((False, *lv))
    else:
      new_args.append(jnp.moveaxis(x, d, 0))
      new_levels.append((True, *lv))
  new_shape = (size, *shape)
  new_avals = tuple(jax.core.ShapedArray(new_shape + a.shape, a.dtype)
                    for a in element_avals)
  batched = dataclasses.replace(
      host_callback,
      fn=_host.BatchedHost(element, new_shape, tuple(new_levels),
                           element_avals),
      result_avals=new_avals, eager=None)   # eager too: once per element
  outs = effect_p.bind(*new_args, host_callback=batched, effect=effect,
                       ordered=ordered)
  return outs, [0] * len(outs)


batching.fancy_primitive_batchers[effect_p] = _effect_batcher


# --- jvp -------------------------------------------------------------------------

def _effect_jvp(primals, tangents, **params):
  del tangents  # the host function sees primal values only
  outs = effect_p.bind(*primals, **params)
  return outs, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]


ad.primitive_jvps[effect_p] = _effect_jvp


def _effect_transpose(cts, *args, host_callback, effect, ordered):
  """An effect whose operands are linear values (tangents), transposed.

  Only code that passes tangents to an effect explicitly puts one in the
  linear part of a derivative: a ``custom_jvp`` rule printing its tangent, or
  a function given to ``linear_transpose``. The reverse pass computes
  cotangents, never those tangents, so, as ``jax.debug.print`` does there,
  the effect is dropped (forward mode, ``jvp``/``linearize``, runs it with
  the tangents). A callback whose results the linear computation uses has no
  transpose: that is an error naming it.
  """
  del effect, ordered
  if any(type(ct) is not ad.Zero for ct in cts):
    raise NotImplementedError(
        f"{host_callback.description} takes tangents (it is in the linear "
        f"part of a derivative, e.g. in a jax.custom_jvp rule) and its "
        f"results are used there, so reverse-mode differentiation (grad, "
        f"vjp, linear_transpose) would have to transpose the host function. "
        f"Compute the callback from primal values, or give the function a "
        f"jax.custom_vjp rule.")
  return [None] * len(args)


ad.primitive_transposes[effect_p] = _effect_transpose


# --- vmap of cond with a batched predicate -------------------------------------

def branch_vmapped_error(host_callback) -> NotImplementedError:
  return NotImplementedError(
      f"{host_callback.description} is inside a branch of jax.lax.cond/switch "
      f"whose predicate jax.vmap batched: JAX then evaluates every branch for "
      f"every element (a select), so this effect would also run for the "
      f"elements that did not take its branch. Use jax.lax.map instead of "
      f"jax.vmap for this function, keep the predicate unbatched, or move the "
      f"effect out of the branch (e.g. a while_loop runs effects only for the "
      f"live iterations of each element).")


# --- post-pass primitive -----------------------------------------------------

threaded_effect_p = Primitive("jax_effects_threaded_effect")
threaded_effect_p.multiple_results = True


def _threaded_abstract_eval(token, carrier, *avals, host_callback, entry,
                            ordered):
  del avals, entry, ordered
  return [token, carrier, *host_callback.result_avals]


threaded_effect_p.def_abstract_eval(_threaded_abstract_eval)


# Custom-call targets of JAX's Python callbacks (jaxlib registers them).
_FFI_TARGETS = {"cpu": "xla_ffi_python_cpu_callback",
                "cuda": "xla_ffi_python_gpu_callback",
                "rocm": "xla_ffi_python_gpu_callback"}
_ffi_lowerings: dict[str, Callable] = {}


def _emit_host_call(ctx, host, operands, sharding, target=None):
  """Emits the side-effecting Python-callback custom call for ``host``.

  What ``mlir.emit_python_callback`` emits (same target, ``index`` attribute,
  sharding annotation), minus its per-call wrapper, which re-converts and
  re-checks every result and costs more than the rest of the callback, and
  minus the compiler token: the carrier operand orders the call after the
  chain's previous effect (see ``_threaded_lowering``). ``ctx`` has the
  operands' and results' avals. Returns the op's results. ``target``: another
  of jaxlib's callback targets (``_host_assembly``'s partitioned one).
  """
  if target is None:
    target = _FFI_TARGETS[ctx.module_context.platforms[0]]
  lower = _ffi_lowerings.get(target)
  if lower is None:
    lower = _ffi_lowerings[target] = jax.ffi.build_ffi_lowering_function(
        target, has_side_effect=True)
  ctx.module_context.add_host_callback(host)
  index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
  op = lower(ctx, *operands, index=index)
  if sharding is not None:
    _compat.set_sharding(ctx.module_context, op, sharding)
  return op.results


def _threaded_lowering(ctx, token, carrier, *args, host_callback, entry,
                       ordered):
  """Lowers one threaded effect to a host callback ``carrier', results =
  host(carrier, *args)``.

  The compiler token is threaded through the program by the pass, but the
  custom call need not take it: the carrier is an operand and a result of
  every effect of the chain, a data dependency that orders the call after
  the chain's previous effect as the token would, and the token costs an
  operand and a result of every call (about 3% of a whole dispatch). The
  token operand is returned as this effect's token result; XLA removes the
  unused ``create_token``. (On platforms without JAX's FFI callback target,
  ``emit_python_callback`` takes the token itself.)

  Operands with :class:`~jax_effects._edges.Edges` (``print``/``log``
  operands NumPy will summarize) are cut to their edges first; under
  automatic partitioning over several devices the devices pass their parts
  to the host instead, where ``_host_assembly`` applies (``ordered``: the
  carrier holds the dispatching thread's slot).
  """
  edges = _operand_edges(host_callback, len(args))
  if (any(edges) or _host_assembly.WHOLE_ON_HOST) and _once_across_devices(
      ctx) and _host_assembly.applies(ctx, host_callback, len(args),
                                      ctx.avals_in[2:], edges, ordered):
    where, _, _ = _placement.at_lowering(ctx, [], [])
    mesh_and_names = _all_devices_mesh(
        ctx.module_context.axis_context.num_devices)
    return [token, *_host_assembly.lower(
        ctx, host_callback, entry, carrier, args, edges,
        mesh_and_names=mesh_and_names, where=where, emit=_emit_host_call)]
  if any(edges):
    avals_in, args = _cut_edges(ctx, args, edges, first=2)
    ctx = dataclasses.replace(ctx, avals_in=avals_in)   # (sets no tokens)
  platforms = ctx.module_context.platforms
  sharding = _compat.callback_op_sharding(
      ctx.module_context.axis_context, None, ctx.avals_out[1:])
  args = _gathered(ctx, args, ctx.avals_in[2:])
  # Where it runs (device, shard): may add the partition id as an operand.
  where, operands, avals_in = _placement.at_lowering(
      ctx, [carrier, *args], list(ctx.avals_in[1:]))
  host = _host.host_function(host_callback, where, passthrough=1,
                             threaded=True, avals_out=ctx.avals_out[1:],
                             entry=entry)
  sub_ctx = dataclasses.replace(ctx, avals_in=avals_in,
                                avals_out=ctx.avals_out[1:])
  if len(platforms) == 1 and platforms[0] in _FFI_TARGETS:
    if _once_across_devices(ctx):
      return [token, *_on_first_device(sub_ctx, host, operands)]
    return [token, *_emit_host_call(sub_ctx, host, operands, sharding)]
  # Other platforms (TPU): through emit_python_callback, which adds the token.
  results, token, _ = mlir.emit_python_callback(
      sub_ctx, host, token,
      operands, sub_ctx.avals_in, sub_ctx.avals_out,
      has_side_effect=True, returns_token=True, sharding=sharding)
  return [token, *results]


def _operand_edges(host_callback, n_args: int) -> tuple:
  """One :class:`~jax_effects._edges.Edges` or None per operand:
  ``host_callback.edges`` belong to the last operands (those the front end
  bound; ``vmap`` of ``cond``/``while`` adds mask operands in front)."""
  edges = host_callback.edges
  return (None,) * (n_args - len(edges)) + tuple(edges)


def _cut_edges(ctx, args, edges, first: int):
  """``(avals_in', args')``: the operands with edges cut to them (where they
  are whole: one device, per device in ``shard_map``; under automatic
  partitioning the partitioner moves the small edges where they go), and
  ``ctx.avals_in`` with theirs. ``first``: the position of the first
  operand in ``ctx.avals_in``."""
  avals = list(ctx.avals_in)
  args = list(args)
  for i, e in enumerate(edges):
    if e is None:
      continue
    aval = avals[first + i]
    cut_aval = jax.core.ShapedArray(
        aval.shape[:aval.ndim - len(e.shape)] + e.reduced_shape, aval.dtype)
    (args[i],) = mlir.lower_fun(lambda x, e=e: [e.take(x)],
                                multiple_results=True)(
        dataclasses.replace(ctx, avals_in=[aval], avals_out=[cut_aval]),
        args[i])
    avals[first + i] = cut_aval
  return avals, args


def _once_across_devices(ctx) -> bool:
  """Whether ``ctx`` lowers a computation over several devices under
  automatic partitioning, where a callback runs once, on the first device."""
  axis_context = ctx.module_context.axis_context
  return (isinstance(axis_context, _compat.ShardingContext)
          and axis_context.num_devices > 1)


def _on_first_device(ctx, host, operands) -> list:
  """The host call of an effect that runs once in a computation over several
  devices, with a carrier no other device waits for.

  JAX's rule for such a callback (``MAXIMAL`` sharding on device 0) makes
  its carrier a value only device 0 holds; wherever the chain then needs a
  replicated value (the carry of a loop, the executable's token) the
  partitioner broadcasts it from device 0 with an all-reduce, every
  iteration and at the end, in which the other devices wait for the
  callback: a callback that takes longer than XLA's collective timeout (a
  debugger, ``input()``) aborts the process, and executions in flight on
  several threads stall on the rendezvous. Instead the call is made inside a
  ``shard_map`` over all the devices, as a per-device call that only the
  first device's branch of a ``cond`` makes (the others pass their copy of
  the carrier through)::

      carrier', results = shard_map(
          lambda c, *a: cond(axis_index == 0, host_call, pass_through, c, *a),
          in_specs=P(), out_specs=P())(carrier, *args)

  The carrier stays replicated, as the partitioner sees it, and needs no
  collective anywhere; device 0's copy is the chain's (the others' copies
  are stale and never read by a callback: a ``shard_map`` whose per-device
  effects follow takes it from device 0, see :data:`from_first_device_p`,
  and the runtime token is device 0's copy, ``_compat.uncommitted``).
  Results are device 0's (annotated so, ``_compat.on_first_device``): where
  other devices use them the partitioner broadcasts them, as for JAX's own
  callbacks. ``ctx`` has the operands' and results' avals.
  """
  avals_out = tuple(ctx.avals_out)
  mesh, names = _all_devices_mesh(ctx.module_context.axis_context.num_devices)

  def call(*ops):
    return tuple(first_device_call_p.bind(*ops, host=host,
                                          avals_out=avals_out))

  def pass_through(carrier, *ops):
    return (carrier, *(jnp.zeros(a.shape, a.dtype) for a in avals_out[1:]))

  def per_device(*ops):
    first = jax.lax.axis_index(names) == 0
    return jax.lax.cond(first, call, pass_through, *ops)

  mapped = jax.shard_map(per_device, mesh=mesh,
                         in_specs=(P(),) * len(operands),
                         out_specs=(P(),) * len(avals_out), check_vma=False)
  # (Operands are whole on every device, _gathered; under an explicit mesh
  # their types say so too, as shard_map's in_specs require.)
  ctx = dataclasses.replace(ctx, avals_in=[_unsharded(a) for a in ctx.avals_in])
  carrier, *results = mlir.lower_fun(mapped, multiple_results=True)(
      ctx, *operands)
  return [carrier, *(_compat.on_first_device(ctx, r, a)
                     for r, a in zip(results, avals_out[1:]))]


def _unsharded(aval):
  """``aval`` with a replicated sharding in its type (explicit sharding)."""
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", ())
  if any(s is not None for s in spec):
    return aval.update(sharding=jax.sharding.NamedSharding(sharding.mesh, P()))
  return aval


def _all_devices_mesh(num_devices: int):
  """``(mesh, axis_names)`` spanning the ``num_devices`` devices of the
  computation being lowered, whose flat axis index is the partition id: the
  user's ambient mesh if one of that size is set (``jax.shard_map`` requires
  the context's mesh), else a one-axis abstract mesh of our own."""
  context = jax.sharding.get_abstract_mesh()
  if (context is not None and not context.empty
      and context.size == num_devices):
    return context, tuple(context.axis_names)
  names = ("jax_effects_devices",)
  return jax.sharding.AbstractMesh((num_devices,), names), names


# The host call inside _on_first_device's shard_map (a per-device custom call
# there: the cond makes it on device 0 only).
first_device_call_p = Primitive("jax_effects_first_device_call")
first_device_call_p.multiple_results = True
# (The carrier keeps its operand's type and the results are strong-typed, as
# the pass-through branch's are: cond requires equal types.)
first_device_call_p.def_abstract_eval(
    lambda carrier, *avals, host, avals_out: [
        carrier, *(a.update(weak_type=False) for a in avals_out[1:])])


def _first_device_call_lowering(ctx, *operands, host, avals_out):
  sharding = _compat.callback_op_sharding(
      ctx.module_context.axis_context, None, avals_out)
  return _emit_host_call(ctx, host, operands, sharding)


mlir.register_lowering(first_device_call_p, _first_device_call_lowering,
                       cacheable=False)


# Identity on a carrier that enters a shard_map (``_shard_map_rule``): where
# the chain's last effect ran once on the first device of several
# (_on_first_device), only device 0's copy is current, so it is broadcast from
# there; every device's effects inside then follow that effect.
from_first_device_p = Primitive("jax_effects_from_first_device")
from_first_device_p.def_abstract_eval(lambda aval: aval)
from_first_device_p.def_impl(lambda x: x)


def _from_first_device_lowering(ctx, x):
  if _once_across_devices(ctx):
    return [_compat.on_first_device(ctx, x, ctx.avals_in[0])]
  return [x]


mlir.register_lowering(from_first_device_p, _from_first_device_lowering)


mlir.register_lowering(threaded_effect_p, _threaded_lowering, cacheable=False)
# The lowering reads the device assignment: which device runs each callback
# (device_id of log records, see _placement).
_compat.require_devices_during_lowering(threaded_effect_p)


def bind_effect(fn: Callable[..., Sequence[Any]], description: str,
                flat_args: Sequence[Any], *, effect: _effects.Effect,
                ordered: bool, result_avals: tuple = (),
                eager: Callable[..., None] | None = None,
                reads_placement: bool = False, edges: tuple = ()) -> list:
  """Binds ``effect_p``: the one entry point of every user-facing effect.

  ``effect``/``ordered`` are resolved (``_effects.resolve``); ``fn`` is the
  host side (flat NumPy operands -> results matching ``result_avals``);
  ``eager`` its eager form and ``reads_placement`` whether it reads its
  placement on every run (see :class:`~jax_effects._host.HostCallback`,
  built here, complete); ``edges`` one :class:`~jax_effects._edges.Edges`
  or None per operand: ``fn`` receives the operands with edges cut to them.
  """
  staging = _compat.enclosing_staging()
  if staging == "pmap":   # legacy pmap staging (an option of JAX 0.8 and 0.9)
    _compat.require("effects in jax.pmap", description)
  if _compat.has_4bit_integers(flat_args):
    _compat.require("4-bit integer operands", description)
  host_callback = _host.HostCallback(
      fn, description, tuple(result_avals),
      traced_in_branch=staging in ("cond", "switch"),
      traced_in_while_cond=staging == "while_cond", eager=eager,
      reads_placement=reads_placement, edges=tuple(edges))
  return effect_p.bind(*flat_args, host_callback=host_callback, effect=effect,
                       ordered=ordered)
