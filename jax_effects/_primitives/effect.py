"""``effect_p``: the side-effect primitive user code binds while it is traced.

Every user-facing effect binds ``results = effect_p(*args; host_callback,
effect, ordered)`` through :func:`bind_effect`. Its rules (eager,
plain-``jax.jit`` lowering, vmap, jvp, transpose):
``design/transformations.md``.

Part in the token calling convention: none yet; the token-threading pass
replaces it with ``threaded.threaded_effect_p``. Under plain ``jax.jit`` an
ordered effect takes and returns JAX's compiler token for
``PLAIN_JIT_ORDER`` instead.

Also the questions both jaxpr walkers (``_pass.token_pass`` and the
masking of a vmapped ``cond`` branch, below) ask of an equation, answered
once: which equations hold effects of ours, and which ones
(:func:`holds_effect`).

And vmap of ``cond``/``while`` whose predicate is batched, with our effects
inside: JAX's vmap rules of these primitives are wrapped and run unchanged
unless the predicate is batched and a branch (or the loop) holds a
``jax_effects`` effect (``design/transformations.md``, "vmap of control
flow"): a ``cond`` branch's effects get ``index == i`` as a mask operand
(:func:`_cond_batcher`), and a ``while``'s effects are batched per element
(:func:`_while_batcher`). They produce ordinary ``effect_p`` equations,
which the pass threads like any other.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import jax
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._compat.core import primitives as jprims
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._core import jaxpr_eval as _jaxpr_eval
from jax_effects._primitives import batching as _batching
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_target as _host_target
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import token_store as _token_store

effect_p = jcore.Primitive("jax_effects_effect")
effect_p.multiple_results = True


def _effect_abstract_eval(*avals, host_callback, effect, ordered):
  del avals
  return host_callback.result_avals, _effects.jax_effects_of(
      effect, ordered, host_callback.user_code)


effect_p.def_effectful_abstract_eval(_effect_abstract_eval)


def _effect_impl(*args, host_callback, effect, ordered):
  """Eager execution: wait for this stream's earlier dispatches, then run."""
  if _fork.forked_after_backend:   # no JAX runtime after the fork
    raise _fork.refused(f"{host_callback.description}, run eagerly,")
  if host_callback.traced_in_branch:  # a cond branch inlined by vmap
    raise branch_vmapped_error(host_callback)
  if _errors.deferred:   # a dispatched callback failed: raise it first
    _errors.raise_deferred(_threads.thread_state())
  if ordered:
    state = _threads.thread_state()
    mode = _effects.get_ordering()
    if state.mode != mode:   # after a mode switch: follow earlier dispatches
      state.switch_mode(mode)
    key = _effects.chain_key(_effects.marker(effect, True), mode)
    state.wait_for((key,))
    # ... for effects under plain jax.jit (incl. eager cond/while), and
    # for exported jax_effects functions called outside jax_effects.jit.
    for jax_effect in (_effects.PLAIN_JIT_ORDER, _effects.EXPORTED_ORDER):
      token = _compat.jax_runtime_token(jax_effect)
      if token is not None:
        _token_store.settled(token)
  if host_callback.eager is not None:
    host_callback.eager(*args)
    return []
  # Python scalars take JAX's canonical dtypes, as they do under jit.
  np_args = [np.asarray(a, dtype=jax.dtypes.canonicalize_dtype(np.asarray(a).dtype))
             for a in args]
  return [jnp.asarray(r) for r in host_callback(*np_args)]


effect_p.def_impl(_effect_impl)


def fallback_lowering(ctx, *args, host_callback, effect, ordered):
  """Lowering under plain ``jax.jit`` (also ``counter.counter_p``'s), with
  JAX's compiler token of ``PLAIN_JIT_ORDER`` if ordered."""
  if (host_callback.traced_in_branch
      and not _compat.in_cond_branch(ctx.name_stack)):
    # A cond branch that vmap inlined (its predicate is batched).
    raise branch_vmapped_error(host_callback)
  marker = _effects.PLAIN_JIT_ORDER
  ordered = marker in _effects.jax_effects_of(effect, ordered, host_callback.user_code)
  # (in program order with JAX's own ordered callbacks: host_target.join)
  token = _host_target.join(ctx, marker) if ordered else None
  edges = _edges.of_operands(host_callback, len(args))
  # (summarized operands: only their edges cross)
  avals_in, args = _edges.cut(ctx, args, edges, first=0)
  args = _host_target.gathered(ctx, args, avals_in)
  # (may add the partition id as an operand)
  where, operands, avals_in = _placement.at_lowering(ctx, list(args), avals_in)
  side = _host_target.HostSide(host_callback, where, passthrough=0, threaded=False)
  results, token = _host_target.emit_ordered(
      ctx, side, token, operands, avals_in, ctx.avals_out,
      _compat.callback_op_sharding(
          ctx.module_context.axis_context, None, ctx.avals_out))
  if ordered:
    _host_target.set_joined(ctx, marker, token)
  return results


mlir.register_lowering(effect_p, fallback_lowering, cacheable=False)


class _BatchedControl(threading.local):
  """Depth of the vmap rules of control flow whose predicate is batched:
  an effect there runs per element even with no batched operand."""
  depth = 0


#: Read by the vmap rule of ``effect_p`` (one run when nothing is batched).
control_dependence = _BatchedControl()


def elements_in_batched_loop_error(description: str) -> NotImplementedError:
  """Counting a vmap's elements in a ``while_loop`` it batched (refused)."""
  return NotImplementedError(
      f"{description} counts the elements of a jax.vmap its bar was not "
      f"opened in (jax.lax.map with batch_size is one), but it is inside a "
      f"jax.lax.while_loop whose predicate jax.vmap batched: the elements "
      f"stop iterating at different steps, so the batch's steps are not its "
      f"elements' updates. Open the bar inside the vmapped function (one bar "
      f"for the batch, or per_element= for a bar per element), or update it "
      f"outside the while_loop.")


def _effect_batcher(axis_data, args, dims, *, host_callback, effect, ordered):
  if host_callback.batch_once:
    if any(d is not None for d in dims):
      raise NotImplementedError(
          f"{host_callback.description} runs once for a whole jax.vmap batch, "
          f"but jax.vmap batched one of its operands (it differs between the "
          f"elements: a batched count, or a branch of jax.lax.cond/switch "
          f"whose predicate is batched). Keep it out of per-element control "
          f"flow and pass values that are the same for every element, or run "
          f"the elements with jax.lax.map or in a shard_map.")
    if host_callback.counts_elements and control_dependence.depth:
      raise elements_in_batched_loop_error(host_callback.description)
  if host_callback.batch_once or (all(d is None for d in dims)
                                  and not control_dependence.depth):
    # One run (also where no operand depends on the batch index, e.g. the
    # primals under jacfwd, as jax.debug.print does): results unbatched.
    outs = effect_p.bind(*args, host_callback=host_callback, effect=effect,
                         ordered=ordered)
    return outs, [None] * len(outs)
  fn = host_callback.fn
  if isinstance(fn, _host_callback.BatchedHost):
    element, shape, levels = fn.element, fn.batch_shape, fn.levels
  else:
    element, shape, levels = host_callback, (), tuple(() for _ in args)
  new_args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
  new_levels = tuple((d is not None, *lv) for d, lv in zip(dims, levels))
  new_shape = (axis_data.size, *shape)
  batched = _host_callback.batched(
      host_callback, element, new_shape, new_levels,
      # (the batched form as data: another key than the element's)
      _host_callback.wrapped_spec(element.spec, "batched",
                                  shape=list(new_shape),
                                  levels=[list(lv) for lv in new_levels]))
  outs = effect_p.bind(*new_args, host_callback=batched, effect=effect, ordered=ordered)
  return outs, [0] * len(outs)


batching.fancy_primitive_batchers[effect_p] = _effect_batcher


def _effect_jvp(primals, tangents, **params):
  del tangents  # the host function sees primal values only
  outs = effect_p.bind(*primals, **params)
  return outs, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]


ad.primitive_jvps[effect_p] = _effect_jvp


def _effect_transpose(cts, *args, host_callback, effect, ordered):
  """An effect on linear values, transposed: dropped, as
  ``jax.debug.print`` is, unless its results are used (an error)."""
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


def branch_vmapped_error(host_callback) -> NotImplementedError:
  return NotImplementedError(
      f"{host_callback.description} is inside a branch of jax.lax.cond/switch "
      f"whose predicate jax.vmap batched: JAX then evaluates every branch for "
      f"every element (a select), so this effect would also run for the "
      f"elements that did not take its branch. Use jax.lax.map instead of "
      f"jax.vmap for this function, keep the predicate unbatched, or move the "
      f"effect out of the branch (e.g. a while_loop runs effects only for the "
      f"live iterations of each element).")


def bind_effect(fn: Callable[..., Sequence[Any]], description: str,
                flat_args: Sequence[Any], *, effect: _effects.Effect,
                ordered: bool, result_avals: tuple = (), edges: tuple = (),
                batchable: bool = False, **fields) -> list:
  """Binds ``effect_p``; the keywords after ``ordered`` but ``batchable``
  are the fields of the ``host_callback.HostCallback`` built here (its
  ``eager``, ``reads_placement``, ``batch_once``, ``counts_elements``,
  ``cleanup``, ``spec``, ``user_code``: a name it lacks is a TypeError).
  ``batchable``: a loop may stage it, inside ``jax_effects.batched``
  (``batching.offer``)."""
  staging = _compat.enclosing_staging()
  if staging == "pmap":   # legacy pmap staging (an option of JAX 0.8 and 0.9)
    _compat.require("effects in jax.pmap", description)
  if _compat.has_4bit_integers(flat_args):
    _compat.require("4-bit integer operands", description)
  host_callback = _host_callback.HostCallback(
      fn, description, tuple(result_avals), edges=tuple(edges),
      traced_in_branch=staging in ("cond", "switch"), **fields)
  if batchable and _batching.requested.request is not None:
    _batching.offer(host_callback)
  return effect_p.bind(*flat_args, host_callback=host_callback, effect=effect,
                       ordered=ordered)


# --- which equations hold effects of ours (both jaxpr walkers ask) ---------

#: Higher-order primitives whose equation does not report the effects of
#: its sub-computations: the walkers look inside. (Names: ``pallas_call``
#: lives in a module jax_effects does not import.)
HIDES_EFFECTS = frozenset({
    "composite", "linear_call", "reduce", "reduce_window", "pallas_call"})


def effects_inside(eqn) -> list[str]:
  """The descriptions of the effects in ``eqn``'s sub-computations."""
  found: list[str] = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive is effect_p:
        found.append(e.params["host_callback"].description)
      for sub in _compat.jaxprs_in_params(e.params):
        walk(sub)
  for sub in _compat.jaxprs_in_params(eqn.params):
    walk(sub)
  return found


def holds_effect(eqn) -> bool:
  """Whether ``eqn`` holds an effect of ours (maybe hidden inside)."""
  return _effects.has_own_marker(eqn.effects) or (
      eqn.primitive.name in HIDES_EFFECTS and bool(effects_inside(eqn)))


def first_effect(eqn) -> str:
  """The description of the first effect inside ``eqn`` (for errors)."""
  inside = effects_inside(eqn)
  return inside[0] if inside else "a jax_effects side effect"


# --- vmap of cond/while whose predicate is batched, our effects inside -------

def _has_marker(jaxprs) -> bool:
  """Whether any of ``jaxprs`` (or equations) carries an effect of ours."""
  return any(_effects.has_own_marker(j.effects) for j in jaxprs)


_jax_while_batcher = batching.fancy_primitive_batchers[jprims.while_p]


def _while_batcher(axis_data, args, dims, **params):
  """JAX's vmap rule; effects made per element if the predicate is batched."""
  cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
  cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
  if (control_dependence.depth or all(d is None for d in dims)
      or not _has_marker([cond_jaxpr, body_jaxpr])):
    return _jax_while_batcher(axis_data, args, dims, **params)
  batched = [d is not None for d in dims]
  cconst = batched[:cond_nconsts]
  bconst = batched[cond_nconsts:cond_nconsts + body_nconsts]
  carry = batched[cond_nconsts + body_nconsts:]
  # (instantiate=False, unlike JAX's rule: JAX caches batched jaxprs by their
  # in/out axes, and a probe traced outside ``control_dependence`` must never
  # be the entry JAX's final batching of the body (all outputs at axis 0)
  # finds. OR-ing with ``carry`` gives the same fixpoint.)
  for _ in range(1 + len(carry)):
    _, out = _compat.batch_jaxpr(body_jaxpr, axis_data, bconst + carry, False)
    new = [a or b for a, b in zip(carry, out)]
    if new == carry:
      break
    carry = new
  _, (pred,) = _compat.batch_jaxpr(cond_jaxpr, axis_data, cconst + carry, False)
  if not pred:
    return _jax_while_batcher(axis_data, args, dims, **params)
  control_dependence.depth += 1
  try:
    return _jax_while_batcher(axis_data, args, dims, **params)
  finally:
    control_dependence.depth -= 1


batching.fancy_primitive_batchers[jprims.while_p] = _while_batcher


def _eval_masked(jaxpr, consts, mask, args):
  """Evaluates ``jaxpr`` with ``mask`` (this element took the branch) as
  the first operand of every effect in it, at any depth."""
  def handle(eqn, invals):
    if eqn.primitive is effect_p:
      hc = eqn.params["host_callback"]
      masked = _host_callback.in_branch(hc, _host_callback.wrapped_spec(hc.spec, "masked"))
      return effect_p.bind(mask, *invals, **{**eqn.params, "host_callback": masked})
    if holds_effect(eqn):
      return _masked_higher_order(eqn, mask, invals)
    return _jaxpr_eval.rebind(eqn, invals)
  return _jaxpr_eval.eval_jaxpr(jaxpr, consts, args, handle)


def _closed_fn(closed, mask, leading=()):
  """``closed`` as a function evaluated by :func:`_eval_masked`."""
  jaxpr, consts = _jaxpr_eval.split(closed)
  return lambda *args: _eval_masked(jaxpr, consts, mask, [*leading, *args])


def _masked_cond(p, mask, invals):
  index, *ops = invals
  return jax.lax.switch(index, [_closed_fn(b, mask) for b in p["branches"]], *ops)


def _masked_while(p, mask, invals):
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cond = _closed_fn(p["cond_jaxpr"], mask, invals[:cn])
  body = _closed_fn(p["body_jaxpr"], mask, invals[cn:cn + bn])
  return jax.lax.while_loop(lambda c: cond(*c)[0], lambda c: body(*c),
                            list(invals[cn + bn:]))


def _masked_scan(p, mask, invals):
  nc, ncarry = _compat.scan_counts(p)
  body = _closed_fn(p["jaxpr"], mask, invals[:nc])

  def step(carry, xs):
    outs = body(*carry, *xs)
    return outs[:ncarry], outs[ncarry:]
  carry, ys = jax.lax.scan(step, list(invals[nc:nc + ncarry]),
                           list(invals[nc + ncarry:]), length=p["length"],
                           reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *ys]


#: Primitive -> ``rule(params, mask, invals) -> outputs``: the primitive
#: re-expressed with ``lax`` around masked sub-computations.
MASK_RULES = {jprims.cond_p: _masked_cond, jprims.while_p: _masked_while,
              jprims.scan_p: _masked_scan}


def _masked_higher_order(eqn, mask, invals):
  rule = MASK_RULES.get(eqn.primitive)
  if rule is not None:
    return rule(eqn.params, mask, invals)
  if eqn.primitive in _jaxpr_eval.CALLEES:
    callee = eqn.params[_jaxpr_eval.CALLEES[eqn.primitive]]
    return _closed_fn(callee, mask)(*invals)
  name = eqn.primitive.name
  raise NotImplementedError(
      f"{first_effect(eqn)} is inside JAX's higher-order primitive "
      f"'{name}' inside a branch of jax.lax.cond/switch whose predicate "
      f"jax.vmap batched; jax_effects cannot run it only for the elements "
      f"that took the branch. Use jax.lax.map instead of jax.vmap, keep the "
      f"predicate unbatched, or move the effect out of the '{name}'.")


_jax_cond_batcher = batching.fancy_primitive_batchers[jprims.cond_p]


def _cond_batcher(axis_data, args, dims, *, branches, **params):
  """JAX's vmap rule, or each branch's effects masked by ``index == i``."""
  if (dims[0] is None or "branches_platforms" in params
      or not _has_marker(branches)
      or any(_compat.refused_by_jax_in_batched_cond(e)
             for b in branches for e in b.effects)):
    return _jax_cond_batcher(axis_data, args, dims, branches=branches, **params)
  size = axis_data.size
  mesh_axis = getattr(axis_data, "explicit_mesh_axis", None)
  index, *ops = (batching.bdim_at_front(x, d, size, mesh_axis=mesh_axis)
                 for x, d in zip(args, dims))
  n_outs = len(branches[0].out_avals)
  branch_outs = []
  for i, branch in enumerate(branches):
    traced = _jax_api.make_jaxpr(
        lambda m, *xs, b=branch: _eval_masked(b.jaxpr, b.consts, m, xs))(
            jax.ShapeDtypeStruct((), np.bool_),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in branch.in_avals))
    batched, _ = _compat.batch_jaxpr(traced, axis_data,
                                     [True] * (1 + len(ops)), [True] * n_outs)
    taken = jax.lax.eq(index, jax.lax.full_like(index, i))
    ops_ = [_bcast_select_n(taken, jax.lax.stop_gradient(x), x) for x in ops]
    branch_outs.append(jcore.jaxpr_as_fun(batched)(taken, *ops_))
  outs = [_bcast_select_n(index, *o) for o in zip(*branch_outs)]
  return outs, [0] * len(outs)


def _bcast_select_n(which, *cases):
  if jnp.ndim(which) != jnp.ndim(cases[0]):
    which = jax.lax.broadcast_in_dim(which, jnp.shape(cases[0]),
                                     tuple(range(jnp.ndim(which))))
  return jax.lax.select_n(which, *cases)


batching.fancy_primitive_batchers[jprims.cond_p] = _cond_batcher
